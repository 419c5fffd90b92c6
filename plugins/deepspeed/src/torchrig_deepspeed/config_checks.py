"""Checks of a DeepSpeed configuration against itself and against torchrig's configuration.

DeepSpeed ignores top-level keys it does not read: ``"zero_optimisation": {"stage": 3}`` trains
with ZeRO disabled and says nothing. The set of keys it reads is derived from DeepSpeed itself,
not copied into torchrig (it changes between releases; 0.19 removed several blocks):
:func:`deepspeed_top_level_keys` runs DeepSpeed's own parser
(``deepspeed.runtime.config.DeepSpeedConfig``, which reads every top-level key through the
constants of ``deepspeed.runtime.constants`` and its sub-configs' modules) once over a mapping that
records each key the parser looks up, plus the two keys ``deepspeed.initialize`` reads itself. The
parser reads the same top-level keys whatever the configuration enables, so one run suffices.
Scanning the constants modules directly was rejected: they mix top-level keys with sub-keys and
values (``"enabled"``, ``"type"``, ``"auto"``, ``"mean"``), which would let typos through and spoil
did-you-mean, and they miss keys spelled inline (``"zero_optimization"``, ``"compile"``).

Below the top level DeepSpeed's pydantic models reject unknown keys; :func:`deepspeed_own_problems`
runs the same parser on the configuration (with ``"auto"`` values, which the runtime fills in,
left out) so those errors, and DeepSpeed's own sanity checks (removed features, ZeRO stage
limits...), are reported before launch together with everything else, with file:line and
did-you-mean from the pydantic model's field names.

Importing this module imports neither torch nor DeepSpeed; the functions import them lazily,
once per process (DeepSpeed's import takes seconds, and imports torch).
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import KeysView, Mapping
from typing import Any

from torchrig.plugin import ConfigError, ConfigProblem, CoreOptions, ResolvedConfig, suggest

from torchrig_deepspeed.constants import AUTO, DEFAULT_ZERO_STAGE, DS_KEY, SECTION
from torchrig_deepspeed.ds_json import DeepSpeedJSON, load_deepspeed_json
from torchrig_deepspeed.options import DeepSpeedPlugin

#: Read by ``deepspeed.initialize`` itself (mesh for sequence/data parallelism), not by the parser.
INITIALIZE_KEYS = frozenset({"sequence_parallel_size", "data_parallel_size"})
#: Keys every DeepSpeed release reads; if the recording misses one, the derivation failed.
_SENTINELS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                        "zero_optimization", "fp16", "bf16", "optimizer", "scheduler", "gradient_clipping"})


class DeepSpeedConfigNotChecked(UserWarning):
    """The DeepSpeed JSON's keys could not be checked (DeepSpeed is not importable here)."""


# --------------------------------------------------------------------------------------------
# the top-level keys DeepSpeed reads, derived from DeepSpeed


class _RecordingDict(dict):
    """A dict remembering every key looked up in it (``[]``, ``get``, ``in``, ``.keys()``, ``pop``)."""

    def __init__(self, data: Mapping[str, Any], seen: set[str] | None = None) -> None:
        super().__init__(data)
        self.seen: set[str] = set() if seen is None else seen

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.seen.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self.seen.add(key)
        return super().pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().setdefault(key, default)

    def keys(self) -> KeysView[Any]:  # type: ignore[override]
        return KeysView(self)  # its __contains__ goes through ours

    def __copy__(self) -> _RecordingDict:
        return self  # DeepSpeedConfig parses a shallow copy: keep recording into the same set

    def __deepcopy__(self, memo: dict[int, Any]) -> _RecordingDict:
        return _RecordingDict(copy.deepcopy(dict(self), memo), self.seen)


