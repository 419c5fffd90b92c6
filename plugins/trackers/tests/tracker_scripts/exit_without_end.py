"""Logs to jsonl and exits without ``end_training``: the core finishes the tracker at exit."""

import sys

from torchrig import Accelerator

accelerator = Accelerator(cpu=True, log_with="jsonl", project_dir=sys.argv[1])
accelerator.init_trackers("demo")
for step in range(3):
    accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
