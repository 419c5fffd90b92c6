"""Subcommands contributed by installed distributions: the ``torchrig.commands`` entry-point group.

A distribution declares ``name = "package.module:OBJECT"`` in that group; ``OBJECT`` has

* ``help`` — one line for ``torchrig --help``;
* ``add_arguments(parser)`` — adds its arguments to its ``argparse`` subparser;
* ``run(args) -> int`` — does the work and returns the exit code.

The module the entry point names is imported to build ``torchrig --help``, so it must not import
torch (import it inside ``run``). A command cannot replace a built-in one; two distributions
declaring one name, or a command that fails to import, are reported when the command is used,
naming the distributions and the cause — they never break the other commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

import attrs

from torchrig.errors import TorchrigError
from torchrig.host.discovery import installed_distributions, load_reference

GROUP = "torchrig.commands"


@attrs.frozen
class PluginCommand:
    name: str
    #: ``distribution version`` of each declaring distribution (more than one: a conflict).
    sources: tuple[str, ...]
    reference: str
    command: Any = None
    #: Why the command cannot run (conflict, import failure, missing methods), or None.
    problem: str | None = None

    @property
    def help(self) -> str:
        if self.problem:
            return f"(unavailable: {self.problem})"
        return f"{getattr(self.command, 'help', '')} [{self.sources[0]}]".strip()


def discover_commands(reserved: Iterable[str] = (), distributions: Iterable[Any] | None = None) -> list[PluginCommand]:
    """Every contributed command, by name; ``reserved`` names (built-in commands) are skipped."""
    declared: dict[str, list[tuple[str, str]]] = {}
    for dist in installed_distributions() if distributions is None else distributions:
        for ep in dist.entry_points:
            if ep.group == GROUP and ep.name not in reserved:
                declared.setdefault(ep.name, []).append((f"{dist.metadata['Name']} {dist.version}", ep.value))
    commands = []
    for name, entries in sorted(declared.items()):
        sources = tuple(source for source, _ in entries)
        reference = entries[0][1]
        if len(entries) > 1:
            problem = (f"declared by {' and '.join(sources)}; uninstall one of them "
                       f"(pip uninstall {entries[1][0].split()[0]})")
            commands.append(PluginCommand(name, sources, reference, problem=problem))
            continue
        try:
            command = load_reference(reference)
        except Exception as exc:  # a broken plugin must not break `torchrig --help`
            commands.append(PluginCommand(name, sources, reference,
                                          problem=f"{reference} failed to import ({type(exc).__name__}: {exc}); "
                                                  f"reinstall {sources[0].split()[0]}"))
            continue
        missing = [attr for attr in ("add_arguments", "run") if not callable(getattr(command, attr, None))]
        problem = f"{reference} lacks {' and '.join(missing)}()" if missing else None
        commands.append(PluginCommand(name, sources, reference, command, problem))
    return commands


def add_commands(sub: Any, commands: Iterable[PluginCommand]) -> None:
    """Add each command as a subparser of ``torchrig``."""
    for item in commands:
        parser = sub.add_parser(item.name, help=item.help)
        if item.problem is None:
            item.command.add_arguments(parser)
        else:
            parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(handler=_handler(item))


def _handler(item: PluginCommand) -> Any:
    def handle(args: argparse.Namespace) -> int:
        if item.problem is not None:
            raise TorchrigError(f"command {item.name!r} is unavailable: {item.problem}")
        return int(item.command.run(args) or 0)

    return handle


__all__ = ["GROUP", "PluginCommand", "add_commands", "discover_commands"]
