"""Read YAML/JSON configuration files into plain data, keeping where every value came from.

Why not ``yaml.safe_load`` / ``json.loads``: both silently keep the last of duplicate keys,
neither keeps line numbers, and YAML 1.1 reads ``mixed_precision: no`` as ``False``. This
module builds on pyyaml's composer (so scalars resolve exactly as ``safe_load`` resolves them)
but rejects duplicate and non-string keys, records a :class:`Mark` (file:line:column) for every
value, and keeps the source text of plain scalars YAML turned into bool/null/int/float (so a
schema that expects the string ``"no"`` can still get it). Every failure is a
:class:`~torchrig.errors.ConfigError` that names the file, line and column.

Choices (documented here because they differ from ``safe_load``):

* merge keys (``<<: *defaults``) are supported with YAML's semantics: keys written in the
  mapping win over merged ones, and in ``<<: [*a, *b]`` ``a`` wins over ``b``;
* a timestamp-looking plain scalar (``2024-01-01``) and the bare ``=`` stay strings, because
  configuration data is plain JSON-like data (``safe_load`` would return a ``date``, or fail);
* ``!!binary``, ``!!set``, ``!!omap``, ``!!pairs`` and any non-standard tag are errors;
* an empty file (or one holding only comments, or only ``---``) is an empty mapping;
* aliases may not refer to a node that contains them (recursive data), and alias expansion is
  bounded, so a "billion laughs" file is an error rather than a hang.

This module never imports torch: the CLI reads configs before torch is imported.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from torchrig.errors import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "Document", "Mark", "load_file", "load_text", "resolve_extends"]

Path = tuple[str | int, ...]

_YAML = "tag:yaml.org,2002:"
_NULL, _BOOL, _INT, _FLOAT, _STR = (_YAML + t for t in ("null", "bool", "int", "float", "str"))
_TIMESTAMP, _VALUE, _MERGE = _YAML + "timestamp", _YAML + "value", _YAML + "merge"
_SEQ, _MAP = _YAML + "seq", _YAML + "map"
_CONSTRUCTED = (_NULL, _BOOL, _INT, _FLOAT, _STR)
# Read as their source text: configs hold plain data, and safe_load would give a date or fail.
_AS_TEXT = (_TIMESTAMP, _VALUE, _MERGE)

#: Largest config file read (1 MiB): a config is a page of settings, and a bigger "file" is a
#: mistake (``/dev/zero``, a log, a checkpoint) that must not be read into memory.
MAX_CONFIG_BYTES = 1 << 20
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))

# How many nodes alias expansion may visit beyond the document's own nodes ("billion laughs").
_MAX_ALIAS_EXPANSION = 100_000
_LINE_BREAKS = "\r\n\x85\u2028\u2029"


@attrs.frozen
class Mark:
    """A position in a config file, 1-based, printed ``file:line:column`` like compilers do."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@attrs.frozen
class Document:
    """One loaded config file: plain ``data`` plus where each value came from.

    ``marks`` maps a path (tuple of keys and list indices) to the mark of the entry: the key's
    mark for mapping entries, the item's for list items; ``()`` is where the document starts.
    ``raw_scalars`` maps a path to the source text of a *plain* (unquoted) YAML scalar that was
    resolved to bool/null/int/float, e.g. ``("mixed_precision",) -> "no"``.
    """

    data: dict[str, Any]
    file: str
    marks: Mapping[Path, Mark] = attrs.field(factory=dict)
    raw_scalars: Mapping[Path, str] = attrs.field(factory=dict)

    def mark(self, path: Iterable[str | int]) -> Mark | None:
        """The mark of ``path``, else of its closest ancestor that has one (None if none has)."""
        path = tuple(path)
        for end in range(len(path), -1, -1):
            found = self.marks.get(path[:end])
            if found is not None:
                return found
        return None

    def where(self, path: Iterable[str | int] = ()) -> str:
        """``file:line:column`` for ``path`` (or its nearest ancestor), else just the file."""
        found = self.mark(path)
        return str(found) if found is not None else self.file


# --------------------------------------------------------------------------------------- public


