"""Manifest of the ``ddp`` strategy: what torchrig knows about DDP without importing torch.

Loaded for every run, ``torchrig launch --help``, ``torchrig config`` and ``torchrig plugins``;
must stay torch-free at import. The validation hook reads the typed section in
:mod:`torchrig_ddp.config_checks`, which imports torch only when a check needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrig.plugin import HOOK_API_VERSION, CliFlag, ConfigProblem, ConfigSection, PluginManifest, hookimpl

from torchrig_ddp.constants import COMM_HOOKS, COMM_WRAPPERS, SECTION

if TYPE_CHECKING:
    from torchrig.plugin import ResolvedConfig


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
    def torchrig_validate_config(self, config: ResolvedConfig) -> list[ConfigProblem]:
        """Combinations DDP accepts at construction but fails on at the first backward (or ignores);
        see :mod:`torchrig_ddp.config_checks` (imported here: it reads the typed section, so it imports
        the options class, which a run that does not select ddp never loads — benchmark B12)."""
        from torchrig_ddp.config_checks import ddp_problems

        return ddp_problems(config)


__all__ = ["DDPManifest"]
