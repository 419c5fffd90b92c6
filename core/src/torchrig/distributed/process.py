"""Where this process sits and how processes take turns: shared by the ``Accelerator`` and the
``PartialState``/``AcceleratorState`` views that scripts use before (or without) one.

Accelerate keeps this in process-wide singletons. torchrig keeps it in the run
(:class:`~torchrig.host.run.RunContext`); a state object is a *view* of a run: the newest live run of
the process (an ``Accelerator``'s, when one exists), or — when none exists yet — a process-only
run that selects a device and joins the process group but chooses no strategy, so an
``Accelerator`` created afterwards may use any strategy and adopts the same process group.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from torchrig.compat.enums import DistributedType
from torchrig.distributed.collectives import Collectives
from torchrig.errors import ConfigError
from torchrig.host.plugin_host import PluginHost
from torchrig.host.run import RunContext
from torchrig.host.runtime import declared_distributed_type, declared_precision_type, latest_run, open_run
from torchrig.plugin.kinds import PluginKind


class ProcessControl:
    """Rank queries and turn-taking over ``self._run`` (a started :class:`RunContext`)."""

    _run: RunContext

    # -- where this process sits ------------------------------------------------------------

    @property
    def device(self) -> Any:
        """The ``torch.device`` of this process."""
        assert self._run.device is not None
        return self._run.device.device

    @property
    def process_index(self) -> int:
        return self._run.cluster.rank

    @property
    def local_process_index(self) -> int:
        return self._run.cluster.local_rank

    @property
    def num_processes(self) -> int:
        return self._run.cluster.world_size

    @property
    def is_main_process(self) -> bool:
        return self._run.cluster.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._run.cluster.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self._run.cluster.rank == self._run.cluster.world_size - 1

    @property
    def use_distributed(self) -> bool:
        return self._run.cluster.world_size > 1

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for the run's strategy on its device, as the strategy's manifest
        declares it (``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``, ``DEEPSPEED``, ``NO``...)."""
        return declared_distributed_type(self._run)

    # -- taking turns -------------------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        """Barrier across every process."""
        assert self._run.collectives is not None
        self._run.collectives.barrier()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's contiguous share of ``inputs`` (list, tuple, dict of lists, tensor);
        with ``apply_padding`` every share has the same length (the last element repeated)."""
        yield split_share(inputs, self.process_index, self.num_processes, apply_padding)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. downloads), the others after it."""
        with self._goes_first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Each machine's local main process runs the block first."""
        with self._goes_first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _goes_first(self, first: bool) -> Iterator[None]:
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: run ``function`` on the main process only (None elsewhere)."""
        return self._only_where(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only_where(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only_where(function, lambda: self.is_last_process)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int = 0) -> Any:
        """Decorator: run on the process with this global index only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_where(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable[..., Any] | None = None, local_process_index: int = 0) -> Any:
        """Decorator: run on the process with this local (per-machine) index only."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_where(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _only_where(function: Callable[..., Any], here: Callable[[], bool]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if here() else None

        return wrapper

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)


def split_share(inputs: Any, rank: int, world: int, pad: bool) -> Any:
    """Rank ``rank``'s contiguous share of ``inputs`` (the first ``len % world`` ranks get one
    more); with ``pad``, shorter shares repeat the last element so all have the same length."""
    if isinstance(inputs, Mapping):
        return {k: split_share(v, rank, world, pad) for k, v in inputs.items()}
    length = len(inputs)
    per, extra = divmod(length, world)
    start = rank * per + min(rank, extra)
    end = start + per + (1 if rank < extra else 0)
    share = inputs[start:end]
    if pad and extra and rank >= extra and length:
        last = inputs[-1:]
        if hasattr(share, "dim"):
            share = torch.cat([share, last])
        else:
            share = type(share)(list(share) + list(last))
    return share


#: The process-only run ``PartialState()`` started when no run existed (kept alive: Accelerate's
#: state lives as long as the process, and every later ``PartialState()`` must see the same one).
_process_run: RunContext | None = None


def _state_run(cpu: bool, init_kwargs: Mapping[str, Any]) -> RunContext:
    """The run a new state object views: the newest live run, else a process-only one."""
    global _process_run
    run = latest_run()
    if run is not None:
        return run
    unknown = sorted(set(init_kwargs) - {"backend", "init_method", "timeout"})
    if unknown:
        raise ConfigError([f"PartialState({name}=...): unknown argument; accepted: cpu and the InitProcessGroupKwargs "
                           "fields backend, init_method, timeout" for name in unknown])
    arguments: dict[str, Any] = {"init_process_group_kwargs": dict(init_kwargs)} if init_kwargs else {}
    if cpu:
        arguments["use_cpu"] = True
    _process_run = open_run(PluginHost(), arguments, process_only=True)
    return _process_run


class PartialState(ProcessControl):
    """Where this process sits and how processes take turns, usable before and without an
    ``Accelerator`` (Accelerate's ``PartialState``): ``PartialState().process_index``,
    ``.main_process_first()``, ``.split_between_processes(...)``...

    ``cpu`` and ``InitProcessGroupKwargs`` fields (``backend``, ``init_method``, ``timeout``) apply
    only when no run exists yet in this process; the configuration is otherwise read like the
    ``Accelerator`` reads it (config files, ``TORCHRIG_*`` variables, launch flags).
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self._run = _state_run(cpu, kwargs)

    @classmethod
    def _of(cls, run: RunContext) -> Any:
        """A view of a given run (``accelerator.state``)."""
        state = cls.__new__(cls)
        state._run = run
        return state

    @property
    def initialized(self) -> bool:
        return True

    @property
    def backend(self) -> str | None:
        """The process group's backend (``gloo``, ``nccl``); None for one process."""
        return self._run.device.dist_backend if self.use_distributed and self._run.device is not None else None

    @property
    def default_device(self) -> Any:
        return self.device

    @property
    def debug(self) -> bool:
        """Accelerate's debug mode (collective shape checks) does not exist in torchrig: False."""
        return False

    @property
    def fork_launched(self) -> bool:
        """Whether ``notebook_launcher`` forked this process."""
        return os.environ.get("FORK_LAUNCHED", "0").lower() in ("1", "true", "yes")

    def set_device(self) -> None:
        """The device plugin placed this process on its device when the run started."""

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy ``group`` (default: the world group) if it exists."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    def __repr__(self) -> str:
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (f"Distributed environment: {self.distributed_type}{backend}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")


class AcceleratorState(PartialState):
    """``PartialState`` plus what the run was configured with (Accelerate's ``AcceleratorState``):
    ``mixed_precision``, ``dynamo_plugin`` and each strategy's options under the attribute its
    manifest declares (``deepspeed_plugin``, ``fsdp_plugin``: the options object when that
    strategy runs, None otherwise)."""

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, **kwargs: Any) -> None:
        super().__init__(cpu, **kwargs)
        if mixed_precision is not None and str(mixed_precision) != self.mixed_precision:
            raise ValueError(f"AcceleratorState(mixed_precision={mixed_precision!r}): this process already runs with "
                             f"mixed_precision {self.mixed_precision!r}; it cannot change once the run started")

    @property
    def mixed_precision(self) -> str:
        return declared_precision_type(self._run)

    @property
    def dynamo_plugin(self) -> Any:
        return self._run.config.section("dynamo_config")

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP

    @property
    def use_ipex(self) -> bool:
        return False

    #: Accelerate's state attributes for features torchrig refuses (docs/accelerate.md): never in use.
    megatron_lm_plugin = None
    torch_tp_plugin = None
    parallelism_config = None

    def __getattr__(self, name: str) -> Any:
        host = self._run.plugins
        if host is None or name.startswith("_"):
            raise AttributeError(name)
        strategy = str(self._run.config.get("strategy") or "")
        for info in host.plugins(PluginKind.STRATEGY):
            if info.manifest is not None and info.manifest.state_attribute == name:
                if info.name != strategy or info.manifest.config_section is None:
                    return None
                return self._run.config.section(info.manifest.config_section.key)
        raise AttributeError(f"'AcceleratorState' object has no attribute {name!r}")


def world_collectives() -> Collectives:
    """Collectives over every process of the job, without an ``Accelerator`` in hand: the newest
    run's (a strategy's own transport is honoured), else ``torch.distributed`` over a process group
    someone else created, else one process (every operation returns its input)."""
    run = latest_run()
    if run is not None and run.collectives is not None:
        return run.collectives
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return Collectives(world_size=world)


def is_initialized() -> bool:
    """Whether this process has a live run (an ``Accelerator`` or a ``PartialState``)."""
    return latest_run() is not None


def do_nothing(*args: Any, **kwargs: Any) -> None:
    """Accelerate's no-op callable."""


__all__ = ["AcceleratorState", "PartialState", "ProcessControl", "do_nothing", "is_initialized", "split_share",
           "world_collectives"]