def load_text(text: str, file: str = "<string>", *, format: str | None = None) -> Document:
    """Parse config ``text``; ``file`` is only used in marks and messages.

    ``format`` is ``"yaml"`` or ``"json"``; None guesses from ``file`` (``.json`` is JSON).
    Raises ConfigError, and nothing else, for any text.
    """
    if format is None:
        format = "json" if file.lower().endswith(".json") else "yaml"
    if format == "yaml":
        loader = _load_yaml
    elif format == "json":
        loader = _load_json
    else:
        raise ValueError(f"format must be 'yaml', 'json' or None, not {format!r}")
    try:
        return loader(text, file)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(f"{file}: nested too deeply to read") from None
    except Exception as e:  # pragma: no cover - safety net: the contract is "only ConfigError"
        raise ConfigError(f"{file}: cannot read {format.upper()}: {type(e).__name__}: {e}") from None


def load_file(path: str | os.PathLike) -> Document:
    """Read and parse a config file; any reading problem is a ConfigError naming the file."""
    file = os.fsdecode(path)
    return load_text(_read_text(file), file)


def resolve_extends(path: str | os.PathLike) -> list[Document]:
    """Load ``path`` and, recursively, the files its top-level ``extends:`` names.

    ``extends`` is a path (relative to the extending file's directory) or a list of paths.
    Returns the documents lowest precedence first (extended files before the extending one; in
    a list, later entries come later and so win), each without its ``extends`` key; the caller
    merges them, later winning. A file reached twice (a diamond) appears once, at its first
    position, which keeps every file before all files that extend it. Cycles are errors.
    """
    root = os.fsdecode(path)
    out: list[Document] = []
    _visit_extends(load_file(root), [], out, set())
    return out


# ------------------------------------------------------------------------------------- reading


def _read_text(file: str) -> str:
    """The file's text, or a ConfigError saying why it cannot be had.

    Only a regular file of at most :data:`MAX_CONFIG_BYTES` is read. It is opened with
    ``O_NONBLOCK`` (a FIFO would otherwise block the open until a writer appears) and checked with
    ``fstat`` on the open descriptor, so what is checked is what is read.
    """
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{file}: is a directory, not a config file") from None
    except PermissionError:
        if os.path.isdir(file):  # Windows reports directories this way
            raise ConfigError(f"{file}: is a directory, not a config file") from None
        raise ConfigError(f"{file}: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot read: {e.strerror or e}") from None
    except ValueError as e:  # e.g. an embedded NUL byte in the path
        raise ConfigError(f"{file}: cannot read: {e}") from None
    try:
        data = _read_regular(fd, file)
    except OSError as e:
        raise ConfigError(f"{file}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{file}: is UTF-16 text; config files must be UTF-8")
    if b"\x00" in data:
        raise ConfigError(f"{file}: is a binary file (it contains NUL bytes), not a YAML/JSON config")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        bad = data[e.start : e.start + 1].hex()
        raise ConfigError(
            f"{file}:{line}:{column}: not valid UTF-8 (byte 0x{bad} at offset {e.start}); "
            "config files must be UTF-8 text"
        ) from None


def _read_regular(fd: int, file: str) -> bytes:
    info = os.fstat(fd)
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{file}: is a directory, not a config file")
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "a special file")
        raise ConfigError(f"{file}: is {kind}, not a regular file; a config file must be a regular YAML/JSON file")
    too_big = (f"{file}: is {{size}} bytes; config files are limited to {MAX_CONFIG_BYTES} bytes (1 MiB): "
               "is this really a config file?")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(too_big.format(size=info.st_size))
    os.set_blocking(fd, True)
    chunks, total = [], 0
    while total <= MAX_CONFIG_BYTES:  # the file may grow while it is read
        chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > MAX_CONFIG_BYTES:
        raise ConfigError(too_big.format(size=f"more than {MAX_CONFIG_BYTES}"))
    return b"".join(chunks)


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML) :] if tag.startswith(_YAML) else tag


