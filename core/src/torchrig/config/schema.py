"""Declaring configuration options, and turning loose values into typed option objects.

The core's options and every plugin's section are frozen attrs classes whose fields are declared
with :func:`option`. From those declarations torchrig derives everything else: the accepted file
keys (and their aliases, e.g. Accelerate's ``fsdp_`` prefixed spellings), the environment
variable and the ``torchrig launch`` flag of each key, the type coercion and the error messages.
Plugin authors declare their section the same way; the core never knows a plugin's keys.

Torch-free: manifests and the CLI import it.
"""

from __future__ import annotations

import difflib
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

#: Metadata key under which :func:`option` stores its :class:`OptionInfo`.
META = "torchrig"


@attrs.frozen
class OptionInfo:
    """What torchrig knows about one option beyond its attrs field."""

    help: str = ""
    #: Other spellings accepted in files and arguments (Accelerate's names).
    aliases: tuple[str, ...] = ()
    #: Allowed values (strings compared case-sensitively after ``normalize``).
    choices: tuple[str, ...] = ()
    #: Choices are the names of the installed plugins of this kind (``"precision"``...).
    choices_from_kind: str | None = None
    #: Map accepted spellings to the canonical value (``{"FULL_SHARD": "full_shard"}``).
    normalize: Callable[[Any], Any] | None = None
    #: ``torchrig launch`` flag; ``None`` derives ``--<key>`` for top-level core options, and no
    #: flag for section fields (plugins contribute theirs through ``torchrig_cli_flags``).
    flag: str | None = None
    #: Whether the option can be set from an environment variable.
    env: bool = True
    #: Options whose value is a Python object (a callable, a module) cannot come from a file.
    python_only: bool = False


def option(
    default: Any = attrs.NOTHING,
    *,
    factory: Callable[[], Any] | None = None,
    help: str = "",
    aliases: Sequence[str] = (),
    choices: Sequence[str] = (),
    choices_from_kind: str | None = None,
    normalize: Callable[[Any], Any] | None = None,
    flag: str | None = None,
    env: bool = True,
    python_only: bool = False,
    validator: Any = None,
    converter: Any = None,
) -> Any:
    """An attrs field carrying torchrig's :class:`OptionInfo`."""
    info = OptionInfo(
        help=help,
        aliases=tuple(aliases),
        choices=tuple(choices),
        choices_from_kind=choices_from_kind,
        normalize=normalize,
        flag=flag,
        env=env,
        python_only=python_only,
    )
    kwargs: dict[str, Any] = {"metadata": {META: info}, "validator": validator, "converter": converter}
    if factory is not None:
        kwargs["factory"] = factory
    elif default is not attrs.NOTHING:
        kwargs["default"] = default
    return attrs.field(**kwargs)


def info_of(field: attrs.Attribute) -> OptionInfo:
    return field.metadata.get(META) or OptionInfo()


# --------------------------------------------------------------------------------------------
# validators shared by core and plugins


def at_least(minimum: float) -> Callable[[Any, attrs.Attribute, Any], None]:
    """Validator; like every torchrig validator it may be called with ``instance=None``."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        _finite(value, attribute)
        if value is not None and value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}", attribute)

    return check


def between(low: float, high: float) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        _finite(value, attribute)
        if value is not None and not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}, got {value}", attribute)

    return check


def _finite(value: Any, attribute: attrs.Attribute) -> None:
    """nan compares false with every bound, so a range check alone would let it through."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value}", attribute)


def class_names(value: Any) -> Any:
    """Normaliser for options naming classes: classes from Python (``LlamaDecoderLayer``) become
    their names, ``"A,B"`` becomes ``["A", "B"]``; anything else is left for coercion to judge."""
    if isinstance(value, type):
        return [value.__name__]
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [v.__name__ if isinstance(v, type) else v for v in value]
    return value


def enum_name(value: Any) -> Any:
    """Accept a Python enum member where a string is expected (``ShardingStrategy.FULL_SHARD``)."""
    return value.name if isinstance(value, enum.Enum) else value


# --------------------------------------------------------------------------------------------
# coercion: loose value (file, env var, flag, argument) -> field type


class CoercionError(ValueError):
    """A value does not fit its option's type; the message says what was expected."""


