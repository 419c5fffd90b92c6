"""Start the processes a training script starts — a subprocess, a multiprocessing child and a
daemon that left the session (setsid, double fork) — write their pids to
``<out>/children-<RANK>``, announce, then ``sleep`` (wait forever), ``exit`` (return at once,
leaving them behind) or ``fail`` (rank 1 exits with code 3, the others sleep). No torch."""

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from _ready import announce

DAEMON = """
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))
os.rename(sys.argv[1] + '.tmp', sys.argv[1])
time.sleep(600)
"""


def _sleep() -> None:
    time.sleep(600)


if __name__ == "__main__":
    out, how = Path(sys.argv[1]), sys.argv[2]
    rank = os.environ.get("RANK", "0")
    sleeper = subprocess.Popen(["sleep", "600"])
    child = multiprocessing.get_context("fork").Process(target=_sleep, daemon=False)
    child.start()
    daemon_file = out / f"daemon-{rank}"
    subprocess.run([sys.executable, "-c", DAEMON, str(daemon_file)], check=True)
    while not daemon_file.exists():
        time.sleep(0.01)
    pids = [sleeper.pid, child.pid, int(daemon_file.read_text())]
    (out / f"children-{rank}.tmp").write_text(" ".join(map(str, pids)))
    os.rename(out / f"children-{rank}.tmp", out / f"children-{rank}")
    announce()
    if how == "exit":
        os._exit(0)  # no multiprocessing join at exit: the children are left behind
    if how == "fail" and rank == "1":
        os._exit(3)  # rank 1 fails; the launcher tears rank 0 down
    time.sleep(600)
