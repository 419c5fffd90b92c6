"""The launcher's terminal and its log folders: two ranks drawing tqdm bars on one terminal do not
scroll a line per refresh (driven through a pseudo-terminal, lines counted); a line torch already
prefixed with its rank gets no second prefix; ``./torchrig_logs`` keeps the last
``launch.log_retention`` runs."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torchrig.launch.tail import PrefixedStream, _Destination
from torchrig.testing.terminal import run_on_a_terminal, screen

TIMEOUT = 180  # seconds before a test gives up (not a measurement)
STEPS = 50

BARS_SCRIPT = textwrap.dedent(f"""
    import time
    from tqdm import tqdm
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for _ in tqdm(range({STEPS}), desc=f"rank {{dist.get_rank()}} epoch", mininterval=0):  # every rank draws
        time.sleep(0.01)
    dist.barrier()
    dist.destroy_process_group()
""")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1", COLUMNS="100")
    return env


@pytest.mark.multiprocess
def test_two_ranks_drawing_bars_do_not_flood_the_terminal(tmp_path, process_guard):
    script = tmp_path / "bars.py"
    script.write_text(BARS_SCRIPT)
    code, raw = run_on_a_terminal([sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "2",
                                   "--log_dir", str(tmp_path / "logs"), str(script)], _env(tmp_path), process_guard,
                                  TIMEOUT)
    assert code == 0, raw
    shown = screen(raw)
    bars = [line for line in shown if " epoch:" in line]
    # rank 0's bar redraws in place (a line more when rank 1's line cuts in); rank 1's appears once, final
    assert len(bars) <= 4, "\n".join(shown)
    assert len(shown) <= 6, "\n".join(shown)
    assert any(line.startswith("[rank0]: rank 0 epoch: 100%") and f"{STEPS}/{STEPS}" in line for line in bars), shown
    assert [line for line in bars if line.startswith("[rank1]:")] == [
        next(line for line in bars if line.startswith("[rank1]: rank 1 epoch: 100%"))]
    # both ranks' refreshes are all in their files
    logged = (tmp_path / "logs" / "attempt-0" / "rank-1.stderr.log").read_bytes()
    assert logged.count(b"rank 1 epoch:") > STEPS // 2


def _stream(terminal: bool, prefix: str = "[rank1]: ", live: bool = True) -> PrefixedStream:
    class Sink(io.StringIO):
        def isatty(self) -> bool:
            return terminal

    return PrefixedStream(prefix, _Destination(Sink()), live=live)


TORCH_LINE = "[rank1]:[W1127 19:20:00.000000000 Module.cpp:1] Warning: a C++ warning (function f)"


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_a_line_torch_already_prefixed_with_the_rank_gets_no_second_prefix(terminal):
    stream = _stream(terminal)
    text = stream.feed(f"{TORCH_LINE}\nplain\n[rank0]: another rank's mark\n".encode())
    assert text.splitlines() == [TORCH_LINE, "[rank1]: plain", "[rank1]: [rank0]: another rank's mark"]


def test_on_a_terminal_only_the_latest_of_several_refreshes_is_drawn():
    stream = _stream(True)
    assert stream.feed(b"\rbar 1\rbar 2\rbar 3") == "\r[rank1]: bar 3"
    assert stream.feed(b"\rbar 4\rbar 5\n") == "\r[rank1]: bar 5\n"


def test_on_a_terminal_a_rank_that_is_not_live_writes_a_bar_once_in_its_final_state():
    stream = _stream(True, live=False)
    assert stream.feed(b"\rbar 1\rbar 2") == ""
    assert stream.feed(b"\rbar 3\n") == "[rank1]: bar 3\n"
    assert not stream.line_open


def _launch_here(tmp_path: Path, config: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "1",
                           "--config_file", str(config), "--no_python", *command], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT)


def _run_folders(tmp_path: Path) -> list[str]:
    return sorted(path.name for path in (tmp_path / "torchrig_logs").iterdir())


@pytest.mark.multiprocess
def test_the_log_root_keeps_the_last_log_retention_runs(tmp_path):
    keep_two = tmp_path / "keep-two.yaml"
    keep_two.write_text("launch:\n  log_retention: 2\n")
    (tmp_path / "torchrig_logs").mkdir()
    (tmp_path / "torchrig_logs" / "notes.txt").write_text("mine")  # not a run folder: never touched
    names = []
    for _ in range(3):
        result = _launch_here(tmp_path, keep_two, "true")
        assert result.returncode == 0, result.stderr
        # said once, in the start line: where, and how long it stays
        assert result.stderr.count("status and logs in") == 1, result.stderr
        assert "(the last 2 runs' folders are kept: launch.log_retention)" in result.stderr
        names.append(next(n for n in _run_folders(tmp_path) if n not in names and n != "notes.txt"))
        time.sleep(1.1)  # run ids start with the second they were made: keep the order unambiguous
    assert _run_folders(tmp_path) == sorted([*names[1:], "notes.txt"])

    keep_none = tmp_path / "keep-none.yaml"
    keep_none.write_text("launch:\n  log_retention: 0\n")
    failed = _launch_here(tmp_path, keep_none, "false")
    assert failed.returncode == 1 and "deleted if the run succeeds" in failed.stderr
    left = [n for n in _run_folders(tmp_path) if n != "notes.txt"]
    assert len(left) == 1 and left[0] not in names  # the failed run's folder stays (its summary points there)
    assert _launch_here(tmp_path, keep_none, "true").returncode == 0
    assert _run_folders(tmp_path) == ["notes.txt"]
