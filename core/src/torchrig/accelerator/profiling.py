"""``accelerator.profile()``: torch.profiler configured by :class:`~torchrig.config.options.ProfileKwargs`,
with the Chrome trace written where Accelerate writes it (``output_trace_dir/profile_{process_index}.json``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from torchrig.config.options import ProfileKwargs

#: Accelerate's trace file name (``PROFILE_PATTERN_NAME``), one per process.
TRACE_FILE_PATTERN = "profile_{suffix}.json"


def profile_options(config: Mapping[str, Any]) -> ProfileKwargs:
    """The run's ``profile_kwargs`` section (``Accelerator(kwargs_handlers=[ProfileKwargs(...)])``, a config
    file or the environment) as a :class:`ProfileKwargs`."""
    return ProfileKwargs(**{field.name: config[f"profile_kwargs.{field.name}"] for field in attrs.fields(ProfileKwargs)})


def _activity(name: str) -> Any:
    member = getattr(torch.profiler.ProfilerActivity, str(name).upper(), None)
    if member is None:
        raise ValueError(f"ProfileKwargs.activities: {name!r} is not profiled by this torch build "
                         f"({torch.__version__}); available: "
                         f"{sorted(a.name.lower() for a in torch.profiler.supported_activities())}")
    return member


def build_profiler(options: ProfileKwargs) -> torch.profiler.profile:
    """A ``torch.profiler.profile`` from ``options`` (Accelerate's ``ProfileKwargs.build``)."""
    activities = None if options.activities is None else [_activity(name) for name in options.activities]
    schedule = None if options.schedule_option is None else torch.profiler.schedule(**options.schedule_option)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=options.on_trace_ready,
                                  record_shapes=options.record_shapes, profile_memory=options.profile_memory,
                                  with_stack=options.with_stack, with_flops=options.with_flops,
                                  with_modules=options.with_modules)


@contextmanager
def profile_run(accelerator: Any, options: ProfileKwargs) -> Iterator[torch.profiler.profile]:
    """Profile the block; afterwards write this process's trace if ``output_trace_dir`` is set, then wait for
    every process (so rank 0 may read all traces once the block returns everywhere)."""
    with build_profiler(options) as profiler:
        yield profiler
    if options.output_trace_dir is None:
        return
    os.makedirs(options.output_trace_dir, exist_ok=True)
    trace = os.path.join(options.output_trace_dir, TRACE_FILE_PATTERN.format(suffix=accelerator.process_index))
    profiler.export_chrome_trace(trace)
    accelerator.wait_for_everyone()


__all__ = ["TRACE_FILE_PATTERN", "build_profiler", "profile_options", "profile_run"]
