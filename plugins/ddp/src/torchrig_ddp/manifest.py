"""Manifest of the ``ddp`` strategy: what torchrig knows about DDP without importing torch.

Loaded for every run, ``torchrig launch --help``, ``torchrig config`` and ``torchrig plugins``;
must stay torch-free at import. The validation hook imports torch only when a check needs it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchrig.plugin import HOOK_API_VERSION, CliFlag, ConfigProblem, ConfigSection, PluginManifest, hookimpl, suggest

if TYPE_CHECKING:
    from torchrig.plugin import MemoryEstimate, MemoryRequest

SECTION = "ddp_config"
#: ``comm_hook`` values: which ``torch.distributed.algorithms.ddp_comm_hooks`` hook to register.
COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
#: ``comm_wrapper`` values: a compression wrapper around a PowerSGD hook.
COMM_WRAPPERS = ("no", "fp16", "bf16")
#: Hooks that take a ``PowerSGDState`` (``comm_state_option``) and may be wrapped.
POWER_SGD_HOOKS = ("power_sgd", "batched_power_sgd")


class DDPManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "DistributedDataParallel: every rank holds the full model, gradients are all-reduced"
    install_hint = "torchrig"
    #: Accelerate's data-parallel ``distributed_type`` values: DDP serves them on any device.
    aliases = ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU")
    parallelism_axes = ("dp_replicate",)  # every rank holds a replica
    default_for_distributed = True
    distributed_type = "MULTI_{device}"
    exports = {
        "DistributedDataParallelKwargs": "torchrig_ddp.options:DistributedDataParallelKwargs",
        "DDPCommunicationHookType": "torchrig_ddp.options:DDPCommunicationHookType",
    }
    config_section = ConfigSection(
        SECTION, "torchrig_ddp.options:DistributedDataParallelKwargs", aliases=("ddp_kwargs",),
        help="DistributedDataParallelKwargs: DistributedDataParallel arguments and gradient communication hook",
    )
    cli_flags = (
        CliFlag("--ddp_bucket_cap_mb", f"{SECTION}.bucket_cap_mb", "DDP gradient bucket size in MiB", type="int"),
        CliFlag("--ddp_find_unused_parameters", f"{SECTION}.find_unused_parameters",
                "let DDP find parameters that got no gradient", type="bool"),
        CliFlag("--ddp_static_graph", f"{SECTION}.static_graph", "the model's graph is the same every iteration",
                type="bool"),
        CliFlag("--ddp_gradient_as_bucket_view", f"{SECTION}.gradient_as_bucket_view",
                "gradients are views into the all-reduce buckets", type="bool"),
        CliFlag("--ddp_broadcast_buffers", f"{SECTION}.broadcast_buffers",
                "broadcast buffers from rank 0 at every forward", type="bool"),
        CliFlag("--ddp_comm_hook", f"{SECTION}.comm_hook", "gradient communication hook", choices=COMM_HOOKS),
        CliFlag("--ddp_comm_wrapper", f"{SECTION}.comm_wrapper", "compression wrapper around a PowerSGD hook",
                choices=COMM_WRAPPERS),
    )

    @hookimpl
    def torchrig_estimate_memory(self, request: MemoryRequest) -> MemoryEstimate:
        """Per-rank memory under this strategy (``torchrig estimate-memory``); see :mod:`torchrig_ddp.memory`
        (imported here: a run that never estimates loads only the manifest)."""
        from torchrig_ddp.memory import ddp_estimate

        return ddp_estimate(request)

    @hookimpl
    def torchrig_validate_config(self, config: Mapping[str, Any]) -> list[ConfigProblem]:
        """Combinations DDP accepts at construction but fails on at the first backward (or ignores)."""
        return ddp_problems(config)


def ddp_problems(config: Mapping[str, Any]) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    hook = config.get(f"{SECTION}.comm_hook", "no")
    wrapper = config.get(f"{SECTION}.comm_wrapper", "no")
    state = config.get(f"{SECTION}.comm_state_option")
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
    if bf16_key and (config.get("use_cpu") or not _cuda_available()):
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


__all__ = ["DDPManifest", "ddp_problems"]