def _snippet(text: str, limit: int = 40) -> str:
    """``text`` for a message: repr'd and shortened, so a huge scalar cannot flood the terminal."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "mapping"
    if isinstance(node, SequenceNode):
        return "list"
    return "scalar"


# ---------------------------------------------------------------------------------------- YAML


def _line_column(text: str, position: int) -> tuple[int, int]:
    """1-based line and column of ``position``, counting line breaks the way pyyaml does."""
    line, start, i = 1, 0, 0
    while i < position:
        ch = text[i]
        if ch in _LINE_BREAKS:
            if ch == "\r" and i + 1 < len(text) and text[i + 1] == "\n":
                i += 1
            line, start = line + 1, i + 1
        i += 1
    return line, position - start + 1


def _compose(text: str, file: str) -> tuple[yaml.SafeLoader, Node | None]:
    """Compose the single YAML document in ``text`` into a node graph (None if there is none)."""
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as e:
        line, column = _line_column(text, e.position)
        char = f"U+{e.character:04X}" if isinstance(e.character, int) else repr(e.character)
        problem = f"malformed YAML: unacceptable character {char} ({e.reason})"
        raise ConfigError(f"{file}:{line}:{column}: {problem}") from None
    try:
        loader.get_event()  # STREAM-START
        root = None
        if not loader.check_event(yaml.StreamEndEvent):
            root = loader.compose_document()
            if not loader.check_event(yaml.StreamEndEvent):
                start = loader.peek_event().start_mark
                raise ConfigError(
                    f"{file}:{start.line + 1}:{start.column + 1}: a second YAML document starts here; "
                    "a config file must hold exactly one document"
                )
        return loader, root
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else file
        problem = e.problem or e.context or "cannot parse"
        message = f"{where}: malformed YAML: {problem}"
        if e.context and e.problem and e.context_mark is not None:
            message += f" ({e.context} at {file}:{e.context_mark.line + 1}:{e.context_mark.column + 1})"
        raise ConfigError(message) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: malformed YAML: {e}") from None
    finally:
        loader.dispose()


class _Builder:
    """Turns a composed YAML node graph into plain data, marks and raw scalar texts.

    Problems (duplicate keys, non-string keys, bad tags, unreadable scalars) are collected, not
    raised one at a time, so the user sees them all at once.
    """

    def __init__(self, file: str, loader: yaml.SafeLoader):
        self.file = file
        self.loader = loader
        self.marks: dict[Path, Mark] = {}
        self.raw: dict[Path, str] = {}
        self.problems: list[str] = []
        self._active: set[int] = set()  # ids of collection nodes being built (recursive aliases)
        self._seen: set[int] = set()
        self._revisits = 0

    def mark(self, node: Node) -> Mark:
        return Mark(self.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def where(self, node: Node) -> str:
        return str(self.mark(node))

    def value(self, node: Node, path: Path) -> Any:
        if id(node) in self._seen:
            self._revisits += 1
            if self._revisits > _MAX_ALIAS_EXPANSION:
                raise ConfigError(
                    f"{self.where(node)}: aliases expand to too many values "
                    f"(more than {_MAX_ALIAS_EXPANSION} repeated nodes)"
                )
        self._seen.add(id(node))
        if isinstance(node, ScalarNode):
            return self.scalar(node, path)
        if id(node) in self._active:
            self.problems.append(f"{self.where(node)}: an alias refers to a value that contains it (recursive data)")
            return None
        self._active.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                return self.sequence(node, path)
            return self.mapping(node, path)
        finally:
            self._active.discard(id(node))

    def scalar(self, node: ScalarNode, path: Path) -> Any:
        tag = node.tag
        if tag in _AS_TEXT:
            return node.value
        if tag not in _CONSTRUCTED:
            self.unsupported(node)
            return None
        try:
            value = self.loader.yaml_constructors[tag](self.loader, node)
        except Exception:
            self.problems.append(f"{self.where(node)}: cannot read {_snippet(node.value)} as {_short_tag(tag)}")
            return None
        if node.style is None and tag != _STR:
            self.raw[path] = node.value
        return value

    def sequence(self, node: SequenceNode, path: Path) -> list[Any] | None:
        if node.tag != _SEQ:
            self.unsupported(node)
            return None
        out = []
        for index, item in enumerate(node.value):
            item_path = (*path, index)
            self.marks[item_path] = self.mark(item)
            out.append(self.value(item, item_path))
        return out

    def mapping(self, node: MappingNode, path: Path) -> dict[str, Any] | None:
        if node.tag != _MAP:
            self.unsupported(node)
            return None
        winners: dict[str, tuple[Node, Node]] = {}
        for key, key_node, value_node in self.entries(node):
            winners[key] = (key_node, value_node)  # later wins, as in safe_load's merge handling
        out = {}
        for key, (key_node, value_node) in winners.items():
            entry_path = (*path, key)
            self.marks[entry_path] = self.mark(key_node)
            out[key] = self.value(value_node, entry_path)
        return out

    def entries(self, node: MappingNode) -> list[tuple[str, Node, Node]]:
        """(key, key node, value node) in pyyaml's order: merged entries first, later wins."""
        explicit: list[tuple[str, Node, Node]] = []
        merged: list[tuple[str, Node, Node]] = []
        first: dict[str, Node] = {}
        merge_key: Node | None = None
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode) and key_node.tag == _MERGE:
                if merge_key is not None:
                    self.problems.append(
                        f"duplicate merge key '<<' at {self.where(key_node)} "
                        f"(first at {self.where(merge_key)}); use `<<: [*a, *b]` to merge several"
                    )
                    continue
                merge_key = key_node
                merged = self.merge(key_node, value_node)
                continue
            key = self.key(key_node)
            if key is None:
                continue
            if key in first:
                self.problems.append(
                    f"duplicate key {key!r} at {self.where(key_node)} (first defined at {self.where(first[key])})"
                )
                continue
            first[key] = key_node
            explicit.append((key, key_node, value_node))
        return merged + explicit

    def merge(self, key_node: Node, value_node: Node) -> list[tuple[str, Node, Node]]:
        if isinstance(value_node, MappingNode):
            sources = [value_node]
        elif isinstance(value_node, SequenceNode):
            sources = value_node.value
        else:
            sources = [value_node]
        chunks = []
        for source in sources:
            if not isinstance(source, MappingNode) or source.tag != _MAP:
                self.problems.append(
                    f"{self.where(source)}: '<<' (merge key at {self.where(key_node)}) "
                    f"needs a mapping or a list of mappings, not a {_kind(source)}"
                )
                continue
            if id(source) in self._active:
                self.problems.append(f"{self.where(source)}: a merge key refers to a mapping that contains it")
                continue
            self._active.add(id(source))
            try:
                chunks.append(self.entries(source))
            finally:
                self._active.discard(id(source))
        # As in YAML/pyyaml: in `<<: [*a, *b]` the earlier mapping wins, so it goes last.
        return [entry for chunk in reversed(chunks) for entry in chunk]

    def key(self, node: Node) -> str | None:
        if not isinstance(node, ScalarNode):
            self.problems.append(f"key at {self.where(node)} must be a string, not a {_kind(node)}")
            return None
        if node.tag == _STR or node.tag in _AS_TEXT:
            return node.value
        if node.tag not in _CONSTRUCTED:
            self.unsupported(node)
            return None
        text = (node.value if len(node.value) <= 40 else _snippet(node.value)) or "(empty)"
        try:
            value = self.loader.yaml_constructors[node.tag](self.loader, node)
            reads_as = f"{_short_tag(node.tag)[2:]} {value!r}"
        except Exception:
            reads_as = _short_tag(node.tag)
        self.problems.append(
            f"key {text} at {self.where(node)} must be a string "
            f"(YAML reads it as {reads_as}; quote it to use it as a name)"
        )
        return None

    def unsupported(self, node: Node) -> None:
        self.problems.append(
            f"{self.where(node)}: unsupported tag {_short_tag(node.tag)} on a {_kind(node)} "
            "(config values are strings, numbers, booleans, null, lists and mappings)"
        )


