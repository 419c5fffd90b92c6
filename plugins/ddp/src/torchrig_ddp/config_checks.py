"""DDP's configuration checks (``torchrig_validate_config``): combinations DDP accepts at
construction but fails on at the first backward, or ignores.

Reads the typed section (:class:`~torchrig_ddp.options.DistributedDataParallelKwargs`, whose
defaults are the only ones) and the core's (:class:`CoreOptions`). Torch-free at import: torch is
imported only when a bf16 hook or a PowerSGD state is configured.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torchrig.plugin import ConfigProblem, CoreOptions, ResolvedConfig, suggest

from torchrig_ddp.constants import POWER_SGD_HOOKS, SECTION
from torchrig_ddp.options import DistributedDataParallelKwargs


def ddp_problems(config: ResolvedConfig) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    options = config.section_of(DistributedDataParallelKwargs)
    hook, wrapper, state = options.comm_hook, options.comm_wrapper, options.comm_state_option
    if wrapper != "no" and hook in ("fp16", "bf16"):
        problems.append(ConfigProblem(f"{SECTION}.comm_wrapper", (
            f"{wrapper!r} cannot wrap comm_hook {hook!r}: that hook already compresses gradients to {hook}, and "
            f"torch's {wrapper}_compress_wrapper only wraps PowerSGD hooks; use comm_hook: {hook} alone, or "
            f"comm_hook: power_sgd with comm_wrapper: {wrapper}")))
    elif wrapper != "no" and hook not in POWER_SGD_HOOKS:
        problems.append(ConfigProblem(f"{SECTION}.comm_wrapper", (
            f"{wrapper!r} needs a PowerSGD hook to wrap, but comm_hook is {hook!r}; set comm_hook: power_sgd "
            "(or batched_power_sgd), or comm_wrapper: no")))
    bf16_key = f"{SECTION}.comm_hook" if hook == "bf16" else f"{SECTION}.comm_wrapper" if wrapper == "bf16" else None
    if bf16_key and (config.section_of(CoreOptions).use_cpu or not _cuda_available()):
        problems.append(ConfigProblem(bf16_key, (
            "bf16 gradient compression needs CUDA 11+ with NCCL 2.10+ (torch's bf16 compress hook refuses gloo); "
            "this run has no CUDA device: use fp16 compression, or none")))
    if state:
        if hook not in POWER_SGD_HOOKS:
            problems.append(ConfigProblem(f"{SECTION}.comm_state_option", (
                f"configures the PowerSGD state, but comm_hook is {hook!r}; it is used only with comm_hook "
                "power_sgd or batched_power_sgd")))
        else:
            problems.extend(_power_sgd_state_problems(state))
    return problems


def _cuda_available() -> bool:
    """Imported lazily: only when a bf16 hook is configured."""
    import torch

    return torch.cuda.is_available()


def _power_sgd_state_problems(state: Mapping[str, Any]) -> list[ConfigProblem]:
    """Unknown ``PowerSGDState`` arguments, checked against torch's own signature (imported only here,
    only when a PowerSGD state is configured). ``process_group`` is the runtime's to pass."""
    key = f"{SECTION}.comm_state_option"
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        accepted = [name for name in inspect.signature(PowerSGDState.__init__).parameters
                    if name not in ("self", "process_group")]
    except Exception:  # torch without distributed support: the runtime will say so
        return []
    problems = []
    for name in state:
        if name == "process_group":
            problems.append(ConfigProblem(key, "process_group is set by torchrig (the job's process group); remove it"))
        elif name not in accepted:
            hint = suggest(str(name), accepted)
            problems.append(ConfigProblem(key, f"unknown PowerSGDState argument {name!r}{hint}; "
                                               f"accepted: {', '.join(accepted)}"))
    return problems


__all__ = ["ddp_problems"]
