"""A notebook whose training function misbehaves: it starts processes of its own, raises, hangs,
leaves early, or the user presses Ctrl-C while it runs.

argv: OUT MODE PORT. Each rank writes ``pid-<rank>`` and (but in ``tempdir``) ``children-<rank>`` (the pids of a
``sleep`` subprocess, a multiprocessing child and a daemon that left the session with ``setsid``
and a double fork), then ``ready-<rank>``, then does what MODE says:

* ``return`` — every rank returns its rank;
* ``raise`` — rank 1 raises, rank 0 sleeps (it must be torn down); ``raise_past_sigterm``: rank 0
  also ignores SIGTERM;
* ``sleep`` — every rank sleeps (the test interrupts the notebook with SIGINT, or kills it);
  ``sleep_past_stop_signals``: the ranks also ignore SIGINT and SIGTERM (the user presses Ctrl-C again
  and again while the teardown waits);
* ``sys_exit0`` / ``os_exit0`` / ``sys_exit3`` — rank 1 leaves through ``sys.exit(0)`` / ``os._exit(0)`` /
  ``sys.exit(3)``, rank 0 sleeps;
* ``hang`` — both ranks join a process group with a 3 s collective timeout; rank 1 then hangs
  outside any collective while rank 0 waits in an all-reduce until it times out;
* ``tempdir`` — every rank waits until a thread of the notebook has made a temporary directory of
  its own (``mkdtemp``), then returns.

After ``notebook_launcher`` returns or raises, the notebook writes ``result.json`` at once:
what it raised, which of the pids above are still alive, whether its SIGINT handler is Python's
again, and whether the other thread's temporary directory still exists.
"""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from torchrig.launchers import notebook_launcher
from torchrig.testing.processes import leftover_processes

DAEMON = """
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))
os.rename(sys.argv[1] + '.tmp', sys.argv[1])
time.sleep(600)
"""


def _write(path: Path, text: str) -> None:
    path.with_suffix(".tmp").write_text(text)
    os.rename(path.with_suffix(".tmp"), path)


def _sleep() -> None:
    time.sleep(600)


def _start_children(out: Path, rank: int) -> None:
    sleeper = subprocess.Popen(["sleep", "600"])
    child = multiprocessing.get_context("fork").Process(target=_sleep, daemon=False)
    child.start()
    daemon_file = out / f"daemon-{rank}"
    subprocess.run([sys.executable, "-c", DAEMON, str(daemon_file)], check=True)
    while not daemon_file.exists():
        time.sleep(0.01)
    _write(out / f"children-{rank}", f"{sleeper.pid} {child.pid} {daemon_file.read_text()}")


def train(out_dir: str, mode: str) -> int:
    out, rank = Path(out_dir), int(os.environ["RANK"])
    _write(out / f"pid-{rank}", str(os.getpid()))
    if mode != "tempdir":  # that one is about files alone
        _start_children(out, rank)
    if mode == "hang":
        import torch
        import torch.distributed as dist
        from torchrig import Accelerator
        from torchrig.utils import InitProcessGroupKwargs

        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=3))])
        _write(out / f"ready-{rank}", "1")
        if rank == 1:
            time.sleep(600)
        dist.all_reduce(torch.ones(1))
        return rank
    _write(out / f"ready-{rank}", "1")
    if mode == "tempdir":
        while not (out / "other-thread-dir").exists():
            time.sleep(0.01)
        return rank
    if mode == "sleep_past_stop_signals":  # ranks that stop neither on Ctrl-C nor on SIGTERM
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0 and mode == "raise_past_sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank that does not stop when asked
    if rank == 1 and mode in ("raise", "raise_past_sigterm"):
        raise RuntimeError("boom on rank 1")
    if rank == 1 and mode == "sys_exit0":
        sys.exit(0)
    if rank == 1 and mode == "sys_exit3":
        sys.exit(3)
    if rank == 1 and mode == "os_exit0":
        os._exit(0)
    if mode != "return":
        try:
            time.sleep(600)
        except KeyboardInterrupt:  # what the function sees of a Ctrl-C
            _write(out / f"interrupted-{rank}", "KeyboardInterrupt")
            raise
    return rank


def _other_thread_makes_a_tempdir(out: Path, made: list) -> None:
    """Another thread of the notebook process: while the ranks run, it makes a temporary directory."""
    while not all((out / f"ready-{rank}").exists() for rank in (0, 1)):
        time.sleep(0.01)
    made.append(tempfile.mkdtemp(prefix="other-thread-"))
    _write(out / "other-thread-dir", made[0])


def _pids(out: Path) -> list[int]:
    pids = [int(p.read_text()) for p in out.glob("pid-*")]
    return pids + [int(pid) for p in out.glob("children-*") for pid in p.read_text().split()]


if __name__ == "__main__":
    out, mode, port = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    made: list = []
    if mode == "tempdir":
        threading.Thread(target=_other_thread_makes_a_tempdir, args=(out, made), daemon=True).start()
    result = {"raised": None, "message": ""}
    try:
        result["returned"] = notebook_launcher(train, args=(str(out), mode), num_processes=2, use_port=port)
    except BaseException as exc:  # what a notebook cell would show
        result["raised"], result["message"] = type(exc).__name__, str(exc)
    result["alive"] = leftover_processes(_pids(out), reap=False)
    result["sigint_handler_is_pythons"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if made:
        result["other_thread_dir_exists"] = os.path.isdir(made[0])
        if result["other_thread_dir_exists"]:
            os.rmdir(made[0])
    (out / "result.json").write_text(json.dumps(result))
