"""transformers' tensor-parallel style names, and why some are refused — torch-free.

Why separate from :mod:`torchrig_fsdp.hf_styles` (which maps each name onto a torch ``ParallelStyle``
and so imports torch): the fsdp manifest declares the style names a user's ``parallelism_config.tp_plan``
may use (``PluginManifest.tp_styles``), and a manifest is loaded by ``torchrig launch --help`` and the
launcher's checks without torch. ``hf_styles.TRANSFORMERS_STYLES`` has exactly these keys, in this
order (tested), and takes its refusal reasons from here, so the launcher and the worker say the same.
"""

from __future__ import annotations

#: Expert parallelism is not a tensor-parallel style: the model's own ep plan applies it over the ep axis.
EXPERT_PARALLEL_REFUSAL = (
    "an expert-parallel style, not a tensor-parallel one: set parallelism_config.ep_size and the model's own "
    "expert-parallel plan (_ep_plan / base_model_ep_plan) places its experts on the ep ranks "
    "(torchrig_fsdp.expert_parallel); within a tp_plan, 'moe_tp_experts' splits every expert over tp")

#: Styles torchrig recognises but cannot honour exactly: name -> why, and what to do instead.
REFUSED_STYLES: dict[str, str] = {
    "mla_kv_a_proj": (
        "multi-head latent attention's kv_a_proj_with_mqa (DeepSeek-V2 family) is not split by torchrig yet; give "
        "parallelism_config.tp_plan without the attention projections, or FullyShardedDataParallelPlugin("
        "parallelize_fn=...)"),
    "ep_dispatch_experts": EXPERT_PARALLEL_REFUSAL,
    "grouped_gemm": EXPERT_PARALLEL_REFUSAL,
}

#: Every style name of transformers 5.24's ``ALL_PARALLEL_STYLES``, in the runtime table's order.
TRANSFORMERS_STYLE_NAMES: tuple[str, ...] = (
    "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
    "embedding_rowwise", "embedding_colwise", "packed_colwise", "packed_rowwise", "sequence_parallel",
    "replicated_with_grad_allreduce", "all_reduce", "local_params", "replicate", "moe_tp_experts",
    "moe_identity_expert", "mla_kv_a_proj", "ep_dispatch_experts", "grouped_gemm",
)

__all__ = ["EXPERT_PARALLEL_REFUSAL", "REFUSED_STYLES", "TRANSFORMERS_STYLE_NAMES"]
