"""``torchrig test``: a short sanity training of the current configuration under the real launcher,
which says what works, names the rank and check that does not, and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

TIMEOUT = 240  # seconds before the test gives up on the command (not a measurement)
CHECKS = ("start", "collectives", "train", "checkpoint")


def torchrig_test(tmp_path: Path, guard, *flags: str, extra_env: dict[str, str] | None = None
                  ) -> tuple[int, str, Path]:
    """Run ``torchrig test FLAGS`` in a fresh working directory with a private temp directory."""
    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir(exist_ok=True)
    temp.mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1", TMPDIR=str(temp),
               **(extra_env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", "test", *flags], cwd=work, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    guard.track(proc)
    output, _ = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, output, temp


@pytest.mark.parametrize("flags", [("--num_processes", "2"), ("--num_processes", "2", "--strategy", "fsdp"),
                                   ("--num_processes", "1", "--mixed_precision", "bf16")])
def test_every_check_passes_and_nothing_is_left_behind(tmp_path, process_guard, flags):
    code, output, temp = torchrig_test(tmp_path, process_guard, "--cpu", *flags)
    assert code == 0, output
    processes = int(flags[1])
    for rank in range(processes):
        for check in CHECKS:
            assert f"torchrig test: rank {rank}: {check}: ok" in output, (rank, check, output)
    assert f"torchrig test: all 4 checks passed on {processes} process(es)" in output
    assert "every rank has the same weights" in output and "bit-identically" in output
    # the run's logs and the checkpoint lived in temporary directories, removed after a passing run
    assert not list((tmp_path / "work").iterdir())
    assert not [entry.name for entry in temp.iterdir() if entry.name.startswith("torchrig-test-")]


SITECUSTOMIZE = textwrap.dedent("""
    # A broken interconnect on rank 1: its all-reduce results come back off by one.
    import os
    if os.environ.get("RANK") == "1":
        import torch.distributed as dist
        _all_reduce = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            work = _all_reduce(tensor, *args, **kwargs)
            tensor.add_(1)
            return work

        dist.all_reduce = all_reduce
""")


def test_a_failing_check_names_the_rank_and_the_check_and_keeps_the_logs(tmp_path, process_guard):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    code, output, temp = torchrig_test(tmp_path, process_guard, "--cpu", "--num_processes", "2",
                                       extra_env={"PYTHONPATH": pythonpath})
    assert code == 1, output
    assert "torchrig test: rank 1: collectives: FAILED: RuntimeError: all-reduce of 1..2 gave 4.0" in output
    assert "torchrig test: rank 1: failed: collectives; not run: train, checkpoint" in output
    assert "all 4 checks passed" not in output
    kept = [entry for entry in temp.iterdir() if entry.name.startswith("torchrig-test-logs-")]
    assert len(kept) == 1 and f"the per-rank logs are kept in {kept[0]}" in output
    assert "collectives: FAILED" in (kept[0] / "attempt-0" / "rank-1.stdout.log").read_text()


@pytest.mark.parametrize(("flags", "message"), [
    (("train.py",), "takes only launch flags; got 'train.py' (to run a script: torchrig launch [flags] train.py)"),
    (("-m", "mypackage"), "-m/--module and --no_python are not accepted"),
    (("--num_procesess", "2"), "unrecognized flag --num_procesess"),
    (("--num_processes", "two"), "--num_processes"),
])
def test_usage_errors_exit_2_naming_the_problem_without_a_traceback(tmp_path, flags, message):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "torchrig", "test", *flags], capture_output=True, text=True,
                         timeout=TIMEOUT, check=False, env=env)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert not list(tmp_path.iterdir())  # no empty torchrig-test-logs-* directory left behind


def test_help_lists_the_launch_flags_and_imports_no_torch():
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "torchrig", "test", "--help"], capture_output=True,
                         text=True, timeout=TIMEOUT, check=False)
    assert run.returncode == 0
    assert run.stdout.startswith("usage: torchrig test [flags]") and "--num_processes" in run.stdout
    assert "training_script" not in run.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if "|" in line}
    assert "torch" not in imported
    listing = subprocess.run([sys.executable, "-m", "torchrig", "--help"], capture_output=True, text=True,
                             timeout=TIMEOUT, check=False)
    assert "a short sanity training" in listing.stdout
