"""``torchrig`` console script: subcommands ``plugins`` and ``env``.

Usage and plugin errors print one message and exit with code 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torchrig._version import __version__
from torchrig.errors import TorchrigError

EXIT_USAGE = 2


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

    env = sub.add_parser("env", help="versions, devices and settings to paste into a bug report")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(handler=_run_env)
    return parser


def _run_plugins(args: argparse.Namespace) -> int:
    from torchrig.cli.plugins import run_plugins

    return run_plugins(as_json=args.json, kind=args.kind)


def _run_env(args: argparse.Namespace) -> int:
    from torchrig.cli.env import run_env

    return run_env(as_json=args.json)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    try:
        return int(args.handler(args))
    except (TorchrigError, ValueError) as exc:
        print(f"torchrig {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
