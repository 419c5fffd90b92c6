"""``torchrig config``: write the machine's default file, show and validate configuration.

    torchrig config                      questionnaire -> the machine's default config file
    torchrig config default [--mixed_precision P] [--force]
                                         write it without questions, from detected hardware
                                         (Accelerate's spelling; `--default` too); an existing
                                         file is kept unless --force
    torchrig config show [--config_file F] [flags]    every value with its source
    torchrig config validate F [flags]   exit 0 when valid, 2 with every problem otherwise
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from torchrig.config.default_file import detect_defaults, write_config_file
from torchrig.config.flags import add_config_flags, collect_flags, flag_values
from torchrig.config.readers import CONFIG_FILE_ENV
from torchrig.config.resolve import ResolvedConfig, Schema, default_config_path, resolve_config
from torchrig.errors import ConfigError
from torchrig.host.plugin_host import PluginHost, PluginStatus


def build_config_parser(schema: Schema) -> tuple[argparse.ArgumentParser, dict[str, Any], dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="torchrig config", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--default", action="store_true", help="write the default file from detected hardware, no "
                        "questions (the same as `torchrig config default`)")
    parser.add_argument("--config_file", help="where to write (default: the machine's default file)")
    parser.add_argument("--force", action="store_true", help="with --default: overwrite an existing file")
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    default = sub.add_parser("default", help="write the default file from detected hardware, no questions "
                             "(Accelerate's `accelerate config default`); an existing file is kept unless --force",
                             allow_abbrev=False)
    default.add_argument("--config_file", help="where to write (default: the machine's default file)")
    default.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default="no",
                         help="the mixed precision to write (default no)")
    default.add_argument("--force", action="store_true", help="overwrite an existing file")
    flags = collect_flags(schema)
    show = sub.add_parser("show", help="print every configuration value with its source", allow_abbrev=False)
    show.add_argument("--config_file", help=f"the run's config file (default: ${CONFIG_FILE_ENV})")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.add_argument("--only-set", action="store_true", help="only values that a source set")
    show_flags = add_config_flags(show, flags, "launch flags (highest precedence)")
    validate = sub.add_parser("validate", help="check a config file (and flags); exit 2 listing every problem",
                              allow_abbrev=False)
    validate.add_argument("file", help="the config file to check")
    validate_flags = add_config_flags(validate, flags, "launch flags (highest precedence)")
    return parser, show_flags, validate_flags


def run_config(argv: Sequence[str], *, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    host = PluginHost()
    parser, show_flags, validate_flags = build_config_parser(Schema(host))
    args = parser.parse_args(list(argv))
    if args.action == "show":
        config = resolve_config(host, config_file=args.config_file, flags=flag_values(args, show_flags), warn=False)
        _show(config, stdout, as_json=args.json, only_set=args.only_set)
        return 0
    if args.action == "validate":
        if not os.path.lexists(args.file):  # the loader names anything else (a directory, a FIFO, a device)
            raise ConfigError(f"{args.file}: no such file")
        config = resolve_config(host, config_file=args.file, flags=flag_values(args, validate_flags),
                                default_file=False, warn=False)
        print(f"{args.file}: valid (strategy {config['strategy']}, mixed_precision {config['mixed_precision']}, "
              f"{len(config.notes)} accepted key(s) with no effect)", file=stdout)
        for note in config.notes:
            print(f"  note: {note.key} ({note.source.detail}) has no effect: {note.reason}", file=stdout)
        return 0
    target = pathlib.Path(args.config_file) if args.config_file else default_config_path()
    if args.default or args.action == "default":
        if target.exists() and not args.force:
            raise ConfigError(f"{target} already exists and was left as it is; pass --force to overwrite it "
                              "(`torchrig config default --force`), or --config_file to write another file")
        answers = detect_defaults(host)
        answers["mixed_precision"] = getattr(args, "mixed_precision", None) or answers["mixed_precision"]
    else:
        answers = _questionnaire(host, stdin, stdout)
    write_config_file(host, answers, target)
    print(f"configuration written to {target}", file=stdout)
    return 0


def _show(config: ResolvedConfig, out: TextIO, *, as_json: bool, only_set: bool) -> None:
    rows = [(k, v, s) for k, v, s in config.explain() if not only_set or config.is_set(k)]
    if as_json:
        payload = {
            "values": {k: {"value": v, "source": str(s)} for k, v, s in rows},
            "notes": [{"key": n.key, "value": n.value, "reason": n.reason, "source": str(n.source)} for n in config.notes],
            "warnings": list(config.warnings),
        }
        print(json.dumps(payload, indent=2, default=str), file=out)
        return
    width = max((len(k) for k, _, _ in rows), default=3)
    vwidth = min(40, max((len(repr(v)) for _, v, _ in rows), default=5))
    print(f"{'KEY':<{width}}  {'VALUE':<{vwidth}}  SOURCE", file=out)
    for key, value, source in rows:
        print(f"{key:<{width}}  {_show_value(value):<{vwidth}}  {source}", file=out)
    for note in config.notes:
        print(f"note: {note.key} = {note.value!r} ({note.source}) has no effect: {note.reason}", file=out)
    for warning in config.warnings:
        print(f"warning: {warning}", file=out)


def _show_value(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


# -- writing the machine's default file --------------------------------------------------------


def _strategy_names(host: PluginHost) -> list[str]:
    return [i.name for i in host.plugins("strategy") if i.status in (PluginStatus.AVAILABLE, PluginStatus.SELECTED)]


def _ask(stdin: TextIO, stdout: TextIO, question: str, default: Any, convert: Callable[[str], Any]) -> Any:
    """Ask until the answer converts; an empty answer takes the default. EOF is an error."""
    shown = ("YES/no" if default else "yes/NO") if isinstance(default, bool) else default
    for _ in range(5):
        print(f"{question} [{shown}]: ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            raise ConfigError(f"no answer to {question!r} (end of input)")
        text = line.strip()
        if not text:
            return default
        try:
            return convert(text)
        except ValueError as exc:
            print(f"  invalid answer: {exc}", file=stdout)
    raise ConfigError(f"no valid answer to {question!r} after 5 tries")


def _choice(options: Sequence[str]) -> Callable[[str], str]:
    def convert(text: str) -> str:
        for option in options:
            if text.lower() == option.lower():
                return option
        raise ValueError(f"choose one of: {', '.join(options)}")

    return convert


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _yes_no(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("y", "yes", "true"):
        return True
    if lowered in ("n", "no", "false"):
        return False
    raise ValueError("answer yes or no")


def _questionnaire(host: PluginHost, stdin: TextIO, stdout: TextIO) -> dict[str, Any]:
    strategies = _strategy_names(host)
    precisions = [i.name for i in host.plugins("precision") if i.status is not PluginStatus.DISABLED]
    answers: dict[str, Any] = {}
    answers["strategy"] = _ask(stdin, stdout, f"Strategy ({'/'.join(strategies)})", "single", _choice(strategies))
    if answers["strategy"] != "single":
        answers["num_machines"] = _ask(stdin, stdout, "How many machines", 1, _positive_int)
        if answers["num_machines"] > 1:
            answers["machine_rank"] = _ask(stdin, stdout, "Rank of this machine", 0, int)
            answers["main_process_ip"] = _ask(stdin, stdout, "IP address of machine 0", "127.0.0.1", str)
            answers["main_process_port"] = _ask(stdin, stdout, "Port on machine 0", 29500, int)
        answers["num_processes"] = _ask(stdin, stdout, "How many processes in total", 2, _positive_int)
    answers["use_cpu"] = _ask(stdin, stdout, "Run on the CPU only", False, _yes_no)
    answers["mixed_precision"] = _ask(stdin, stdout, f"Mixed precision ({'/'.join(precisions)})", "no", _choice(precisions))
    answers["gradient_accumulation_steps"] = _ask(stdin, stdout, "Gradient accumulation steps", 1, _positive_int)
    return answers


__all__ = ["run_config"]
