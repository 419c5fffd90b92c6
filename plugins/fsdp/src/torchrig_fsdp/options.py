"""``FullyShardedDataParallelPlugin``: Accelerate's class and parameters, as torchrig's ``fsdp_config``.

torchrig runs FSDP2 (``torch.distributed.fsdp.fully_shard``) only. Accelerate's FSDP1-era options
are accepted and translated, so an Accelerate ``fsdp_config`` works unchanged:

* ``sharding_strategy`` picks the device mesh and ``reshard_after_forward``: ``FULL_SHARD`` = 1-D
  mesh, reshard after forward (ZeRO-3); ``SHARD_GRAD_OP`` = 1-D mesh, keep parameters gathered
  between forward and backward (ZeRO-2); ``HYBRID_SHARD``/``_HYBRID_SHARD_ZERO2`` = 2-D mesh
  (replicate across machines, shard within one) with reshard on/off; ``NO_SHARD`` = 2-D mesh of
  (world, 1), i.e. replicated parameters (strategy ``ddp`` does the same with less overhead).
  On one machine ``HYBRID_SHARD`` is ``FULL_SHARD`` with a (1, N) mesh: allowed, so one config
  scales from one machine to several unchanged.
* ``use_orig_params`` and ``limit_all_gathers`` are FSDP1 knobs with no FSDP2 meaning (FSDP2 always
  keeps the original parameters and limits in-flight all-gathers itself): accepted, no effect.
* ``backward_prefetch``: FSDP2 always prefetches the next block's all-gather in backward (what
  ``BACKWARD_PRE`` asked FSDP1 for); ``NO_PREFETCH`` turns explicit prefetching off; ``BACKWARD_POST``
  has no FSDP2 equivalent and behaves like ``BACKWARD_PRE``.
* ``state_dict_type: LOCAL_STATE_DICT`` (FSDP1 flat-parameter shards) and ``fsdp_version: 1`` are
  refused with the reason.

Every field also accepts Accelerate's file spelling with the ``fsdp_`` prefix
(``fsdp_sharding_strategy``, ``fsdp_offload_params`` for ``cpu_offload``...). Enum-like values are
normalised to canonical upper-case strings; torch enum members and Accelerate's integer codes are
accepted. Torch-free: the normalisers recognise torch objects by duck typing.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from torchrig.plugin import at_least, between, class_names, enum_name, option, suggest

from torchrig_fsdp.constants import AUTO_WRAP_POLICIES, BACKWARD_PREFETCH, SHARDING_STRATEGIES, STATE_DICT_TYPES

#: ``min_num_params`` used by SIZE_BASED_WRAP when none is given: torch's
#: ``size_based_auto_wrap_policy`` default (and Accelerate's questionnaire default).
DEFAULT_MIN_NUM_PARAMS = 100_000_000
#: Keys of a ``mixed_precision_policy`` mapping: FSDP2's ``MixedPrecisionPolicy`` fields, plus FSDP1's
#: ``buffer_dtype`` (accepted, no effect: FSDP2 does not cast buffers).
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs", "buffer_dtype")
#: ``activation_checkpointing_policy`` values (torchrig_fsdp.activation_checkpointing applies them).
AC_POLICIES = ("full", "every_k", "selective", "memory_budget")
DTYPE_NAMES = ("bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")

# Accelerate's (and torch enums') integer codes: ShardingStrategy(1) is FULL_SHARD, ...
_SHARDING_BY_NUMBER = dict(enumerate(SHARDING_STRATEGIES, start=1))
_PREFETCH_BY_NUMBER = dict(enumerate(BACKWARD_PREFETCH, start=1))
# torch's StateDictType and Accelerate's FSDP_STATE_DICT_TYPE order.
_STATE_DICT_BY_NUMBER = {1: "FULL_STATE_DICT", 2: "LOCAL_STATE_DICT", 3: "SHARDED_STATE_DICT"}
_SPELLINGS = {
    "HYBRID_SHARD_ZERO2": "_HYBRID_SHARD_ZERO2",
    "TRANSFORMER_LAYER": "TRANSFORMER_BASED_WRAP",
    "TRANSFORMER_BASED": "TRANSFORMER_BASED_WRAP",
    "TRANSFORMER_LAYER_WRAP": "TRANSFORMER_BASED_WRAP",
    "SIZE_BASED": "SIZE_BASED_WRAP",
    "SIZE": "SIZE_BASED_WRAP",
    "NONE": "NO_WRAP",
    "FULL": "FULL_STATE_DICT",
    "SHARDED": "SHARDED_STATE_DICT",
    "LOCAL": "LOCAL_STATE_DICT",
}


def _canonical(numbers: Mapping[int, str]) -> Callable[[Any], Any]:
    """A normaliser: enum member, Accelerate integer code (also as text) or any-case name ->
    canonical upper-case name. Never raises: what it does not recognise is returned as is, for
    the resolver to report against the choices (with did-you-mean)."""

    def normalize(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            value = enum_name(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return numbers.get(value, value)
        if isinstance(value, str):
            text = value.strip()
            if text.isascii() and text.isdigit():
                return numbers.get(int(text), text)
            text = text.upper().replace("-", "_")
            return _SPELLINGS.get(text, text)
        return value

    return normalize


_sharding = _canonical(_SHARDING_BY_NUMBER)
_prefetch = _canonical(_PREFETCH_BY_NUMBER)
_state_dict_type = _canonical(_STATE_DICT_BY_NUMBER)
_wrap_name = _canonical({})


def _wrap_policy(value: Any) -> Any:
    """A policy name (any spelling), or a callable wrap policy from Python, kept as is."""
    return value if callable(value) else _wrap_name(value)


def _check_wrap_policy(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None or callable(value) or value in AUTO_WRAP_POLICIES:
        return
    raise ValueError(f"must be one of {', '.join(AUTO_WRAP_POLICIES)} (or a callable policy from Python), got "
                     f"{value!r}{suggest(str(value), AUTO_WRAP_POLICIES)}", attribute)


def _one_of(allowed: tuple[str, ...], optional: bool = False) -> Callable[[Any, attrs.Attribute, Any], None]:
    """Validator for direct construction; values from files are checked against ``choices`` first."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if (value is None and optional) or value in allowed:
            return
        raise ValueError(f"must be one of {', '.join(allowed)}, got {value!r}{suggest(str(value), allowed)}", attribute)

    return check


