"""transformers' tensor-parallel style names -> torch ``ParallelStyle`` objects: one declared table.

Why a table: transformers 5.x models declare their own plans (``_tp_plan``, ``base_model_tp_plan``)
in transformers' vocabulary (``transformers.distributed.tensor_parallel``, registered in
``ALL_PARALLEL_STYLES``). torchrig applies plans with torch's ``parallelize_module``, so each name
is mapped here onto the torch style that shards and communicates the same way (read from
transformers 5.24's classes), onto torchrig's own style (:mod:`torchrig_fsdp.tp_styles`) where torch
has none, or refused with the reason and what to do. A column-wise style whose output is gathered
whole runs as :func:`torchrig_fsdp.tp_styles.colwise_gather_output` (torch's ``ColwiseParallel``
whose output is a fresh tensor, not ``to_local()``'s view, which FSDP2 warns about: the logits).
A test compares this table's keys with ``ALL_PARALLEL_STYLES`` of the installed transformers, so a
new style fails loudly instead of being applied wrongly; docs/parallelism.md's table is checked against :func:`describe`. The names alone, and
the refusal reasons, live torch-free in :mod:`torchrig_fsdp.hf_style_names` (the manifest declares them).

Nothing here imports transformers: a plan is names, and the names are all this module needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from torchrig_fsdp import tp_styles
from torchrig_fsdp.hf_style_names import REFUSED_STYLES
from torchrig_fsdp.tp_styles import PlacementRule


@dataclass(frozen=True)
class StyleEntry:
    """One transformers style name: the torch style a *module* entry gets (``module``), the
    placement a *parameter* entry gets (``parameter``: transformers' ``shard_param``; None: the
    name applies to modules only), the torch spelling for the docs, and ``refused`` (why torchrig
    does not apply it, and what to do) for a name that cannot be honoured exactly."""

    torch: str
    module: Callable[[], ParallelStyle] | None = None
    parameter: PlacementRule | None = None
    refused: str | None = None
    #: The module's output is gathered whole (so ``loss_parallel``, which wants it sharded, cannot apply).
    gathers_output: bool = False


def _keep(param: Any, name: str) -> Any:
    return Replicate()


TRANSFORMERS_STYLES: dict[str, StyleEntry] = {
    "colwise": StyleEntry("ColwiseParallel()", ColwiseParallel, tp_styles.output_rows),
    "rowwise": StyleEntry("RowwiseParallel()", RowwiseParallel, tp_styles.input_columns),
    "colwise_gather_output": StyleEntry(
        "ColwiseParallel(output_layouts=Replicate())", tp_styles.colwise_gather_output, gathers_output=True),
    "colwise_rep": StyleEntry("ColwiseParallel(output_layouts=Replicate())", tp_styles.colwise_gather_output,
                              gathers_output=True),
    "rowwise_split_input": StyleEntry("RowwiseParallel(input_layouts=Replicate())",
                                      lambda: RowwiseParallel(input_layouts=Replicate())),
    "rowwise_rep": StyleEntry("RowwiseParallel(input_layouts=Replicate())",
                              lambda: RowwiseParallel(input_layouts=Replicate())),
    "embedding_rowwise": StyleEntry("RowwiseParallel(input_layouts=Replicate()) (vocabulary split)",
                                    lambda: RowwiseParallel(input_layouts=Replicate()), lambda p, n: Shard(0)),
    "embedding_colwise": StyleEntry(
        "ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()) (hidden dim split)",
        lambda: tp_styles.colwise_gather_output(input_layouts=Replicate()), lambda p, n: Shard(1),
        gathers_output=True),
    "packed_colwise": StyleEntry("torchrig PackedColwiseParallel (per packed part: _StridedShard(split_factor=2))",
                                 tp_styles.PackedColwiseParallel, tp_styles.packed_rows),
    "packed_rowwise": StyleEntry("parameters only: _StridedShard(-1, split_factor=2), a bias whole",
                                 None, tp_styles.packed_columns),
    "sequence_parallel": StyleEntry("SequenceParallel() (torchrig's meaning: DTensor output, see the docs)",
                                    SequenceParallel),
    "replicated_with_grad_allreduce": StyleEntry("torchrig ReplicatedSumGradients (Replicate, gradients summed)",
                                                 tp_styles.ReplicatedSumGradients),
    "all_reduce": StyleEntry("PrepareModuleOutput(Partial() -> Replicate())",
                             lambda: PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate(),
                                                         use_local_output=True)),
    "local_params": StyleEntry("torchrig LocalParameters (forward on local shards)", tp_styles.LocalParameters),
    "replicate": StyleEntry("none: the module stays whole on every rank", tp_styles.KeepWhole, _keep),
    "moe_tp_experts": StyleEntry("torchrig ExpertsTensorParallel (every expert split, outputs summed)",
                                 tp_styles.ExpertsTensorParallel),
    "moe_identity_expert": StyleEntry("torchrig IdentityExpert (input / tp size)", tp_styles.IdentityExpert),
    **{name: StyleEntry("refused", refused=reason) for name, reason in REFUSED_STYLES.items()},
}


def describe() -> list[tuple[str, str]]:
    """(style, what torchrig does) for each transformers style, in table order (docs/parallelism.md)."""
    return [(name, f"refused: {entry.refused}" if entry.refused else entry.torch)
            for name, entry in TRANSFORMERS_STYLES.items()]


#: Names of attention projections whose output features are heads (transformers' key projections and q/v).
HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn")
#: Config fields giving head counts, which a tensor-parallel split of the projections above must divide.
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def check_heads_divide(model: Any, sharded_modules: list[str], tp_size: int) -> list[str]:
    """Problems when the plan splits attention projections over ``tp_size`` ranks but the model's
    config has a head count (query heads, or GQA's key/value heads) that ``tp_size`` does not divide:
    each rank must hold whole heads. Checked before anything is sharded."""
    if not any(name.rsplit(".", 1)[-1] in HEAD_PROJECTIONS for name in sharded_modules):
        return []
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = []
    for field in HEAD_FIELDS:
        value = getattr(text_config, field, None)
        if isinstance(value, int) and value % tp_size:
            problems.append(
                f"parallelism_config.tp_size: {type(text_config).__name__}.{field} is {value}, not divisible by "
                f"tp_size {tp_size}: tensor parallel splits the attention projections by heads and each rank "
                f"needs whole heads; choose a tp_size that divides {value}")
    return problems


__all__ = ["HEAD_FIELDS", "HEAD_PROJECTIONS", "TRANSFORMERS_STYLES", "StyleEntry", "check_heads_divide", "describe"]