_TRUE = {"true", "yes", "on", "1", "y"}
_FALSE = {"false", "no", "off", "0", "n"}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, raw_text: str | None = None) -> Any:
    """Convert ``value`` to type ``tp`` (str, int, float, bool, Literal, Optional, list, dict,
    tuple, Any). ``raw_text`` is the YAML source of a plain scalar: ``no`` read as ``False`` by
    YAML 1.1 is taken as the string ``"no"`` where a string is expected."""
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, raw_text)
            except CoercionError as exc:
                errors.append(str(exc))
        if len(errors) == 1:  # Optional[X]: X's own message is the clearest
            raise CoercionError(errors[0])
        raise CoercionError(f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        candidate = raw_text if (raw_text is not None and not isinstance(value, str)) else value
        if candidate in allowed:
            return candidate
        if isinstance(candidate, str):
            for a in allowed:
                if isinstance(a, str) and a.lower() == candidate.lower():
                    return a
        raise CoercionError(f"expected one of {', '.join(repr(a) for a in allowed)}, got {candidate!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise CoercionError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise CoercionError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise CoercionError(f"expected an integer, got {value!r}")
    if tp is float:
        number = _as_float(value)
        if number is None:
            raise CoercionError(f"expected a number, got {value!r}")
        if not math.isfinite(number):  # nan passes every comparison; inf overflows int() and timedelta
            raise CoercionError(f"expected a finite number, got {number!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if raw_text is not None:
            return raw_text
        if isinstance(value, enum.Enum):
            return value.name
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise CoercionError(f"expected a string, got {value!r}")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        args = typing.get_args(tp)
        item_type = args[0] if args else Any
        if isinstance(value, str):
            items: list[Any] = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise CoercionError(f"expected a list, got {value!r}")
        converted = [coerce(item, item_type) for item in items]
        return tuple(converted) if (origin is tuple or tp is tuple) else converted
    if origin in (dict, Mapping) or tp is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise CoercionError(f"expected a mapping, got {value!r}")
    if isinstance(tp, type) and attrs.has(tp):
        if isinstance(value, tp):
            return value
        raise CoercionError(f"expected a {tp.__name__} section (a mapping), got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise CoercionError(f"expected {_type_name(tp)}, got {value!r}")


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an int too large for a float
            return math.inf
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


# --------------------------------------------------------------------------------------------
# structure: mapping of loose values -> options object, with every problem collected


@attrs.frozen
class FieldSpec:
    """One option of one options class, with everything derived from its declaration."""

    name: str
    type: Any
    field: attrs.Attribute
    info: OptionInfo

    @property
    def has_default(self) -> bool:
        return self.field.default is not attrs.NOTHING

    def default(self) -> Any:
        default = self.field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            return default.factory()
        return default


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """An options class's resolved annotations, evaluated once per class: a run builds its
    :class:`~torchrig.config.resolve.Schema` more than once, and evaluating every section's
    annotations is most of building one."""
    return typing.get_type_hints(cls)


def field_specs(cls: type) -> dict[str, FieldSpec]:
    """Fields of an attrs options class, with resolved type hints."""
    hints = _type_hints(cls)
    return {f.name: FieldSpec(f.name, hints.get(f.name, Any), f, info_of(f)) for f in attrs.fields(cls)}


def key_index(cls: type) -> dict[str, str]:
    """Accepted spelling -> field name (names and aliases)."""
    index: dict[str, str] = {}
    for name, spec in field_specs(cls).items():
        index[name] = name
        for alias in spec.info.aliases:
            index[alias] = name
    return index


def suggest(word: str, candidates: Iterator[str] | Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` or an empty string."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@attrs.define
class Problem:
    path: str
    message: str
    where: str | None = None

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        return f"{self.path}{where}: {self.message}"


def build_options(cls: type, values: Mapping[str, Any], *, path: str = "") -> tuple[Any, list[Problem]]:
    """Construct ``cls`` from already-coerced field values. Each field's converter and validator
    run first on their own, so every bad field is reported, not only the first; then the
    constructor runs (validators that need the whole object report there).
    Returns ``(instance or None, problems)``."""
    problems: list[Problem] = []
    fields = {f.name: f for f in attrs.fields(cls)}
    for name, value in values.items():
        field = fields[name]
        try:
            if field.converter is not None:
                value = field.converter(value)
            if field.validator is not None:
                field.validator(None, field, value)
        except (TypeError, ValueError) as exc:
            problems.append(Problem(f"{path}.{name}" if path else name, _clean_attrs_message(exc)))
    if problems:
        return None, problems
    try:
        return cls(**values), []
    except (TypeError, ValueError) as exc:
        field_name = _field_named_in(exc, values)
        key = f"{path}.{field_name}" if (path and field_name) else (field_name or path or cls.__name__)
        return None, [Problem(key, _clean_attrs_message(exc))]


def _field_named_in(exc: BaseException, values: Mapping[str, Any]) -> str | None:
    args = getattr(exc, "args", ())
    if len(args) >= 2 and isinstance(args[1], attrs.Attribute):
        return args[1].name
    text = str(exc)
    for name in values:
        if f"'{name}'" in text:
            return name
    return None


def _clean_attrs_message(exc: BaseException) -> str:
    args = getattr(exc, "args", ())
    if len(args) >= 4 and isinstance(args[1], attrs.Attribute):  # attrs.validators.in_
        return f"must be one of {', '.join(repr(c) for c in args[2])}, got {args[3]!r}"
    return str(args[0]) if args else str(exc)


__all__ = [
    "CoercionError",
    "FieldSpec",
    "OptionInfo",
    "Problem",
    "at_least",
    "between",
    "build_options",
    "class_names",
    "coerce",
    "enum_name",
    "field_specs",
    "info_of",
    "key_index",
    "option",
    "suggest",
]