def _check_state_dict_type(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value == "LOCAL_STATE_DICT":
        raise ValueError("LOCAL_STATE_DICT is FSDP1-only (shards of FSDP1's flat parameters); torchrig runs FSDP2: use "
                         "SHARDED_STATE_DICT (every rank saves its shard with torch.distributed.checkpoint) or "
                         "FULL_STATE_DICT", attribute)
    _one_of(STATE_DICT_TYPES)(instance, attribute, value)


def _offload(value: Any) -> Any:
    """``CPUOffload(offload_params=...)`` (FSDP1) or ``CPUOffloadPolicy()``/``OffloadPolicy()`` (FSDP2)
    -> bool, recognised by duck typing so this module stays torch-free."""
    if hasattr(value, "offload_params"):
        return bool(value.offload_params)
    name = type(value).__name__
    if name == "CPUOffloadPolicy":
        return True
    if name == "OffloadPolicy":
        return False
    return value


def _reshard(value: Any) -> Any:
    """``fsdp_reshard_after_forward`` as Accelerate writes it for FSDP1 (a sharding-strategy name)
    -> FSDP2's bool; bools and ``true``/``false`` text pass through to coercion."""
    name = _sharding(value)
    if name in ("FULL_SHARD", "HYBRID_SHARD"):
        return True
    if name in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2", "NO_SHARD"):
        return False
    return value


_SCIENTIFIC = re.compile(r"^\s*\d+(\.\d*)?[eE]\+?\d+\s*$")


def _min_num_params(value: Any) -> Any:
    """``1e8`` (YAML 1.1 reads it as text) -> 100000000."""
    if isinstance(value, str) and _SCIENTIFIC.match(value):
        number = float(value)
        return int(number) if number.is_integer() else value
    return value


def _as_mapping(value: Any) -> Any:
    """A torch config object (``FullStateDictConfig(...)``, ``MixedPrecision(...)``, dataclasses) -> dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


STATE_DICT_CONFIG_KEYS = ("offload_to_cpu", "rank0_only")


def _check_state_dict_config(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """The options FSDP2's state-dict helpers take (``StateDictOptions(cpu_offload=...)``, rank 0 only
    for full state dicts); FSDP1's ``FullStateDictConfig`` objects are accepted as their fields."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a mapping ({', '.join(STATE_DICT_CONFIG_KEYS)}), got {value!r}", attribute)
    for key in value:
        if key not in STATE_DICT_CONFIG_KEYS and not str(key).startswith("_"):
            raise ValueError(f"unknown key {key!r}{suggest(str(key), STATE_DICT_CONFIG_KEYS)}; accepted: "
                             f"{', '.join(STATE_DICT_CONFIG_KEYS)}", attribute)