def _load_yaml(text: str, file: str) -> Document:
    loader, root = _compose(text, file)
    if root is None or (isinstance(root, ScalarNode) and root.tag == _NULL and root.value == "" and root.style is None):
        start = root.start_mark if root is not None else None
        marks = {(): Mark(file, start.line + 1, start.column + 1) if start else Mark(file, 1, 1)}
        return Document({}, file, MappingProxyType(marks), MappingProxyType({}))
    builder = _Builder(file, loader)
    if not isinstance(root, MappingNode):
        raise ConfigError(
            f"{builder.where(root)}: the top level must be a mapping of keys to values, not a {_kind(root)}"
        )
    builder.marks[()] = builder.mark(root)
    data = builder.value(root, ())
    if builder.problems:
        raise ConfigError(list(dict.fromkeys(builder.problems)))
    return Document(data, file, MappingProxyType(builder.marks), MappingProxyType(builder.raw))


# ---------------------------------------------------------------------------------------- JSON


def _load_json(text: str, file: str) -> Document:
    duplicates: list[str] = []

    def pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                duplicates.append(key)
            out[key] = value
        return out

    if not text.strip(" \t\r\n"):
        return Document({}, file, MappingProxyType({(): Mark(file, 1, 1)}), MappingProxyType({}))
    try:
        data = json.loads(text, object_pairs_hook=pairs_to_dict)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{file}: nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer beyond Python's digit limit
        raise ConfigError(f"{file}: malformed JSON: {e}") from None
    marks, located = _json_marks(text, file)
    if duplicates:
        # Prefer the messages with lines (from the YAML composition); else name the keys only.
        raise ConfigError(located or [f"{file}: duplicate key {key!r}" for key in dict.fromkeys(duplicates)])
    if not isinstance(data, dict):
        kind = "list" if isinstance(data, list) else type(data).__name__
        raise ConfigError(f"{file}: the top level must be a JSON object (a mapping of keys to values), not a {kind}")
    return Document(data, file, MappingProxyType(marks), MappingProxyType({}))


