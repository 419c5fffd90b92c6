"""Rank 1 raises once rank 0 is running; rank 0 sleeps until it is torn down. No torch."""

import os
import time

from _ready import announce

out = announce()


def train_step():
    raise ValueError("boom: bad batch on rank 1")


if os.environ["RANK"] == "1":
    while not (out / "ready-0").exists():
        time.sleep(0.05)
    train_step()
time.sleep(600)
