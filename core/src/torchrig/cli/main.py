"""``torchrig`` console script: subcommands ``plugins``, ``env``, ``config``, ``launch``, ``test``,
``estimate-memory``, ``plan`` and ``new-plugin``,
plus the
commands installed distributions contribute through the ``torchrig.commands`` entry-point group
(:mod:`torchrig.cli.commands`; e.g. ``merge-weights`` from torchrig-fsdp).

Usage and plugin errors print one message and exit with code 2 — never a traceback.
"""

from __future__ import annotations

import sys

from torchrig.launch import held_signals

# First, before the imports below: a scheduler's SIGUSR1 that arrives while `torchrig launch` is
# still starting is held for the ranks instead of ending the launcher (torchrig.launch.held_signals).
# Only in the `torchrig` process itself: a program that imports the CLI keeps its own signals.
if held_signals.started_as_torchrig(sys.argv[0]):
    held_signals.hold()

import argparse  # noqa: E402
import os  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402

from torchrig._version import __version__  # noqa: E402
from torchrig.cli.commands import add_commands, discover_commands  # noqa: E402
from torchrig.errors import TorchrigError  # noqa: E402

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
#: Names a contributed command (``torchrig.commands`` entry point) cannot take.
BUILTIN_COMMANDS = ("plugins", "config", "launch", "test", "estimate-memory", "plan", "env", "new-plugin")


class _Parser(argparse.ArgumentParser):
    """argparse already exits 2 on usage errors; keep its message format for ours too."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torchrig",
        description="Write a PyTorch training loop once; run it on one CPU, many GPUs or many machines.",
    )
    parser.add_argument("--version", action="version", version=f"torchrig {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    plugins = sub.add_parser("plugins", help="list installed plugins: kind, name, distribution, version, status")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.add_argument("--kind", help="only this kind (strategy, precision, device, tracker, cluster)")
    plugins.set_defaults(handler=_run_plugins)

    # `config` parses its own arguments: its flags come from the installed plugins (see main()).
    sub.add_parser("config", help="write the machine's default config; `config show` / `config validate`")
    # `launch` too: its flags come from the plugins, and everything after the script is the script's.
    sub.add_parser("launch", help="run a script on N processes (torch elastic); `torchrig launch --help`")
    # `test` takes the launch flags.
    sub.add_parser("test", help="a short sanity training with the current configuration: plugins, collectives, "
                                "training, a checkpoint round trip; `torchrig test --help`")
    # `estimate-memory` takes the launch configuration flags too.
    sub.add_parser("estimate-memory", help="per-rank training memory of MODEL under the configured strategy, "
                                           "components summed; `torchrig estimate-memory --help`")
    # `plan` takes the launch configuration flags too.
    sub.add_parser("plan", help="check and predict a run at its target scale (8-1024 GPUs) from this CPU: layout "
                                "errors, memory per rank, communication per axis, step time; `torchrig plan --help`")

    env = sub.add_parser("env", help="versions, devices and settings to paste into a bug report")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.add_argument("--config_file", help="a run's config file to show as well (the machine's default files always are)")
    env.set_defaults(handler=_run_env)

    new = sub.add_parser("new-plugin", help="render a new plugin distribution (package, entry points, manifest, "
                                            "one hook, contract test) to start from",
                         description="Render a working torchrig plugin distribution into DIR "
                                     "(default ./torchrig-NAME): pip install -e DIR, then torchrig plugins lists it.")
    new.add_argument("name", metavar="NAME", help="the plugin's user-facing name (lower case, digits, underscores)")
    new.add_argument("kind", metavar="KIND", help="strategy, precision, device, tracker or cluster")
    new.add_argument("--dir", dest="directory", metavar="DIR", help="where to write it (must not exist, or be empty)")
    new.set_defaults(handler=_run_new_plugin)

    add_commands(sub, discover_commands(reserved=BUILTIN_COMMANDS))
    return parser


# Each subcommand's module is imported when that subcommand runs, not at the top: `torchrig --help`
# must stay fast and torch-free (tests/compat/test_accelerate_names.py), and a broken optional dependency of
# one subcommand must not break the others.
def _run_plugins(args: argparse.Namespace) -> int:
    from torchrig.cli.plugins import run_plugins

    return run_plugins(as_json=args.json, kind=args.kind)


def _run_env(args: argparse.Namespace) -> int:
    from torchrig.cli.env import run_env

    return run_env(as_json=args.json, config_file=args.config_file)


def _run_new_plugin(args: argparse.Namespace) -> int:
    from torchrig.cli.new_plugin import run_new_plugin

    return run_new_plugin(args.name, args.kind, args.directory)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] not in (["launch"], ["test"]):
        held_signals.release()  # nothing will be launched: SIGUSR1 does what it did before
    if argv[:1] == ["config"]:
        return _guarded("config", lambda: _run_config(argv[1:]))
    if argv[:1] == ["launch"]:
        return _guarded("launch", lambda: _run_launch(argv[1:]))
    if argv[:1] == ["test"]:
        return _guarded("test", lambda: _run_test(argv[1:]))
    if argv[:1] == ["estimate-memory"]:
        return _guarded("estimate-memory", lambda: _run_estimate(argv[1:]))
    if argv[:1] == ["plan"]:
        return _guarded("plan", lambda: _run_plan(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    return _guarded(args.command, lambda: args.handler(args))


def _run_config(argv: list[str]) -> int:
    from torchrig.cli.config import run_config

    return run_config(argv)


def _run_launch(argv: list[str]) -> int:
    from torchrig.launch.cli import main as launch_main

    return launch_main(argv)


def _run_test(argv: list[str]) -> int:
    from torchrig.cli.sanity import run_test

    return run_test(argv)


def _run_estimate(argv: list[str]) -> int:
    from torchrig.cli.estimate import run_estimate

    return run_estimate(argv)


def _run_plan(argv: list[str]) -> int:
    from torchrig.cli.plan import run_plan

    return run_plan(argv)


def _guarded(command: str, run: Callable[[], int]) -> int:
    """Run a command; configuration and plugin errors print one message and exit 2."""
    try:
        return int(run())
    except BrokenPipeError:  # `torchrig plugins | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (TorchrigError, ValueError) as exc:
        print(f"torchrig {command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C (in `torchrig config`'s questions): no traceback, nothing written
        print(f"\ntorchrig {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