def _json_marks(text: str, file: str) -> tuple[dict[Path, Mark], list[str]]:
    """Marks (and located duplicate-key messages) for valid JSON, via pyyaml's composer.

    JSON is nearly a YAML subset; when composition fails for some exotic input the marks are
    empty (``Document.where`` then names the file alone). Never raises.
    """
    marks: dict[Path, Mark] = {}
    duplicates: list[str] = []

    def mark(node: Node) -> Mark:
        return Mark(file, node.start_mark.line + 1, node.start_mark.column + 1)

    def walk(node: Node, path: Path) -> None:
        if isinstance(node, MappingNode):
            first: dict[str, Mark] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, ScalarNode):
                    continue
                key = key_node.value
                if key in first:
                    duplicates.append(f"duplicate key {key!r} at {mark(key_node)} (first defined at {first[key]})")
                    continue
                first[key] = marks[(*path, key)] = mark(key_node)
                walk(value_node, (*path, key))
        elif isinstance(node, SequenceNode):
            for index, item in enumerate(node.value):
                marks[(*path, index)] = mark(item)
                walk(item, (*path, index))

    try:
        # Tabs are JSON whitespace that YAML rejects; raw tabs cannot occur inside JSON strings,
        # and pyyaml counts a tab as one column, so a space in its place keeps every mark right.
        _, root = _compose(text.replace("\t", " "), file)
        if root is not None:
            marks[()] = mark(root)
            walk(root, ())
    except Exception:  # RecursionError included: marks are a convenience, never a failure
        return {}, []
    return marks, duplicates


# ------------------------------------------------------------------------------------- extends


def _extends_entries(doc: Document) -> list[tuple[str, Path]]:
    """The paths ``extends`` names, each with the data path of its mark."""
    if "extends" not in doc.data or doc.data["extends"] is None:
        return []
    value = doc.data["extends"]
    if isinstance(value, str):
        items: list[tuple[Any, Path]] = [(value, ("extends",))]
    elif isinstance(value, list):
        items = [(item, ("extends", i)) for i, item in enumerate(value)]
    else:
        raise ConfigError(
            f"{doc.where(('extends',))}: 'extends' must be a path or a list of paths, not {type(value).__name__}"
        )
    for item, path in items:
        if not isinstance(item, str) or not item:
            raise ConfigError(f"{doc.where(path)}: 'extends' entries must be non-empty paths, not {item!r}")
    return items


def _without_extends(doc: Document) -> Document:
    if "extends" not in doc.data:
        return doc
    return attrs.evolve(
        doc,
        data={k: v for k, v in doc.data.items() if k != "extends"},
        marks=MappingProxyType({p: m for p, m in doc.marks.items() if p[:1] != ("extends",)}),
        raw_scalars=MappingProxyType({p: r for p, r in doc.raw_scalars.items() if p[:1] != ("extends",)}),
    )


def _visit_extends(doc: Document, chain: list[tuple[str, str]], out: list[Document], emitted: set[str]) -> None:
    real = os.path.realpath(doc.file)
    chain = [*chain, (real, doc.file)]
    for entry, path in _extends_entries(doc):
        where = doc.where(path)
        target = os.path.normpath(os.path.join(os.path.dirname(doc.file), os.path.expanduser(entry)))
        target_real = os.path.realpath(target)
        reals = [r for r, _ in chain]
        if target_real in reals:
            names = [name for _, name in chain[reals.index(target_real) :]] + [target]
            raise ConfigError(f"{where}: 'extends' makes a cycle: {' -> '.join(names)}")
        if target_real in emitted:
            continue
        if not os.path.exists(target):
            raise ConfigError(f"{where}: extends {entry!r}, but {target} does not exist")
        try:
            extended = load_file(target)
        except ConfigError as e:
            raise ConfigError([f"{p} (extended by {where})" for p in e.problems]) from None
        _visit_extends(extended, chain, out, emitted)
    out.append(_without_extends(doc))
    emitted.add(real)
