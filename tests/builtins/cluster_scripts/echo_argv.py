"""A rank that reports what it received, for the hand-off payload tests (tests/launch/test_handoff_payloads.py,
tests/builtins/test_slurm.py): ``echo_argv.py OUT_DIR [ARGS...]`` writes ``OUT_DIR/rank-<rank>.json`` with its
``sys.argv``, working directory and the variables torchrig launch hands its workers. No torch, no
torchrig: it must start in milliseconds under srun and mpirun."""

from __future__ import annotations

import json
import os
import sys

RANK_VARIABLES = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK")
REPORTED_VARIABLES = ("TORCHRIG_CONFIG_FILE", "TORCHRIG_LAUNCH_OVERRIDES", "SLURM_JOB_NAME", "MASTER_ADDR")


def main() -> None:
    out_dir = sys.argv[1]
    rank = next((os.environ[name] for name in RANK_VARIABLES if name in os.environ), "0")
    seen = {"argv": sys.argv, "cwd": os.getcwd(), "environ": {name: os.environ.get(name) for name in REPORTED_VARIABLES}}
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as handle:
        json.dump(seen, handle)


if __name__ == "__main__":
    main()
