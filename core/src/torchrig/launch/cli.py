"""``torchrig launch``: start a training script on N processes of this machine (and others).

    torchrig launch [flags] script.py [args...]
    torchrig launch [flags] -m package.module [args...]
    torchrig launch [flags] --no_python command [args...]
    python -m torchrig.launch ...        (the same)

Order of work, and why: parse the flags; resolve and validate the whole configuration (file,
environment, flags) — a problem is exit 2 with every problem listed and **nothing started**;
work out processes per machine and the rendezvous; pre-flight the ports; only then create the
log directory and call the ``torchrig_launch`` hook (default: torch elastic, see
:mod:`torchrig.launch.elastic`). ``--help`` imports no torch.

Exit codes: 0 success; 1 a worker (or the launch itself) failed; 2 a usage, configuration or
pre-flight problem (nothing was started); 128 + N when the launcher got signal N (130 for
SIGINT, 143 for SIGTERM), after forwarding it to the workers.

Logs: ``--log_dir`` (default ``./torchrig_logs/<YYYYmmdd-HHMMSS>-<id>``, printed at start) holds
``run_status.json``, ``rank-N.status.json`` and ``attempt-K/rank-N.{stdout,stderr}.log``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, TextIO

from torchrig.config.flags import FlagSpec, add_config_flags, collect_flags, flag_values
from torchrig.config.options import PARALLELISM_AXES, default_elastic_axis
from torchrig.config.parallelism import elastic_round_problems
from torchrig.config.parallelism import key_of as parallelism_key
from torchrig.config.readers import CONFIG_FILE_ENV, LAUNCH_OVERRIDES_ENV, encode_launch_overrides
from torchrig.config.resolve import (
    Layer,
    ResolvedConfig,
    Schema,
    default_config_path,
    machine_default_file,
    resolve_config,
)
from torchrig.errors import ConfigError, TorchrigError
from torchrig.estimate.plan_command import add_plan_arguments, given_plan_flags, listing, run_and_report
from torchrig.host.plugin_host import PluginHost
from torchrig.launch import held_signals
from torchrig.launch.accelerate_flags import (
    AppliedFlags,
    accelerate_entries,
    add_accelerate_flags,
    apply_accelerate_flags,
    normalize_spelling,
)
from torchrig.launch.defaults import launcher_host
from torchrig.launch.log_folders import DEFAULT_LOG_ROOT, prune_run_folders, where_logs_go
from torchrig.launch.worker import KILL_GRACE_S, STOP_GRACE_S
from torchrig.plugin.types import LaunchPlan

PROG = "torchrig launch"
EXIT_USAGE = 2
DEFAULT_MULTI_NODE_PORT = 29500
DESCRIPTION = """\
Start a training script on N processes of this machine (and of others, with --num_machines):
torch elastic workers with a c10d rendezvous, each wrapped so that its failure is recorded.

