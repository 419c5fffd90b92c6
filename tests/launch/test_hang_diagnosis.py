"""Hang diagnosis end to end: `torchrig launch` on 4 CPU ranks where the last rank calls a
different collective than the others; every rank's collective times out (3 s) and the launcher
names the ranks, both collectives with their sequence numbers and both lines of the script.
Real workers, real gloo, torch's own Flight Recorder; nothing left running."""

from __future__ import annotations

import pytest

from .test_launch import LAUNCH_TIMEOUT, SCRIPTS, outdir, run, run_status, track_workers

MISMATCHED = SCRIPTS / "mismatched_collective.py"


def _line_of(marker: str) -> int:
    """The script's line holding ``marker`` (1-based): the test does not hard-code line numbers."""
    return next(n for n, line in enumerate(MISMATCHED.read_text().splitlines(), 1) if marker in line)


def _expected_on_4_ranks() -> str:
    reduce_at, gather_at = _line_of("# the mismatch"), _line_of("dist.all_gather(")
    return (f"rank 3 is in all_reduce #2 of group default_pg (ranks 0\u20133) [Float[4]], called at "
            f"{MISMATCHED}:{reduce_at}; ranks 0\u20132 are in all_gather #2 of group default_pg (ranks 0\u20133) "
            f"[Float[4]], called at {MISMATCHED}:{gather_at}: mismatched collectives, called at "
            f"{MISMATCHED}:{reduce_at} vs {MISMATCHED}:{gather_at}")


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_mismatched_collective_on_4_cpu_ranks_is_named_with_both_call_sites(tmp_path, process_guard):
    out, log_dir = outdir(tmp_path), tmp_path / "logs"
    code, _, err = run(tmp_path, process_guard, "--num_processes", "4", "--log_dir", str(log_dir), str(MISMATCHED),
                       str(out), "gloo")
    track_workers(out, process_guard)
    assert code == 1, err
    assert "torchrig launch: hang diagnosis: " + _expected_on_4_ranks() in err, err
    hang = run_status(log_dir)["attempts"][-1]["verdict"]["hang"]
    assert hang["verdict"] == "mismatched"
    assert {rank: (d["collective"]["op"], d["collective"]["seq"]) for rank, d in hang["ranks"].items()} == {
        "0": ("all_gather", 2), "1": ("all_gather", 2), "2": ("all_gather", 2), "3": ("all_reduce", 2)}
    # each rank timed out, or (under load) failed on a peer that timed out first and exited
    reasons = [d["reason"] for d in hang["ranks"].values()]
    assert "timeout" in reasons and set(reasons) <= {"timeout", "peer lost"}, reasons


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_mismatched_nccl_collective_is_named_from_nccls_flight_recorder(tmp_path, process_guard):
    """The GPU tier: one rank a GPU over NCCL (its Flight Recorder), the last rank mismatched."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"a mismatched collective needs 2 GPUs; {gpus} visible")
    out, log_dir = outdir(tmp_path), tmp_path / "logs"
    code, _, err = run(tmp_path, process_guard, "--num_processes", str(min(gpus, 4)), "--log_dir", str(log_dir),
                       str(MISMATCHED), str(out), "nccl")
    track_workers(out, process_guard)
    assert code != 0, err
    last = min(gpus, 4) - 1
    assert f"rank {last} is in all_reduce #2" in err and "all_gather #2" in err, err
    assert f"{MISMATCHED}:{_line_of('# the mismatch')}" in err and f"{MISMATCHED}:{_line_of('dist.all_gather(')}" in err