def _check_mixed_precision_policy(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ValueError("must be a mapping of MixedPrecisionPolicy fields (param_dtype, reduce_dtype, output_dtype, "
                         f"cast_forward_inputs) or a torch MixedPrecisionPolicy from Python, got {value!r}", attribute)
    for key, item in value.items():
        if key not in MIXED_PRECISION_KEYS:
            raise ValueError(f"unknown key {key!r}{suggest(str(key), MIXED_PRECISION_KEYS)}; accepted: "
                             f"{', '.join(MIXED_PRECISION_KEYS)}", attribute)
        if key == "cast_forward_inputs":
            if not isinstance(item, bool):
                raise ValueError(f"cast_forward_inputs must be true or false, got {item!r}", attribute)
        elif item is not None and isinstance(item, str):
            name = item.lower().removeprefix("torch.")
            if name not in DTYPE_NAMES:
                raise ValueError(f"{key}: unknown dtype {item!r}{suggest(name, DTYPE_NAMES)}; "
                                 f"accepted: {', '.join(DTYPE_NAMES)}", attribute)
        elif item is not None and type(item).__name__ != "dtype":
            raise ValueError(f"{key}: expected a dtype name (bf16, fp16, fp32) or a torch.dtype, got {item!r}",
                             attribute)


def _mixed_precision_policy(value: Any) -> Any:
    """Mappings and torch policy objects (``MixedPrecisionPolicy``/FSDP1 ``MixedPrecision``, both
    dataclasses) -> a dict of their fields; of FSDP1's ``MixedPrecision`` only the fields FSDP2 has
    (its other knobs, e.g. ``keep_low_precision_grads``, have no FSDP2 counterpart)."""
    mapping = _as_mapping(value)
    if mapping is not value and type(value).__name__ == "MixedPrecision":
        mapping = {k: v for k, v in mapping.items() if k in MIXED_PRECISION_KEYS}
    return mapping


def _check_fsdp_version(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value == 1:
        raise ValueError("1 is not supported: torchrig runs FSDP2 (fully_shard) only. Set fsdp_version: 2; the FSDP1 "
                         "options in this section are translated (sharding_strategy -> mesh and reshard_after_forward; "
                         "use_orig_params and limit_all_gathers have no effect)", attribute)
    if value != 2:
        raise ValueError(f"must be 2 (FSDP2), got {value!r}", attribute)


def _fsdp(name: str, *more: str) -> tuple[str, ...]:
    """Accelerate's file spelling of ``name`` (``fsdp_`` prefix), plus other accepted spellings."""
    return (f"fsdp_{name}", *more)


@attrs.frozen(kw_only=True)
class FullyShardedDataParallelPlugin:
    """FSDP2 options (``fsdp_config``), with Accelerate's class name and parameter names."""

    sharding_strategy: str = option(
        "FULL_SHARD", help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2 (or 1..5, or "
                           "a torch ShardingStrategy): the device mesh and whether parameters are resharded after "
                           "forward",
        aliases=_fsdp("sharding_strategy"), choices=SHARDING_STRATEGIES, normalize=_sharding, converter=_sharding,
        validator=_one_of(SHARDING_STRATEGIES))
    backward_prefetch: str | None = option(
        None, help="BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH; FSDP2 prefetches the next all-gather in backward by "
                   "default (BACKWARD_PRE); NO_PREFETCH turns that off; BACKWARD_POST behaves like BACKWARD_PRE",
        aliases=_fsdp("backward_prefetch", "fsdp_backward_prefetch_policy"), choices=BACKWARD_PREFETCH,
        normalize=_prefetch, converter=_prefetch, validator=_one_of(BACKWARD_PREFETCH, optional=True))
    mixed_precision_policy: Any = option(
        None, help="FSDP2 MixedPrecisionPolicy fields (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs); "
                   "default: derived from mixed_precision. From Python also a torch MixedPrecisionPolicy",
        aliases=_fsdp("mixed_precision_policy"), normalize=_mixed_precision_policy, converter=_mixed_precision_policy,
        validator=_check_mixed_precision_policy)
    auto_wrap_policy: Any = option(
        "TRANSFORMER_BASED_WRAP", help="which submodules get their own fully_shard: TRANSFORMER_BASED_WRAP (the "
        "classes in transformer_layer_cls_to_wrap, else the model's _no_split_modules), SIZE_BASED_WRAP "
        "(min_num_params), NO_WRAP (the root only); from Python also a callable policy",
        aliases=_fsdp("auto_wrap_policy"), normalize=_wrap_policy, converter=_wrap_policy,
        validator=_check_wrap_policy)
    transformer_layer_cls_to_wrap: list[str] | None = option(
        None, help="class names wrapped by TRANSFORMER_BASED_WRAP (a list or comma-separated); default: the model's "
                   "_no_split_modules",
        aliases=_fsdp("transformer_layer_cls_to_wrap", "transformer_cls_names_to_wrap"), normalize=class_names,
        converter=class_names)
    min_num_params: int = option(
        DEFAULT_MIN_NUM_PARAMS, help="SIZE_BASED_WRAP: wrap submodules with at least this many parameters "
                                     f"(default {DEFAULT_MIN_NUM_PARAMS:.0e}, torch's default; 0: the root only)",
        aliases=_fsdp("min_num_params"), normalize=_min_num_params, converter=_min_num_params, validator=at_least(0))
    cpu_offload: bool = option(
        False, help="keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy; "
                    "needs an accelerator)",
        aliases=_fsdp("cpu_offload", "fsdp_offload_params", "offload_params"), normalize=_offload, converter=_offload)
    ignored_modules: Any = option(None, help="modules fully_shard leaves alone (Python only)", python_only=True)
    state_dict_type: str = option(
        "FULL_STATE_DICT", help="FULL_STATE_DICT (gathered on rank 0) or SHARDED_STATE_DICT (each rank its shard, "
                                "torch.distributed.checkpoint); LOCAL_STATE_DICT is FSDP1-only",
        aliases=_fsdp("state_dict_type"), choices=STATE_DICT_TYPES, normalize=_state_dict_type,
        converter=_state_dict_type, validator=_check_state_dict_type)
    state_dict_config: dict[str, Any] | None = option(
        None, help="options of the model state dict (FullStateDictConfig: offload_to_cpu, rank0_only)",
        aliases=_fsdp("state_dict_config"), normalize=_as_mapping, converter=_as_mapping,
        validator=_check_state_dict_config)
    optim_state_dict_config: dict[str, Any] | None = option(
        None, help="options of the optimizer state dict (FullOptimStateDictConfig: offload_to_cpu, rank0_only)",
        aliases=_fsdp("optim_state_dict_config"), normalize=_as_mapping, converter=_as_mapping,
        validator=_check_state_dict_config)
    limit_all_gathers: bool = option(
        True, help="FSDP1-only: accepted, no effect (FSDP2 limits in-flight all-gathers itself)",
        aliases=_fsdp("limit_all_gathers"))
    use_orig_params: bool = option(
        True, help="FSDP1-only: accepted, no effect (FSDP2 always keeps the original parameters)",
        aliases=_fsdp("use_orig_params"))
    param_init_fn: Any = option(None, help="initialises modules created on the meta device (Python only)",
                                python_only=True)
    parallelize_fn: Any = option(None, help="parallelize_fn(model, mesh): applies tensor parallelism itself "
                                 "instead of parallelism_config.tp_plan, before sharding (Python only)",
                                 python_only=True)
    sync_module_states: bool = option(
        True, help="broadcast rank 0's parameters and buffers after sharding so every rank starts equal",
        aliases=_fsdp("sync_module_states"))
    forward_prefetch: bool = option(False, help="prefetch the next block's all-gather during forward",
                                    aliases=_fsdp("forward_prefetch"))
    activation_checkpointing: bool = option(False, help="recompute each wrapped block's activations in backward "
                                            "(activation_checkpointing_policy: full)",
                                            aliases=_fsdp("activation_checkpointing"))
    activation_checkpointing_policy: str | None = option(
        None, help="which activations are recomputed (setting it turns checkpointing on): full (each wrapped block), "
                   "every_k (every k-th block), selective (op level: keep matmul and attention outputs, recompute the "
                   "rest), memory_budget (torch.compile picks what to recompute to fit a budget); docs/memory.md",
        aliases=_fsdp("activation_checkpointing_policy"), choices=AC_POLICIES, validator=_one_of(AC_POLICIES, optional=True))
    activation_checkpointing_every_k: int | None = option(
        None, help="every_k: checkpoint the k-th, 2k-th, ... wrapped block (default 2)",
        aliases=_fsdp("activation_checkpointing_every_k"), validator=at_least(1))
    activation_checkpointing_matmul_every_k: int | None = option(
        None, help="selective: keep every k-th matmul output of a block and recompute the others (default 1: all; "
                   "2: every other, as torchtitan's op SAC)",
        aliases=_fsdp("activation_checkpointing_matmul_every_k"), validator=at_least(1))
    activation_checkpointing_memory_budget: float | None = option(
        None, help="memory_budget: fraction of the activations torch.compile's partitioner may keep (0: recompute "
                   "all, 1: keep all); needs torch.compile (dynamo_config.backend)",
        aliases=_fsdp("activation_checkpointing_memory_budget"), validator=between(0.0, 1.0))
    activation_offload: bool = option(
        False, help="keep the tensors wrapped blocks save for backward in CPU memory (torch save_on_cpu, pinned on "
                    "CUDA); a checkpointed block's: the inputs it keeps for the recomputation",
        aliases=_fsdp("activation_offload", "fsdp_activation_checkpointing_offload"))
    activation_offload_every_k: int | None = option(
        None, help="activation_offload: offload the k-th, 2k-th, ... wrapped block (default 1: all)",
        aliases=_fsdp("activation_offload_every_k"), validator=at_least(1))
    cpu_ram_efficient_loading: bool = option(
        False, help="only rank 0 loads weights into CPU memory, the others start on the meta device and receive them "
                    "(needs sync_module_states)",
        aliases=_fsdp("cpu_ram_efficient_loading"))
    reshard_after_forward: bool | None = option(
        None, help="FSDP2: free gathered parameters after forward (true: ZeRO-3-like) or keep them for backward "
                   "(false: ZeRO-2-like); default: from sharding_strategy",
        aliases=_fsdp("reshard_after_forward"), normalize=_reshard, converter=_reshard)
    fsdp_version: int = option(2, help="2 (FSDP2, fully_shard); 1 is not supported", validator=_check_fsdp_version)

    @property
    def resolved_reshard_after_forward(self) -> bool:
        """``reshard_after_forward``, or what ``sharding_strategy`` implies when it is not set."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")


__all__ = [
    "AC_POLICIES",
    "AUTO_WRAP_POLICIES",
    "BACKWARD_PREFETCH",
    "DEFAULT_MIN_NUM_PARAMS",
    "SHARDING_STRATEGIES",
    "STATE_DICT_TYPES",
    "FullyShardedDataParallelPlugin",
]