The configuration is resolved and validated before anything starts (config file, TORCHRIG_*
variables, these flags). Exit codes: 0 success; 1 a worker (or the launch) failed; 2 a usage,
configuration or pre-flight problem, nothing started; 130/143 after SIGINT/SIGTERM (forwarded
to the workers). Status and logs: --log_dir (default ./torchrig_logs/<run id>): run_status.json,
rank-N.status.json, attempt-K/rank-N.{stdout,stderr}.log."""
_BOOL_WORDS = {"true", "false", "yes", "no", "1", "0", "on", "off", "y", "n"}


class UsageError(TorchrigError):
    """Bad command line: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``torchrig launch: error: ...`` line, exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{PROG} --help`)")


def build_parser(host: PluginHost) -> tuple[argparse.ArgumentParser, dict[str, FlagSpec]]:
    parser = _Parser(
        prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} [flags] script.py [args...] | -m module [args...] | --no_python command [args...]",
        description=DESCRIPTION,
    )
    parser.add_argument("training_script", nargs="?", help="the script (or module with -m, command with --no_python)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    launcher = parser.add_argument_group("launcher")
    launcher.add_argument("--config_file", help=f"the run's config file (default: ${CONFIG_FILE_ENV}, then the "
                                                "machine's default file)")
    launcher.add_argument("-m", "--module", action="store_true", help="run a module, as `python -m module`")
    launcher.add_argument("--no_python", action="store_true", help="run a command, not a Python script")
    launcher.add_argument("--max_restarts", type=_non_negative_int, default=0,
                          help="restart every worker of this machine up to N times after a failure (default 0)")
    launcher.add_argument("--monitor_interval", type=_positive_float, default=0.1,
                          help="seconds between checks of the workers (default 0.1)")
    launcher.add_argument("--log_dir", help="status files and per-rank logs (default ./torchrig_logs/<run id>)")
    launcher.add_argument("-t", "--tee", type=int, choices=(0, 1, 2, 3), default=3,
                          help="streams copied to per-rank log files and shown with a [rankN]: prefix: "
                               "1 stdout, 2 stderr, 3 both (default), 0 none (unprefixed console output)")
    launcher.add_argument("--shutdown_grace", type=_positive_float, default=10.0, metavar="SECONDS",
                          help="after forwarding SIGINT/SIGTERM (or a failure), wait this long before SIGKILL "
                               "(default 10)")
    launcher.add_argument("--preflight_timeout", type=_non_negative_float, default=30.0, metavar="SECONDS",
                          help="how long a machine of rank > 0 waits for machine 0's rendezvous to accept "
                               "connections before giving up (default 30; 0: do not check)")
    launcher.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                          help="print the resolved configuration, plugins and each rank's environment; start nothing")
    launcher.add_argument("--plan-only", "--plan_only", dest="plan_only", action="store_true",
                          help="start nothing: plan this launch at its target size from this one CPU process, as "
                               "`torchrig plan script.py` does (the script runs up to its accelerator.prepare; "
                               "docs/plan.md); with the plan flags below")
    add_plan_arguments(parser.add_argument_group("plan (with --plan-only)"), defaults=False)
    flags = collect_flags(Schema(host))
    by_dest = add_config_flags(parser, flags, "configuration (highest precedence; handed to every worker)")
    add_accelerate_flags(parser)
    return parser, by_dest


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _finite_float(text: str) -> float:
    """A number of seconds: nan would pass every range check below, inf would wait forever."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def split_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launcher flags, [target, *its args])``: the first word that is not a flag or a flag's
    value starts the script's command line, which is passed on untouched.

    Done by hand because a boolean flag takes an *optional* value (``--cpu`` or ``--cpu false``)
    and argparse would swallow ``script.py`` as that value. A flag spelled with dashes
    (``--num-processes``, as Accelerate accepts) is read as its underscore spelling.
    """
    kinds: dict[str, str] = {}
    for action in parser._actions:
        for option in action.option_strings:
            if action.nargs == 0:
                kinds[option] = "none"
            elif action.nargs == "?":
                kinds[option] = "optional"
            else:
                kinds[option] = "one"
    flags: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return flags, list(argv[i + 1:])
        if not token.startswith("-") or token == "-":
            return flags, list(argv[i:])
        token = normalize_spelling(token, set(kinds))
        name, has_value, _ = token.partition("=")
        kind = kinds.get(name)
        if kind is None:
            from torchrig.config.schema import suggest

            raise UsageError(f"unrecognized flag {name}{suggest(name, list(kinds))} (see `{parser.prog} --help`)")
        flags.append(token)
        i += 1
        if has_value or kind == "none":
            continue
        takes_next = kind == "one" or (kind == "optional" and i < len(argv) and argv[i].lower() in _BOOL_WORDS)
        if takes_next and i < len(argv):
            flags.append(argv[i])
            i += 1
    return flags, []


def split_machine_range(tokens: Sequence[str]) -> list[str]:
    """``--num_machines MIN:MAX`` (what torchrun spells ``--nnodes MIN:MAX``) as ``--num_machines MAX
    --min_machines MIN``: an elastic world of MIN..MAX machines is two options of the configuration,
    so a file or the environment can set either one."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, value = token.partition("=")
        if name == "--num_machines" and (eq or i + 1 < len(tokens)):
            if not eq:
                value, i = tokens[i + 1], i + 1
            low, colon, high = value.partition(":")
            if colon:
                if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
                    raise UsageError(f"--num_machines {value}: MIN:MAX needs two whole numbers with "
                                     f"1 <= MIN <= MAX (e.g. --num_machines 1:2)")
                out += ["--num_machines", high, "--min_machines", low]
            else:
                out += ["--num_machines", value]
        else:
            out.append(token)
        i += 1
    return out


# ------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``torchrig launch`` and ``python -m torchrig.launch``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run_launch(argv)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before the workers started", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (TorchrigError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if held_signals.stop_requested() is not None:
            held_signals.release()  # nothing was launched (a dry run, an error): die of it, as without holding
        missed = held_signals.take()  # left when no worker was started (a dry run, an error)
        if missed:
            names = ", ".join(sorted({signal.Signals(signum).name for signum in missed}))
            print(f"{PROG}: {names} arrived before any worker started, and no worker was started",
                  file=sys.stderr)


def run_launch(argv: Sequence[str], *, stdout: TextIO | None = None, host: PluginHost | None = None) -> int:
    """``host``: the launcher's plugin host (default :func:`launcher_host`; tests pass one without a plugin)."""
    stdout = stdout or sys.stdout
    host = host or launcher_host()
    parser, by_dest = build_parser(host)
    flag_tokens, command = split_argv(parser, argv)
    args = parser.parse_args(split_machine_range(flag_tokens))
    if args.module and args.no_python:
        raise UsageError("-m/--module and --no_python exclude each other")
    target, target_args = (command[0], command[1:]) if command else (None, [])
    if target is None and not args.dry_run:
        raise UsageError("no script to launch: torchrig launch [flags] script.py [args...]")
    _check_plan_flags(args, target)
    flags = flag_values(args, by_dest)
    accelerate = apply_accelerate_flags(args, accelerate_entries(parser), flags, Schema(host))
    if args.plan_only:
        assert target is not None
        names = listing(args)
        if names is not None:
            stdout.write(names)
            return 0
        # machine 0's address means nothing to a plan (nothing connects), but a multi-machine run needs one
        flags.setdefault("main_process_ip", ("127.0.0.1", "torchrig launch --plan-only (no machine is contacted)"))
        config = resolve_config(host, config_file=args.config_file, flags=flags, default_file=True, warn=False)
        _check_target(target, module=args.module, no_python=False)
        return run_and_report(args, config, flags, model=target, script=[target, *target_args], module=args.module,
                              stdout=stdout)
    config = resolve_config(host, config_file=args.config_file, flags=flags, default_file=True, warn=False)
    _say_which_default_file()
    host.disable(config.get("disable_plugins") or [])
    layout = work_out_layout(config)
    if layout.strategy_world and layout.world_size > 1:  # the default strategy depends on the process count
        config = resolve_config(host, config_file=args.config_file, flags=flags, default_file=True, warn=False,
                                world_size=layout.world_size)
    warnings = list(layout.warnings) + _strategy_warnings(config, layout.world_size)
    if target is not None:
        _check_target(target, module=args.module, no_python=args.no_python)
    _select_plugins(host, config)
    log_dir = os.path.abspath(args.log_dir or os.path.join(DEFAULT_LOG_ROOT, _run_name()))
    mode = "exec" if args.no_python else ("module" if args.module else "script")
    signals = list(config.get("preemption.signals") or [])
    worker_command = [sys.executable, "-u", "-m", "torchrig.launch.worker", "--log_dir", log_dir, "--mode", mode,
                      "--launcher_pid", str(os.getpid()), *_stop_graces(args.shutdown_grace, "SIGTERM" in signals),
                      # recorded by each rank's wrapper from its first instruction (torchrig.resilience.preemption)
                      *(["--preemption_signals", ",".join(signals)] if signals else []),
                      "--", target or "<script>", *target_args]
    plan = LaunchPlan(
        command=worker_command, nproc_per_node=layout.nproc_per_node, num_nodes=layout.num_machines,
        min_nodes=layout.min_machines,
        node_rank=layout.machine_rank, rdzv_backend=layout.rdzv_backend, rdzv_endpoint=layout.rdzv_endpoint,
        run_id="torchrig", max_restarts=args.max_restarts, monitor_interval=args.monitor_interval, log_dir=log_dir,
        tee=args.tee, shutdown_grace_s=args.shutdown_grace, master_addr=layout.master_addr,
        script_command=_script_command(mode, target or "<script>", target_args), cluster=config.get("cluster"),
        config=config, rdzv_configs=dict(accelerate.rdzv_configs),
    )
    env = worker_environment(host, plan, config, flags, config_file=args.config_file)
    _apply_launcher_settings(accelerate, layout, env)
    import attrs

    plan = attrs.evolve(plan, env=env, warnings=tuple(warnings))
    if args.dry_run:
        from torchrig.launch.dryrun import print_dry_run

        print_dry_run(host, config, plan, layout, stdout)
        return 0
    warnings += preflight(layout, args.preflight_timeout)
    plan = attrs.evolve(plan, warnings=tuple(warnings))
    os.makedirs(log_dir, exist_ok=True)
    retention = None if args.log_dir else config.get("launch.log_retention")  # a --log_dir is never pruned
    print(f"{PROG}: {layout.describe()}; {where_logs_go(log_dir, retention)}", file=sys.stderr, flush=True)
    for warning in warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    _line_buffered()
    code = run_plan(host, plan)
    if retention is not None:
        prune_run_folders(os.path.dirname(log_dir), retention, current=log_dir, current_succeeded=code == 0)
    return code


def _check_plan_flags(args: argparse.Namespace, target: str | None) -> None:
    """``--plan-only`` needs a Python script or module and excludes the flags of a run it does not
    start; the plan's flags need ``--plan-only`` (never ignored)."""
    given = given_plan_flags(args)
    if not args.plan_only:
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise UsageError(f"{', '.join(given)} only {verb} with --plan-only (plan the launch instead of running it)")
        return
    if args.dry_run:
        raise UsageError("--plan-only and --dry-run exclude each other: --dry-run prints the launch's configuration "
                         "and environment, --plan-only plans the run at its target size")
    if args.no_python:
        raise UsageError("--plan-only plans a Python script or module (-m); a --no_python command cannot be run "
                         "up to its accelerator.prepare")
    if target is None:
        raise UsageError("--plan-only needs the script: torchrig launch --plan-only [flags] script.py [args...]")


def _say_which_default_file() -> None:
    """Reading Accelerate's default file (torchrig has none) is said once per launch, with how to keep it."""
    found = machine_default_file()
    if found is not None and found[1] is not None:
        print(f"{PROG}: note: reading Accelerate's default config {found[0]} as this machine's default file "
              f"(torchrig has none at {default_config_path()}; copy it there to keep it, or write one with "
              "`torchrig config`)", file=sys.stderr, flush=True)


def _apply_launcher_settings(accelerate: AppliedFlags, layout: Layout, env: dict[str, str]) -> None:
    """Accelerate's launcher flags: the threads of every rank, and a note for each flag that does nothing."""
    if accelerate.omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = str(accelerate.omp_num_threads)  # over the launcher's own, as Accelerate does
    if accelerate.rdzv_configs and layout.rdzv_backend == "local":
        accelerate.notes.append("--rdzv_conf has no effect: one machine with no --rdzv_backend runs no rendezvous "
                                "round; pass --rdzv_backend c10d to use one")
    for note in accelerate.notes:
        print(f"{PROG}: note: {note}", file=sys.stderr, flush=True)


def run_plan(host: PluginHost, plan: LaunchPlan) -> int:
    """Call the ``torchrig_launch`` hook; errors after this point are worker failures (exit 1),
    never usage errors. Writes ``run_status.json`` from the status files if the
    implementation did not (a third-party launcher running our wrapper)."""
    from torchrig.launch.status import RUN_STATUS_FILE

    stop = held_signals.stop_requested()
    if stop is not None:  # the job was being ended while the launcher started: start nothing
        return _stopped_before_start(plan, stop)
    try:
        code = host.hook.torchrig_launch(plan=plan)
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:
        print(f"{PROG}: the launch failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    code = 1 if code is None else int(code)
    if plan.log_dir and not os.path.exists(os.path.join(plan.log_dir, RUN_STATUS_FILE)):
        from torchrig.launch.summary import summarize_from_files

        summarize_from_files(plan, code)
    return code


def _stopped_before_start(plan: LaunchPlan, signum: int) -> int:
    """``run_status.json`` and the exit code of a launch stopped by a signal before any worker started."""
    from torchrig.launch import summary
    from torchrig.launch.status import RUN_STATUS_FILE, TERMINATED, write_json_atomic

    name, code = signal.Signals(signum).name, 128 + signum
    held_signals.take()
    verdict = summary.analyze([], launcher_signal=name, launch_error=f"stopped by {name} before any worker started")
    report = summary.run_status(run_id=os.path.basename(os.path.normpath(plan.log_dir)), state=TERMINATED,
                                exit_code=code, attempts=[{"attempt": 0, "verdict": verdict, "ranks": []}],
                                plan={"max_restarts": plan.max_restarts}, warnings=list(plan.warnings))
    write_json_atomic(os.path.join(plan.log_dir, RUN_STATUS_FILE), report)
    print(f"{PROG}: stopped by {name} before any worker started; status in {plan.log_dir}", file=sys.stderr,
          flush=True)
    return code


def _script_command(mode: str, target: str, args: Sequence[str]) -> list[str]:
    """The user's command without the per-rank wrapper, for a cluster's own launcher (srun, mpirun)."""
    if mode == "exec":
        return [target, *args]
    return [sys.executable, "-u", *(["-m"] if mode == "module" else []), target, *args]


def _stop_graces(shutdown_grace: float, checkpoint_on_sigterm: bool = False) -> list[str]:
    """The rank's own stop grace, then its supervisor's (which SIGKILLs the rank's whole tree),
    both within the launcher's ``--shutdown_grace``: a supervisor killed by the launcher first
    would leave the processes the rank started to live on. A rank that answers SIGTERM with a
    preemption checkpoint gets most of the launcher's grace for it."""
    stop = min(STOP_GRACE_S, 0.4 * shutdown_grace)
    kill = 0.9 * shutdown_grace if checkpoint_on_sigterm else min(KILL_GRACE_S, 0.7 * shutdown_grace)
    return ["--stop_grace", f"{stop:g}", "--kill_grace", f"{kill:g}"]


def _line_buffered() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
        except (AttributeError, ValueError):
            pass


def _run_name() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


# -- layout: how many processes where, and the rendezvous ------------------------------------------


class Layout:
    """Processes per machine and the rendezvous, from the resolved configuration."""

    def __init__(self, **values: Any) -> None:
        self.num_machines: int = values["num_machines"]
        self.machine_rank: int = values["machine_rank"]
        #: Elastic world size: the fewest machines the run goes on with (None: exactly num_machines).
        self.min_machines: int | None = values.get("min_machines")
        self.nproc_per_node: int = values["nproc_per_node"]
        self.world_size: int = self.nproc_per_node * self.num_machines
        self.rdzv_backend: str = values["rdzv_backend"]
        self.rdzv_endpoint: str = values["rdzv_endpoint"]
        self.master_addr: str | None = values["master_addr"]
        self.explicit_port: int = values["explicit_port"]
        self.processes_source: str = values["processes_source"]
        self.strategy_world: bool = values["strategy_world"]
        self.gpu_ids: str | None = values["gpu_ids"]
        self.warnings: list[str] = values.get("warnings", [])

    def describe(self) -> str:
        count = (f"{self.min_machines}..{self.num_machines}" if self.min_machines is not None
                 else str(self.num_machines))
        machines = (f"machine {self.machine_rank} of {count}, " if self.num_machines > 1 else "")
        return (f"{machines}{self.nproc_per_node} process(es) here, {self.world_size} in all, "
                f"rendezvous {self.rdzv_backend} at {self.rdzv_endpoint}")


def _visible_gpus(config: ResolvedConfig) -> int:
    if config.get("use_cpu"):
        return 0
    gpu_ids = config.get("gpu_ids")
    if gpu_ids and str(gpu_ids).lower() != "all":
        return len([g for g in str(gpu_ids).split(",") if g.strip()])
    if config.get("device") not in (None, "cuda"):
        return 0
    import torch  # only here: no --num_processes and GPUs may be present

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def work_out_layout(config: ResolvedConfig) -> Layout:
    """``num_processes`` (default: the visible GPUs per machine, 1 on CPU) split over the machines."""
    machines, machine_rank = int(config["num_machines"]), int(config["machine_rank"])
    total = config.get("num_processes")
    if total is None:
        per_node = max(1, _visible_gpus(config))
        total, source = per_node * machines, "default (visible GPUs per machine, 1 on CPU)"
    else:
        source = str(config.source("num_processes"))
    if total % machines:
        raise ConfigError(f"num_processes {total} ({source}) is not a multiple of num_machines {machines}: "
                          f"each machine runs num_processes / num_machines workers")
    # One machine and no rendezvous asked for: nothing to wait for, so no rendezvous round at all
    # ("local": torchrig.launch.rendezvous.SingleNodeRendezvous); otherwise c10d unless configured.
    local = machines == 1 and not config.get("rdzv_backend") and not config.get("rdzv_endpoint")
    backend = "local" if local else (config.get("rdzv_backend") or "c10d")
    ip = config.get("main_process_ip")
    port = config.get("main_process_port")
    if machines == 1:
        if not port and backend == "static":  # a static rendezvous needs its port up front
            port = _free_port()
        endpoint = config.get("rdzv_endpoint") or f"127.0.0.1:{port or 0}"
        master_addr = None
    else:
        port = DEFAULT_MULTI_NODE_PORT if port is None else port
        endpoint = config.get("rdzv_endpoint") or f"{ip}:{port}"
        master_addr = ip or endpoint.rpartition(":")[0]
    host_part, _, port_part = endpoint.rpartition(":")
    if not host_part or not port_part.isdigit():
        raise ConfigError(f"rdzv_endpoint {endpoint!r} must be HOST:PORT")
    if machines > 1 and int(port_part) == 0:
        raise ConfigError("main_process_port must be a fixed port when num_machines > 1 (every machine must know it)")
    min_machines = _elastic_minimum(config, machines, backend)
    if min_machines is not None and config.get("num_processes") is None:  # given: resolve_config checked the rounds
        _check_elastic_rounds(config, min_machines, machines, total // machines)
    return Layout(
        num_machines=machines, machine_rank=machine_rank, min_machines=min_machines, nproc_per_node=total // machines, rdzv_backend=backend,
        rdzv_endpoint=endpoint, master_addr=master_addr, explicit_port=int(port_part), processes_source=source,
        strategy_world=config.source("strategy").layer is Layer.DEFAULT, gpu_ids=config.get("gpu_ids"),
    )


def _elastic_minimum(config: ResolvedConfig, machines: int, backend: str) -> int | None:
    """``min_machines`` checked against ``num_machines`` and the rendezvous (only c10d re-forms a
    smaller world); None when the world is fixed."""
    low = config.get("min_machines")
    if low is None or low == machines:
        return None
    if low > machines:
        raise ConfigError(f"min_machines {low} is above num_machines {machines}: give --num_machines MIN:MAX "
                          f"with MIN <= MAX")
    if backend != "c10d":
        raise ConfigError(f"min_machines {low} (an elastic world of {low}..{machines} machines) needs the c10d "
                          f"rendezvous, not rdzv_backend {backend!r}: drop rdzv_backend or set it to c10d")
    return int(low)


def _check_elastic_rounds(config: ResolvedConfig, low: int, high: int, per_machine: int) -> None:
    """Every round of ``low``..``high`` machines must hold ``parallelism_config``'s fixed axes
    (:func:`torchrig.config.parallelism.elastic_round_problems`), checked here when the processes
    per machine were defaulted (the configuration alone did not know them)."""
    sizes = {axis: config.get(parallelism_key(axis)) for axis in PARALLELISM_AXES}
    if all(size == 1 for size in sizes.values()):
        return
    axis = default_elastic_axis(config.get("parallelism_config.elastic_axis"), sizes["dp_replicate"])
    found = elastic_round_problems(sizes, axis, ep_size=config.get(parallelism_key("ep")) or 1,
                                   min_machines=low, max_machines=high, processes_per_machine=per_machine)
    if found:
        raise ConfigError([f"{parallelism_key(culprit)}: {message}" for culprit, message in found])


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _strategy_warnings(config: ResolvedConfig, world_size: int) -> list[str]:
    if world_size > 1 and config.get("strategy") == "single":
        return [(f"strategy 'single' ({config.source('strategy')}) with {world_size} processes: an Accelerator "
                 "script will refuse to run (each rank would train its own model); pass --strategy ddp")]
    return []


def preflight(layout: Layout, timeout: float) -> list[str]:
    """Port and address checks before anything starts; raises :class:`PreflightError`."""
    from torchrig.launch.preflight import check_port_free, is_local_address, wait_reachable

    warnings: list[str] = []
    host, _, port_text = layout.rdzv_endpoint.rpartition(":")
    port = int(port_text)
    if layout.rdzv_backend not in ("c10d", "static", "local"):
        return warnings
    if layout.num_machines == 1 or layout.machine_rank == 0:
        what = "main_process_port" if layout.num_machines == 1 else "the rendezvous this machine (machine_rank 0) hosts"
        check_port_free(port, what)
        if layout.num_machines > 1 and layout.master_addr and not is_local_address(layout.master_addr):
            warnings.append(f"main_process_ip {layout.master_addr} is not an address of this machine, which has "
                            "machine_rank 0 and hosts the rendezvous; the other machines may not reach it")
    elif timeout > 0:
        wait_reachable(host, port, timeout)
    return warnings


def _check_target(target: str, *, module: bool, no_python: bool) -> None:
    if no_python:
        if not (shutil.which(target) or (os.sep in target and os.access(target, os.X_OK))):
            raise UsageError(f"--no_python: command not found: {target}")
    elif module:
        added = os.getcwd() not in sys.path
        if added:
            sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            if added:
                sys.path.remove(os.getcwd())
        if not found:
            raise UsageError(f"-m: no module named {target!r}")
    elif not os.path.isfile(target):
        raise UsageError(f"no such script: {target}")


def _select_plugins(host: PluginHost, config: ResolvedConfig) -> None:
    """Register the plugins the configuration selects, so their launch-time hooks
    (``torchrig_worker_environment``, a cluster plugin's ``torchrig_launch``) take part."""
    from torchrig.host.runtime import select_plugins
    from torchrig.plugin.kinds import PluginKind

    host.select_auto(PluginKind.CLUSTER, only=config.get("cluster") or None)
    select_plugins(host, config)


def worker_environment(host: PluginHost, plan: LaunchPlan, config: ResolvedConfig,
                       flags: Mapping[str, tuple[Any, str]], *, config_file: str | None) -> dict[str, str]:
    """What every worker gets on top of the launcher's environment: the plugins'
    ``torchrig_worker_environment`` (later plugins win; the user's own environment wins over all),
    then what the launcher must hand over: the flag layer, the config file, the GPUs."""
    merged: dict[str, str] = {}
    for part in reversed(host.hook.torchrig_worker_environment(plan=plan) or []):
        merged.update({str(k): str(v) for k, v in (part or {}).items()})
    env = {k: v for k, v in merged.items() if k not in os.environ}
    env[LAUNCH_OVERRIDES_ENV] = encode_launch_overrides(flags)
    if config_file:
        env[CONFIG_FILE_ENV] = os.path.abspath(config_file)
    gpu_ids = config.get("gpu_ids")
    if gpu_ids and str(gpu_ids).lower() != "all" and not config.get("use_cpu"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids).replace(" ", "")
    return env


__all__ = ["PROG", "Layout", "build_parser", "main", "preflight", "run_launch", "split_argv", "work_out_layout",
           "worker_environment"]
