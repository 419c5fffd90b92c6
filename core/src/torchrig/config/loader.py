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

This module never imports torch (the CLI reads configs before torch is imported), nor pyyaml:
the parsing (on pyyaml's composer) lives in :mod:`torchrig.config.parsing`, imported when a file is
first read, so a run that reads no config file does not pay pyyaml's import (~10 ms).
"""

from __future__ import annotations

import os
import stat
from types import MappingProxyType
from typing import Any

import attrs

from torchrig.config.document import Document, Mark, Path
from torchrig.errors import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "Document", "Mark", "load_file", "load_text", "resolve_extends"]

#: Largest config file read (1 MiB): a config is a page of settings, and a bigger "file" is a
#: mistake (``/dev/zero``, a log, a checkpoint) that must not be read into memory.
MAX_CONFIG_BYTES = 1 << 20
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


# --------------------------------------------------------------------------------------- public


def load_text(text: str, file: str = "<string>", *, format: str | None = None) -> Document:
    """Parse config ``text``; ``file`` is only used in marks and messages.

    ``format`` is ``"yaml"`` or ``"json"``; None guesses from ``file`` (``.json`` is JSON).
    Raises ConfigError, and nothing else, for any text.
    """
    if format is None:
        format = "json" if file.lower().endswith(".json") else "yaml"
    # Deliberately deferred for start-up cost: pyyaml is imported only when text is parsed.
    from torchrig.config import parsing

    if format == "yaml":
        loader = parsing.load_yaml
    elif format == "json":
        loader = parsing.load_json
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