@functools.lru_cache(maxsize=1)
def deepspeed_top_level_keys() -> tuple[frozenset[str] | None, str]:
    """``(keys, "")``, or ``(None, why)`` when DeepSpeed cannot be imported or the derivation failed."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except Exception as exc:  # ImportError, or DeepSpeed failing at import on this machine
        return None, f"deepspeed is not importable ({type(exc).__name__}: {exc})"
    recorder = _RecordingDict({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                               "gradient_accumulation_steps": 1})
    error = ""
    try:
        DeepSpeedConfig(recorder)
    except Exception as exc:  # the recording up to the failure is still used, if complete enough
        error = f" ({type(exc).__name__}: {exc})"
    seen = {key for key in recorder.seen if isinstance(key, str)}
    if not _SENTINELS <= seen:
        missing = ", ".join(sorted(_SENTINELS - seen))
        return None, f"could not derive the keys DeepSpeed reads (its parser did not read {missing}){error}"
    return frozenset(seen | INITIALIZE_KEYS), ""


# --------------------------------------------------------------------------------------------
# DeepSpeed's own parser over the configuration


def deepspeed_own_problems(ds: DeepSpeedJSON) -> list[tuple[str, str | None]]:
    """What ``DeepSpeedConfig`` (DeepSpeed's pydantic models and sanity checks) says about the
    configuration, as ``(message, where)`` pairs; empty when it accepts it or DeepSpeed is missing.

    ``"auto"`` values are left out (the runtime fills them in), and the batch-size triple is
    replaced by a consistent one: it depends on the world size, which this process does not have,
    and is checked separately against ``num_processes``. DeepSpeed's parser stops at the first
    invalid block, so the block a pydantic error points into is dropped and the parser run again
    (a few milliseconds each), to report every block's problems at once."""
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except Exception:
        return []
    data = _without_auto(copy.deepcopy(ds.data))
    data.pop("train_batch_size", None)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if not _is_number(data.get(key)) or data[key] < 1:
            data[key] = 1
    if _enabled(data.get("fp16")) and _enabled(data.get("bf16", data.get("bfloat16"))):
        data.pop("bf16", None)  # reported on its own, with the file and line
        data.pop("bfloat16", None)
    found: list[tuple[str, str | None]] = []
    for _ in range(len(data) + 1):
        try:
            DeepSpeedConfig(data)
            break
        except Exception as exc:
            messages, blocks = _explain(exc, data, ds)
            found.extend(messages)
            if not blocks:
                break
            for block in blocks:
                data.pop(block, None)
    return found


def _explain(exc: BaseException, data: Mapping[str, Any],
             ds: DeepSpeedJSON) -> tuple[list[tuple[str, str | None]], set[str]]:
    """Messages for one parser failure, and the top-level blocks it was in (to drop for the next run)."""
    errors = getattr(exc, "errors", None)
    title = getattr(exc, "title", None)
    if not callable(errors) or not isinstance(title, str):  # an assertion or DeepSpeed's own error
        return [(f"DeepSpeed rejects this configuration: {_one_paragraph(exc)}", ds.where())], set()
    messages: list[tuple[str, str | None]] = []
    blocks: set[str] = set()
    try:
        items = list(errors())
    except Exception:
        return [(f"DeepSpeed rejects this configuration: {_one_paragraph(exc)}", ds.where())], set()
    for error in items:
        loc = tuple(str(part) for part in error.get("loc", ()))
        block = _block_containing(data, loc)
        path = (block, *loc) if block else loc
        text = f"DeepSpeed rejects {'.'.join(path)!r}: {error.get('msg', 'invalid')}"
        if error.get("type") == "extra_forbidden" and loc:
            text += suggest(loc[-1], _model_keys(title, loc[:-1]))
        elif "input" in error and error.get("type") != "missing":
            text += f" (got {error['input']!r})"
        messages.append((text, ds.where(*path) if block else ds.where()))
        if block:
            blocks.add(block)
    return messages, blocks


def _block_containing(data: Mapping[str, Any], loc: tuple[str, ...]) -> str | None:
    """The top-level key whose value holds ``loc`` (pydantic locations are relative to the block the
    model was built from); None if no block or several do."""
    if not loc:
        return None
    owners = []
    for key, value in data.items():
        node: Any = value
        for part in loc:
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                break
        else:
            owners.append(key)
    return owners[0] if len(owners) == 1 else None


def _model_keys(title: str, parents: tuple[str, ...]) -> list[str]:
    """Field names and aliases of the pydantic model DeepSpeed named (``DeepSpeedZeroConfig``), or of
    the nested model at ``parents``, for did-you-mean. Found among DeepSpeed's loaded modules."""
    import sys

    model = None
    for name, module in list(sys.modules.items()):
        candidate = getattr(module, title, None) if name.startswith("deepspeed") else None
        if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
            model = candidate
            break
    for part in parents:
        if model is None:
            return []
        field = _field(model, part)
        model = _nested_model(field.annotation) if field is not None else None
    if model is None:
        return []
    keys = []
    for name, field in model.model_fields.items():
        keys.append(name)
        if isinstance(getattr(field, "alias", None), str):
            keys.append(field.alias)
    return keys


def _field(model: Any, key: str) -> Any:
    for name, field in model.model_fields.items():
        if key in (name, getattr(field, "alias", None)):
            return field
    return None


def _nested_model(annotation: Any) -> Any:
    import typing

    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _without_auto(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_auto(v) for k, v in value.items() if not _is_auto(v)}
    return value


def _one_paragraph(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and "errors.pydantic.dev" not in line]
    text = "; ".join(lines) or type(exc).__name__
    return text if len(text) <= 600 else text[:597] + "..."


# --------------------------------------------------------------------------------------------
# the checks


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def _is_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_number(value: Any) -> Any:
    """``3``/``"3"``/``1.0`` -> the number (as pydantic's lax mode reads it); anything else (bools
    included) -> None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
        return int(number) if number.is_integer() else number
    return None


def _enabled(block: Any) -> bool | None:
    """A precision block's ``enabled``: True/False when given, None when absent or ``"auto"``."""
    if not isinstance(block, Mapping):
        return None
    value = block.get("enabled")
    if value is True or (isinstance(value, str) and value.strip().lower() == "true"):
        return True
    if value is False or (isinstance(value, str) and value.strip().lower() == "false"):
        return False
    return None


def deepspeed_problems(config: ResolvedConfig) -> list[ConfigProblem]:
    """Every problem of the DeepSpeed side of ``config`` (a resolved configuration): its typed
    section (:class:`DeepSpeedPlugin`) and the core's (:class:`CoreOptions`)."""
    problems: list[ConfigProblem] = []
    options, core = config.section_of(DeepSpeedPlugin), config.section_of(CoreOptions)
    ds: DeepSpeedJSON | None = None
    if options.hf_ds_config is not None:
        try:
            ds = load_deepspeed_json(options.hf_ds_config)
        except ConfigError as exc:
            problems.extend(ConfigProblem(DS_KEY, p) for p in exc.problems)
    if ds is not None:
        problems.extend(_unknown_keys(ds))
        problems.extend(_precision_problems(core, ds))
        problems.extend(_batch_problems(config, options, ds))
    problems.extend(_plugin_vs_json_problems(config, options, ds))
    problems.extend(_engine_precision_problems(core))
    if ds is None and _fp16_in_effect(core, None):
        problems.extend(_fp16_on_cpu(core, None))
    if ds is not None:
        problems.extend(ConfigProblem(DS_KEY, message, where) for message, where in deepspeed_own_problems(ds))
    return problems


def _unknown_keys(ds: DeepSpeedJSON) -> list[ConfigProblem]:
    keys, why = deepspeed_top_level_keys()
    if keys is None:
        warnings.warn(f"cannot check the DeepSpeed config's top-level keys: {why}", DeepSpeedConfigNotChecked,
                      stacklevel=2)
        return []
    problems = []
    for key in ds.data:
        if key not in keys:
            problems.append(ConfigProblem(DS_KEY, (
                f"unknown top-level DeepSpeed key {key!r}{suggest(str(key), sorted(keys))}; DeepSpeed would silently "
                "ignore it"), ds.where(key)))
    return problems


def _engine_precision_problems(core: CoreOptions) -> list[ConfigProblem]:
    """The engine applies precision itself: only no, fp16 and bf16 (its fp16/bf16 blocks) exist."""
    precision = core.mixed_precision
    if precision in (None, "no", "fp16", "bf16"):
        return []
    return [ConfigProblem("mixed_precision", (
        f"{precision} cannot run under DeepSpeed: its engine applies precision itself and offers only fp16 and bf16 "
        f"(its fp16/bf16 blocks); a precision plugin's conversions (fp8: torchao Float8Linear) do not compose with "
        f"its weights and casts. Use the fsdp or ddp strategy for {precision}, or mixed_precision: bf16"))]


def _precision_problems(core: CoreOptions, ds: DeepSpeedJSON) -> list[ConfigProblem]:
    problems = []
    precision = core.mixed_precision
    bf16_key = "bf16" if "bf16" in ds.data or "bfloat16" not in ds.data else "bfloat16"
    fp16, bf16 = _enabled(ds.data.get("fp16")), _enabled(ds.data.get(bf16_key))
    if fp16 and bf16:
        problems.append(ConfigProblem(DS_KEY, (
            f"enables both fp16 and {bf16_key} ({ds.describe('fp16', 'enabled')}, {ds.describe(bf16_key, 'enabled')}); "
            "DeepSpeed runs one of them: disable one"), ds.where("fp16")))
    blocks = {"fp16": ("fp16", fp16), "bf16": (bf16_key, bf16)}
    if precision in blocks:
        other = "bf16" if precision == "fp16" else "fp16"
        other_name, other_enabled = blocks[other]
        own_name, own_enabled = blocks[precision]
        if other_enabled:
            problems.append(ConfigProblem("mixed_precision", (
                f"{precision} contradicts the DeepSpeed config, which enables {other_name} "
                f"({ds.describe(other_name, 'enabled')}); set mixed_precision: {other}, or disable {other_name} "
                f"(or set its enabled to \"auto\") in the DeepSpeed config")))
        elif own_enabled is False:
            problems.append(ConfigProblem("mixed_precision", (
                f"{precision} contradicts the DeepSpeed config, which disables {own_name} "
                f"({ds.describe(own_name, 'enabled')}); set its enabled to true or \"auto\", or mixed_precision: no")))
    if _fp16_in_effect(core, ds):
        problems.extend(_fp16_on_cpu(core, ds))
    return problems


def _fp16_in_effect(core: CoreOptions, ds: DeepSpeedJSON | None) -> bool:
    if core.mixed_precision == "fp16":
        return True
    return ds is not None and bool(_enabled(ds.data.get("fp16")))


def _fp16_on_cpu(core: CoreOptions, ds: DeepSpeedJSON | None) -> list[ConfigProblem]:
    """DeepSpeed's fp16 (loss-scaled fp16 optimizer) needs CUDA; its CPU accelerator refuses it."""
    if core.mixed_precision == "fp16":
        key, where = "mixed_precision", None
    else:
        key, where = DS_KEY, (ds.where("fp16") if ds is not None else None)
    fix = "use bf16 (mixed_precision: bf16) or fp32 on the CPU"
    if core.use_cpu or core.device == "cpu":
        return [ConfigProblem(key, f"DeepSpeed's fp16 needs a CUDA GPU, but this run uses the CPU (use_cpu/device); "
                                   f"{fix}", where)]
    if not _cuda_available():
        return [ConfigProblem(key, f"DeepSpeed's fp16 needs a CUDA GPU and torch finds none on this machine; {fix}",
                              where)]
    return []


def _cuda_available() -> bool:
    import torch  # only when fp16 is asked for

    return bool(torch.cuda.is_available())


def _effective_accumulation(config: ResolvedConfig, options: DeepSpeedPlugin) -> tuple[int | None, str]:
    """The explicitly configured accumulation steps (plugin field, else the top-level key if a source
    set it) and the key it came from; ``(None, "")`` when only defaults say anything."""
    if options.gradient_accumulation_steps is not None:
        return options.gradient_accumulation_steps, f"{SECTION}.gradient_accumulation_steps"
    if config.is_set("gradient_accumulation_steps"):
        return config.section_of(CoreOptions).gradient_accumulation_steps, "gradient_accumulation_steps"
    return None, ""


def _batch_problems(config: ResolvedConfig, options: DeepSpeedPlugin, ds: DeepSpeedJSON) -> list[ConfigProblem]:
    problems = []
    data = ds.data
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = data.get(key)
        if value is not None and not _is_auto(value) and not (_is_number(value) and value >= 1):
            problems.append(ConfigProblem(DS_KEY, f"{key} must be a positive integer or \"auto\", got {value!r}",
                                          ds.where(key)))
    if problems:
        return problems
    total, micro, steps = data.get("train_batch_size"), data.get("train_micro_batch_size_per_gpu"), \
        data.get("gradient_accumulation_steps")
    explicit_steps, steps_key = _effective_accumulation(config, options)
    core = config.section_of(CoreOptions)
    if _is_number(steps) and explicit_steps is not None and steps != explicit_steps:
        problems.append(ConfigProblem(steps_key, (
            f"{explicit_steps} disagrees with the DeepSpeed config's gradient_accumulation_steps = {steps} "
            f"({ds.describe('gradient_accumulation_steps')}); set one of them (or \"auto\" in the DeepSpeed config)")))
    if not _is_number(steps):
        steps = explicit_steps if explicit_steps is not None else core.gradient_accumulation_steps or 1
    world = core.num_processes
    if not (_is_number(total) and _is_number(world)):
        return problems
    if _is_number(micro):
        if total != micro * steps * world:
            problems.append(ConfigProblem(DS_KEY, (
                f"train_batch_size = {total} must equal "
                f"train_micro_batch_size_per_gpu × gradient_accumulation_steps × processes = {micro} × {steps} × "
                f"{world} (num_processes) = {micro * steps * world}; DeepSpeed refuses it at initialize. Set it to "
                f"{micro * steps * world} or \"auto\""), ds.where("train_batch_size")))
    elif total % (steps * world):
        problems.append(ConfigProblem(DS_KEY, (
            f"train_batch_size = {total} is not divisible by "
            f"gradient_accumulation_steps × processes = {steps} × {world}, so DeepSpeed cannot derive a micro batch "
            "size; change it or set it to \"auto\""), ds.where("train_batch_size")))
    return problems


def _zero_block(ds: DeepSpeedJSON | None) -> Mapping[str, Any]:
    block = ds.data.get("zero_optimization") if ds is not None else None
    return block if isinstance(block, Mapping) else {}


def _plugin_vs_json_problems(config: ResolvedConfig, options: DeepSpeedPlugin,
                             ds: DeepSpeedJSON | None) -> list[ConfigProblem]:
    """A plugin field fills the JSON's ``"auto"`` or missing value; a contradiction is an error."""
    problems = []
    zero = _zero_block(ds)
    plugin_steps = options.gradient_accumulation_steps
    top_steps = config.section_of(CoreOptions).gradient_accumulation_steps
    if plugin_steps is not None and config.is_set("gradient_accumulation_steps") and plugin_steps != top_steps:
        problems.append(ConfigProblem(f"{SECTION}.gradient_accumulation_steps", (
            f"{plugin_steps} disagrees with gradient_accumulation_steps = {top_steps}; set one of them")))

    def conflict(field: str, plugin_value: Any, json_value: Any, *json_path: str) -> None:
        if plugin_value is None or json_value is None or _is_auto(json_value):
            return
        if isinstance(json_value, str) and isinstance(plugin_value, str):
            same = json_value.strip().lower() == plugin_value
        else:  # DeepSpeed's pydantic models read "3" as 3
            same = _as_number(json_value) == plugin_value
        if not same:
            assert ds is not None
            problems.append(ConfigProblem(f"{SECTION}.{field}", (
                f"{plugin_value!r} disagrees with the DeepSpeed config's {ds.describe(*json_path)} = {json_value!r}; "
                "set one of them (or \"auto\" in the DeepSpeed config)")))

    stage = options.zero_stage
    conflict("zero_stage", stage, zero.get("stage"), "zero_optimization", "stage")
    if ds is not None:
        conflict("gradient_clipping", options.gradient_clipping, ds.data.get("gradient_clipping"),
                 "gradient_clipping")
    json_stage = _as_number(zero.get("stage"))
    effective_stage = stage if stage is not None else (json_stage if _is_number(json_stage) else DEFAULT_ZERO_STAGE)
    for kind, needs_stage3 in (("optimizer", False), ("param", True)):
        field = f"offload_{kind}_device"
        block = zero.get(f"offload_{kind}")
        block = block if isinstance(block, Mapping) else {}
        plugin_device = getattr(options, field)
        json_device = block.get("device")
        conflict(field, plugin_device, json_device, "zero_optimization", f"offload_{kind}", "device")
        device = plugin_device or (json_device.strip().lower() if isinstance(json_device, str)
                                   and not _is_auto(json_device) else None)
        path = getattr(options, f"offload_{kind}_nvme_path") or (
            block.get("nvme_path") if not _is_auto(block.get("nvme_path")) else None)
        if device == "nvme" and not path:
            problems.append(ConfigProblem(f"{SECTION}.{field}", (
                f"nvme offload needs a directory on an NVMe drive: set offload_{kind}_nvme_path (or "
                f"zero_optimization.offload_{kind}.nvme_path in the DeepSpeed config)")))
        if needs_stage3 and device in ("cpu", "nvme") and _is_number(effective_stage) and effective_stage != 3:
            problems.append(ConfigProblem(f"{SECTION}.{field}", (
                f"parameter offload ({device}) works only with ZeRO stage 3, but the stage is {effective_stage}; "
                "DeepSpeed would ignore it. Set zero_stage: 3, or offload only the optimizer")))
    if options.zero3_init_flag and _is_number(effective_stage) and effective_stage != 3:
        problems.append(ConfigProblem(f"{SECTION}.zero3_init_flag", (
            f"deepspeed.zero.Init partitions parameters for ZeRO stage 3, but the stage is {effective_stage}; set "
            "zero_stage: 3 or zero3_init_flag: false")))
    return problems


__all__ = [
    "DeepSpeedConfigNotChecked",
    "DeepSpeedJSON",
    "deepspeed_own_problems",
    "deepspeed_problems",
    "deepspeed_top_level_keys",
    "load_deepspeed_json",
]
