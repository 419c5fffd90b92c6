"""Assembling a run from plugins: selection, environment, and the step plan.

The Accelerator calls :func:`start_run` once and :func:`build_step_plan` at ``prepare`` (again
only if the plugin host's registrations changed). Both ask hooks; neither runs per step.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from torchrig.compat.enums import DistributedType
from torchrig.config.resolve import Layer, resolve_config
from torchrig.config.resolved import ResolvedConfig
from torchrig.defaults import process as process_defaults
from torchrig.distributed.process_group import adopt_existing_group, record_group, release_groups_at_exit
from torchrig.errors import NoEffectWarning
from torchrig.host.plugin_host import PluginHost, PluginStatus
from torchrig.host.run import RunContext
from torchrig.plugin.kinds import PluginKind
from torchrig.plugin.types import ClusterInfo
from torchrig.training.step_plan import StepPlan, StepPlanBuilder, unused_grad_scaler_options

#: Configuration keys that select plugins, and their defaults.
DEFAULT_STRATEGY = "single"
DEFAULT_PRECISION = "no"


def detect_cluster(host: PluginHost, config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """Register the cluster plugins (all installed, by priority, or the one ``cluster`` names)
    and ask ``torchrig_detect_cluster`` where this process sits."""
    host.select_auto(PluginKind.CLUSTER, only=config.get("cluster") or None)
    return host.hook.torchrig_detect_cluster(environ=dict(os.environ if environ is None else environ))


def select_plugins(host: PluginHost, config: Mapping[str, Any]) -> None:
    """Register the runtime plugins the configuration asks for, kind by kind (device, precision,
    strategy, tracker — clusters come first, in :func:`detect_cluster`): the documented order."""
    host.select_auto(PluginKind.DEVICE, only="cpu" if config.get("use_cpu") else (config.get("device") or None))
    host.select(PluginKind.PRECISION, str(config.get("mixed_precision") or DEFAULT_PRECISION))
    host.select(PluginKind.STRATEGY, str(config.get("strategy") or DEFAULT_STRATEGY))
    for name in config.get("log_with") or ():
        if name == "all":
            for info in host.plugins(PluginKind.TRACKER):
                if info.status is PluginStatus.AVAILABLE:
                    host.select(PluginKind.TRACKER, info.name)
        elif isinstance(name, str):
            host.select(PluginKind.TRACKER, name)


def start_run(
    host: PluginHost,
    config: ResolvedConfig,
    environ: Mapping[str, str] | None = None,
    *,
    cluster: ClusterInfo | None = None,
    process_only: bool = False,
) -> RunContext:
    """Detect the cluster (unless given), select plugins, claim the device, join the process group.

    Order (each step a hook): ``torchrig_detect_cluster`` → ``torchrig_select_device`` →
    ``torchrig_init_process_group`` → ``torchrig_collectives`` → ``torchrig_configure``. A default
    process group that exists already (Ray Train, the user, an earlier Accelerator) is checked
    against the run and adopted before ``torchrig_init_process_group``
    (:func:`torchrig.distributed.process_group.adopt_existing_group`), which then creates nothing.

    ``process_only``: only the device and the process group (``PartialState`` before any
    ``Accelerator``): no precision, strategy or tracker is selected, so the Accelerator created
    later may choose any strategy and adopts the process group.
    """
    if cluster is None:
        cluster = detect_cluster(host, config, environ)
    if process_only:
        host.select_auto(PluginKind.DEVICE, only="cpu" if config.get("use_cpu") else (config.get("device") or None))
    else:
        select_plugins(host, config)
    host.check_pending()
    process_defaults.register(host)  # the core answers the device, group and collectives hooks
    run = RunContext(config=config, plugins=host, cluster=cluster)
    run.device = host.hook.torchrig_select_device(run=run)
    adopt_existing_group(run)
    host.hook.torchrig_init_process_group(run=run)
    record_group(run)
    run.collectives = host.hook.torchrig_collectives(run=run)
    host.hook.torchrig_configure.call_historic(kwargs={"run": run})
    _LIVE_RUNS.add(run)
    _STARTED.append(weakref.ref(run))
    return run


def open_run(host: PluginHost, arguments: Mapping[str, Any], config_file: Any = None, *,
             process_only: bool = False) -> RunContext:
    """Resolve the configuration (``arguments``: the script's, see :func:`resolve_config`), detect
    the cluster and start the run: what ``Accelerator(...)`` and ``PartialState()`` both do."""
    config = resolve_config(host, arguments=arguments, config_file=config_file)
    host.disable(config["disable_plugins"])
    cluster = detect_cluster(host, config)
    if cluster.world_size > 1 and config.source("strategy").layer is Layer.DEFAULT:
        # The job has several processes (torchrun, torchrig launch) and nothing chose a
        # strategy: resolve again so the default data-parallel strategy is picked.
        config = resolve_config(host, arguments=arguments, config_file=config_file, world_size=cluster.world_size,
                                warn=False)
    run = start_run(host, config, cluster=cluster, process_only=process_only)
    if not process_only:
        claim_world(run)
    return run


#: Runs started and not yet ended, ended at interpreter exit. Weak: a run nobody holds any more
#: is not kept alive (with its models and engines) just to be unconfigured later.
_LIVE_RUNS: weakref.WeakSet[RunContext] = weakref.WeakSet()
#: Every run started, oldest first (weak), for :func:`latest_run`.
_STARTED: list[weakref.ref[RunContext]] = []


def latest_run() -> RunContext | None:
    """The most recently started run of this process that has not ended, or None."""
    _STARTED[:] = [ref for ref in _STARTED if ref() is not None]
    for ref in reversed(_STARTED):
        run = ref()
        if run is not None and not run.ended:
            return run
    return None


def declared_distributed_type(run: RunContext) -> DistributedType:
    """The ``DistributedType`` the run's strategy declares in its manifest (``"MULTI_{device}"``
    filled in from the device's manifest); the strategy's name when it declares none."""
    host, strategy = run.plugins, str(run.config.get("strategy") or DEFAULT_STRATEGY)
    assert host is not None
    declared = host.info(PluginKind.STRATEGY, strategy).manifest
    value = declared.distributed_type if declared is not None and declared.distributed_type else strategy
    if "{device}" in value:
        device_name = run.device.name if run.device is not None else "cpu"
        device = host.info(PluginKind.DEVICE, device_name).manifest
        value = value.format(device=(device.distributed_device if device is not None and device.distributed_device
                                     else device_name.upper()))
    return DistributedType(value)


def declared_precision_type(run: RunContext) -> str:
    """The ``PrecisionType`` value the run's precision plugin declares (its name if none)."""
    host, precision = run.plugins, str(run.config.get("mixed_precision") or DEFAULT_PRECISION)
    assert host is not None
    declared = host.info(PluginKind.PRECISION, precision).manifest
    return declared.precision_type if declared is not None and declared.precision_type else precision


def end_run(run: RunContext) -> None:
    """Call ``torchrig_unconfigure`` for ``run``, once: at ``end_training``, or at interpreter
    exit for a run still alive then."""
    if run.ended:
        return
    run.ended = True
    _LIVE_RUNS.discard(run)
    if run.plugins is not None:
        run.plugins.hook.torchrig_unconfigure(run=run)


def _at_exit() -> None:
    """End the runs still alive, then release the process groups (before finalization)."""
    for run in list(_LIVE_RUNS):
        try:
            end_run(run)
        except Exception as exc:
            print(f"torchrig: torchrig_unconfigure failed at interpreter exit: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
    try:
        release_groups_at_exit()
    except Exception as exc:
        print(f"torchrig: releasing the process group at interpreter exit failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


atexit.register(_at_exit)


#: Live runs per process-wide world (the default process group, or the lone process): torch's
#: world group is process-global, so which strategy drives it is too. Weak: a run that ended
#: no longer holds the world.
_WORLD_RUNS: dict[int, weakref.WeakSet[RunContext]] = {}


def claim_world(run: RunContext) -> None:
    """Two Accelerators in one process share the world process group; they must agree on the
    strategy driving it. A second one asking for a different strategy raises. Without a process
    group (one process) nothing is shared, and nothing is claimed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # one process without a group: nothing is shared between its Accelerators
    key = id(dist.group.WORLD)
    runs = _WORLD_RUNS.setdefault(key, weakref.WeakSet())
    strategy = run.config.get("strategy")
    if any(not other.ended and other.config.get("strategy") != strategy for other in list(runs)):
        gc.collect()  # a run nobody holds but a reference cycle (an Accelerator dropped mid-test) is no claim
    for other in list(runs):
        # an ended run no longer drives the group (and a destroyed group's id may be reused)
        if not other.ended and other.config.get("strategy") != strategy:
            raise RuntimeError(
                f"this process already runs an Accelerator with strategy {other.config.get('strategy')!r}; a second one "
                f"with strategy {strategy!r} would share its process group. Use the same strategy, or end the first "
                "(del accelerator) before creating the second."
            )
    runs.add(run)


def negotiate_capabilities(host: PluginHost, run: RunContext) -> None:
    """Ask the strategy once what it owns (``torchrig_strategy_capabilities``)."""
    if run.capabilities is None:
        run.capabilities = host.hook.torchrig_strategy_capabilities(run=run)


def build_step_plan(host: PluginHost, run: RunContext) -> StepPlan:
    """Ask the step-plan hooks once and freeze the callables the training step will run.

    Core plain-PyTorch slots → ``torchrig_precision_step_plan`` (skipped when the strategy owns
    precision) → ``torchrig_strategy_step_plan`` → ``torchrig_wrap_step_plan``. Each slot
    remembers which plugin set it.
    """
    negotiate_capabilities(host, run)
    assert run.capabilities is not None
    builder = StepPlanBuilder()
    stages = ["torchrig_strategy_step_plan", "torchrig_wrap_step_plan"]
    if not run.capabilities.owns_precision:
        stages.insert(0, "torchrig_precision_step_plan")
    for hook_name in stages:
        for plugin_name, call in host.iter_impls(hook_name, run=run, plan=builder):
            builder.current_owner = plugin_name
            call()
    builder.current_owner = None
    unused = unused_grad_scaler_options(run, builder)
    if unused:
        warnings.warn(unused, NoEffectWarning, stacklevel=2)
    return builder.build()


__all__ = ["DEFAULT_PRECISION", "DEFAULT_STRATEGY", "build_step_plan", "claim_world", "declared_distributed_type",
           "declared_precision_type", "detect_cluster", "end_run", "latest_run", "negotiate_capabilities", "open_run",
           "select_plugins", "start_run"]
