"""The core's process defaults: the CPU device, the default process group, collectives and
replicated capabilities. Registered as ``"core:process-defaults"`` by
:func:`torchrig.host.runtime.start_run` (``PartialState`` and the Accelerator start runs through it),
the first place these hooks are called.

Torch-free to import, like every family of defaults: a host is built for configuration work
(``make_host``, the launcher) without torch, so torch and the modules that need it are imported
inside the implementations."""

from __future__ import annotations

import datetime
from typing import Any

from torchrig.config.options import InitProcessGroupKwargs
from torchrig.errors import ConfigError
from torchrig.host.plugin_host import PluginHost
from torchrig.host.run import RunContext
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import Capabilities

#: The pluggy name of this family.
NAME = "core:process-defaults"


def apply_timeout_to_later_groups(timeout: Any) -> None:
    """One collective timeout for every process group: groups created later without an explicit
    timeout (``new_group``, device meshes) take torch's process-wide defaults, so set those too
    (Accelerate applies the user's timeout to the default group only: accelerate#2236, #3711)."""
    import torch.distributed.distributed_c10d as c10d  # torch: see the module docstring

    c10d.default_pg_timeout = timeout
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
        c10d.default_pg_nccl_timeout = timeout


class ProcessDefaults:
    """What the core does for a process when no device or strategy plugin answers."""

    @hookimpl(trylast=True)
    def torchrig_select_device(self, run: RunContext) -> Any:
        """The CPU, when no device plugin answered — unless a device was forced (``device``): its
        plugin declining means the device is not on this machine, which must not become a CPU run."""
        forced = run.config.get("device") if run.config is not None else None
        if forced:
            raise ConfigError([f"device ({run.config.sources['device']}): {forced!r} was asked for, but the device "
                               f"plugin {forced!r} found no such device on this machine; remove the setting to pick "
                               "the device automatically, or use_cpu (--cpu) to train on the CPU"])
        from torchrig.builtins.devices import CPUBackend  # torch: see the module docstring

        return CPUBackend()

    @hookimpl(trylast=True)
    def torchrig_init_process_group(self, run: RunContext) -> bool:
        if run.cluster.world_size <= 1:
            return True
        import torch.distributed as dist  # torch: see the module docstring

        # The default (1800 s) is declared once, on InitProcessGroupKwargs.timeout.
        timeout = datetime.timedelta(seconds=float(run.section(InitProcessGroupKwargs).timeout))
        apply_timeout_to_later_groups(timeout)
        if dist.is_initialized():
            if dist.get_world_size() != run.cluster.world_size:
                raise RuntimeError(
                    f"a process group of world size {dist.get_world_size()} already exists, "
                    f"but this run expects {run.cluster.world_size}"
                )
            return True
        assert run.device is not None
        dist.init_process_group(
            backend=run.option("init_process_group_kwargs.backend") or run.device.dist_backend,
            init_method=run.option("init_process_group_kwargs.init_method")
            or f"tcp://{run.cluster.master_addr}:{run.cluster.master_port}",
            rank=run.cluster.rank,
            world_size=run.cluster.world_size,
            timeout=timeout,
        )
        return True

    @hookimpl(trylast=True)
    def torchrig_collectives(self, run: RunContext) -> Any:
        from torchrig.distributed.collectives import Collectives  # torch: see the module docstring

        return Collectives(world_size=run.cluster.world_size)

    @hookimpl(trylast=True)
    def torchrig_strategy_capabilities(self, run: RunContext) -> Capabilities:
        return Capabilities(replicated_parameters=True, data_parallel_size=run.cluster.world_size,
                            data_parallel_rank=run.cluster.rank)


def register(host: PluginHost) -> None:
    """Add the process defaults to ``host`` (once)."""
    host.register_default(ProcessDefaults(), NAME)


__all__ = ["NAME", "ProcessDefaults", "apply_timeout_to_later_groups", "register"]
