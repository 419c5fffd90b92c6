"""Parsing for :mod:`torchrig.config.loader`: YAML through pyyaml's composer into plain data
with marks, rejecting what ``safe_load`` lets through (see the loader's docstring), and JSON
(marks from the same composer).

Imported only when a config file is read: pyyaml compiles its scanner's and resolver's
regular expressions on import, a start-up cost a run that reads no file should not pay.
"""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from torchrig.config.document import Document, Mark, Path
from torchrig.errors import ConfigError

__all__ = ["load_json", "load_yaml"]

_YAML = "tag:yaml.org,2002:"
_NULL, _BOOL, _INT, _FLOAT, _STR = (_YAML + t for t in ("null", "bool", "int", "float", "str"))
_TIMESTAMP, _VALUE, _MERGE = _YAML + "timestamp", _YAML + "value", _YAML + "merge"
_SEQ, _MAP = _YAML + "seq", _YAML + "map"
_CONSTRUCTED = (_NULL, _BOOL, _INT, _FLOAT, _STR)
# Read as their source text: configs hold plain data, and safe_load would give a date or fail.
_AS_TEXT = (_TIMESTAMP, _VALUE, _MERGE)

# How many nodes alias expansion may visit beyond the document's own nodes ("billion laughs").
_MAX_ALIAS_EXPANSION = 100_000
_LINE_BREAKS = "\r\n\x85\u2028\u2029"


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


def load_yaml(text: str, file: str) -> Document:
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



def load_json(text: str, file: str) -> Document:
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
