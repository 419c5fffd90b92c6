"""``torchrig launch --dry-run``: what would run, decided the same way as a real launch, with
nothing started — the resolved configuration with the source of every value (the table of
``torchrig config show``), the selected plugins and which plugins implement each phase, and the
environment each rank of this machine would get.

What it cannot show: the step-plan slot owners (``backward``, ``optimizer_step``...) are decided
by ``prepare()`` inside each worker from the model and device, so they are not listed; the master
port is picked at each rendezvous round. Where a cluster plugin would hand the launch to its own
launcher (``torchrig_describe_launch``: the ``sbatch`` script, the ``srun``/``mpirun`` line), that
is printed instead of the ranks' environments.
"""

from __future__ import annotations

import os
import shlex
from typing import Any, TextIO

from torchrig.config.resolve import ResolvedConfig
from torchrig.defaults import training as training_defaults
from torchrig.host.plugin_host import PluginHost
from torchrig.plugin.types import LaunchPlan

#: (phase, hook) in the order a run meets them.
PHASES = (
    ("launch", "torchrig_launch"),
    ("worker environment", "torchrig_worker_environment"),
    ("detect cluster", "torchrig_detect_cluster"),
    ("select device", "torchrig_select_device"),
    ("init process group", "torchrig_init_process_group"),
    ("collectives", "torchrig_collectives"),
    ("strategy capabilities", "torchrig_strategy_capabilities"),
    ("convert model", "torchrig_convert_model"),
    ("prepare model", "torchrig_prepare_model"),
    ("prepare dataloader", "torchrig_prepare_dataloader"),
    ("prepare scheduler", "torchrig_prepare_scheduler"),
    ("precision step plan", "torchrig_precision_step_plan"),
    ("strategy step plan", "torchrig_strategy_step_plan"),
    ("save strategy state", "torchrig_save_strategy_state"),
    ("load strategy state", "torchrig_load_strategy_state"),
    ("full state dict", "torchrig_full_state_dict"),
)
_KINDS = ("strategy", "precision", "device", "cluster", "tracker")


def _owners(host: PluginHost, hook: str) -> list[str]:
    return [name.removesuffix("#manifest") for name, _ in host.iter_impls(hook)]


def rank_environment(plan: LaunchPlan, local_rank: int) -> dict[str, str]:
    """The variables that decide where a rank sits, as elastic and the launcher will set them."""
    rank = plan.node_rank * plan.nproc_per_node + local_rank
    host, _, port = plan.rdzv_endpoint.rpartition(":")
    # A fixed master port: static rendezvous, or one machine with main_process_port given.
    static = plan.rdzv_backend == "static" or (plan.rdzv_backend == "local" and port not in ("", "0"))
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(plan.nproc_per_node * plan.num_nodes),
        "LOCAL_WORLD_SIZE": str(plan.nproc_per_node),
        "GROUP_RANK": str(plan.node_rank),
        "MASTER_ADDR": host if static else (plan.master_addr or "127.0.0.1"),
        "MASTER_PORT": port if static else "<a free port, assigned at each rendezvous round>",
        "TORCHELASTIC_ERROR_FILE": os.path.join(plan.log_dir or "<log_dir>", "attempt-<K>", f"rank-{rank}.error.json"),
    }
    merged = {**os.environ, **plan.env}
    for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        env[name] = merged.get(name, "<unset>")
    for name in sorted(merged):
        if name.startswith("TORCHRIG_"):
            env[name] = merged[name]
    for name, value in sorted(plan.env.items()):
        env.setdefault(name, value)
    return env


def print_config_table(config: ResolvedConfig, out: TextIO) -> None:
    """``torchrig config show``'s table, limited to the top-level keys and the values set."""
    rows = [(k, v, src) for k, v, src in config.explain() if "." not in k or config.is_set(k)]
    width = max((len(k) for k, _, _ in rows), default=3)
    vwidth = min(40, max((len(repr(v)) for _, v, _ in rows), default=5))
    print(f"  {'KEY':<{width}}  {'VALUE':<{vwidth}}  SOURCE", file=out)
    for key, value, source in rows:
        shown = value if isinstance(value, str) else repr(value)
        print(f"  {key:<{width}}  {shown:<{vwidth}}  {source}", file=out)
    for note in config.notes:
        print(f"  note: {note.key} = {note.value!r} ({note.source}) has no effect: {note.reason}", file=out)
    for warning in config.warnings:
        print(f"  warning: {warning}", file=out)


def print_dry_run(host: PluginHost, config: ResolvedConfig, plan: LaunchPlan, layout: Any, out: TextIO) -> None:
    print("torchrig launch --dry-run: nothing is started\n", file=out)
    print("Configuration (top-level keys and every value a source set; `torchrig config show` lists all):",
          file=out)
    print_config_table(config, out)
    print("\nPlugins selected:", file=out)
    for kind in _KINDS:
        names = [info.name for info in host.selected(kind)]
        print(f"  {kind:<10} {', '.join(names) or '-'}", file=out)
    print("\nPhases (implementations in call order; a first-answer phase is owned by the first that answers):",
          file=out)
    training_defaults.register(host)  # what every worker's Accelerator registers
    for label, hook in PHASES:
        print(f"  {label:<22} {', '.join(_owners(host, hook)) or '-'}", file=out)
    print("  step-plan slots         decided by prepare() in each worker (needs the model and device): not shown",
          file=out)
    print("\nLaunch:", file=out)
    print(f"  command         {shlex.join(plan.command)}", file=out)
    print(f"  processes       {layout.world_size} ({layout.processes_source}); {plan.nproc_per_node} on this machine",
          file=out)
    print(f"  machines        {plan.num_nodes} (this one: machine_rank {plan.node_rank})", file=out)
    print(f"  rendezvous      {plan.rdzv_backend} at {plan.rdzv_endpoint}"
          + (" (a free port)" if plan.rdzv_endpoint.endswith(":0") else ""), file=out)
    print(f"  max restarts    {plan.max_restarts}", file=out)
    print(f"  log dir         {plan.log_dir} (created at launch)", file=out)
    for warning in plan.warnings:
        print(f"  warning: {warning}", file=out)
    handoffs = [text for text in host.hook.torchrig_describe_launch(plan=plan) or [] if text]
    if handoffs:  # a cluster plugin starts the ranks: elastic's per-rank environment does not apply
        print("\nHand-off (a cluster plugin's launcher starts the ranks, not torch elastic):", file=out)
        for text in handoffs:  # verbatim: a script or a quoted line must read back exactly (no indent added)
            print(text, file=out)
        return
    print("\nEnvironment of each rank on this machine (on top of the launcher's):", file=out)
    for local_rank in range(plan.nproc_per_node):
        env = rank_environment(plan, local_rank)
        print(f"  rank {env['RANK']} (local rank {local_rank}):", file=out)
        for name, value in env.items():
            print(f"    {name}={value}", file=out)


__all__ = ["PHASES", "print_config_table", "print_dry_run", "rank_environment"]
