"""What a person sees of the workers' output under ``torchrig launch``: a tqdm bar redraws in place
on a terminal (driven through a pseudo-terminal, its screen reconstructed), a piped log gets one
final line per bar, and every visible line carries its rank prefix exactly once."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torchrig.launch.tail import PrefixedStream, _Destination
from torchrig.testing.terminal import run_on_a_terminal, screen

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180  # seconds before the test gives up (not a measurement)

BAR_SCRIPT = textwrap.dedent("""
    import time
    from tqdm.auto import tqdm
    from torchrig import Accelerator

    accelerator = Accelerator()
    print(f"hello from {accelerator.process_index}", flush=True)
    accelerator.wait_for_everyone()
    for _ in tqdm(range(25), desc="epoch 0", disable=not accelerator.is_local_main_process, mininterval=0):
        time.sleep(0.02)
    accelerator.wait_for_everyone()
    print(f"bye from {accelerator.process_index}", flush=True)
""")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1", COLUMNS="100")
    return env


def _command(tmp_path: Path) -> list[str]:
    script = tmp_path / "bar.py"
    script.write_text(BAR_SCRIPT)
    return [sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "2",
            "--log_dir", str(tmp_path / "logs"), str(script)]


def test_a_progress_bar_redraws_in_place_on_a_terminal(tmp_path, process_guard):
    code, raw = run_on_a_terminal(_command(tmp_path), _env(tmp_path), process_guard, TIMEOUT)
    assert code == 0, raw
    shown = screen(raw)
    bars = [line for line in shown if "epoch 0:" in line]
    assert len(bars) == 1, shown  # redrawn in place: one visible line
    assert bars[0].startswith("[rank0]: epoch 0: 100%") and "25/25" in bars[0]
    assert raw.count("epoch 0:") > 3  # ...although it was drawn many times
    assert "[rank0]: hello from 0" in shown and "[rank1]: bye from 1" in shown
    assert not [line for line in shown if line.strip() in ("[rank0]:", "[rank1]:")]  # no stray prefixes


def test_a_piped_log_gets_the_final_state_of_a_bar_once(tmp_path, process_guard):
    proc = subprocess.Popen(_command(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(tmp_path), start_new_session=True)
    process_guard.track(proc)
    output, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, output
    bars = [line for line in output.splitlines() if "epoch 0:" in line]
    assert len(bars) == 1 and bars[0].startswith("[rank0]: epoch 0: 100%"), output
    assert "\r" not in output
    # the per-rank log file keeps every refresh, as the worker wrote it
    logged = (tmp_path / "logs" / "attempt-0" / "rank-0.stderr.log").read_bytes()
    assert logged.count(b"epoch 0:") > 3 and b"\r" in logged


def _pipe_stream(prefix: str = "[rank0]: ") -> tuple[PrefixedStream, io.StringIO]:
    sink = io.StringIO()
    return PrefixedStream(prefix, _Destination(sink)), sink


def _terminal_stream(prefix: str = "[rank0]: ") -> PrefixedStream:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    return PrefixedStream(prefix, _Destination(Terminal()))


def test_pipe_mode_keeps_whole_lines_windows_line_ends_and_split_utf8():
    stream, _ = _pipe_stream()
    text = stream.feed(b"plain\nwin\r\nbar 1\rbar 2\rbar ")
    assert text == "[rank0]: plain\n[rank0]: win\n"
    text = stream.feed("3 \u2588".encode()[:-1])  # a character split across reads
    text += stream.feed("\u2588".encode()[-1:] + b"\n\n")
    assert text == "[rank0]: bar 3 \u2588\n[rank0]: \n"
    assert stream.feed(b"no newline at the end", final=True) == "[rank0]: no newline at the end\n"


def test_terminal_mode_prefixes_each_visible_line_once_and_passes_carriage_returns():
    stream = _terminal_stream()
    assert stream.feed(b"partial ") == "[rank0]: partial "
    assert stream.feed(b"line\n") == "line\n"  # the rest of a line read in two pieces: one prefix
    assert stream.feed(b"\rbar 1") == "\r[rank0]: bar 1"
    assert stream.feed(b"\rbar 2\r\n") == "\r[rank0]: bar 2\r\n"
    assert stream.feed(b"\n") == "[rank0]: \n"  # an empty line still shows its rank
    assert stream.feed(b"open", final=True) == "[rank0]: open\n"
