"""The hang report from recorded dumps (fast tier: no process, no torch.distributed): ranks
grouped by the collective they are in, the verdict, both call sites; the rank-side description
of a Flight Recorder entry as torch 2.13 records one for gloo."""

from __future__ import annotations

import json
import os
import sysconfig

import pytest
from torchrig.resilience import collective_trace, hang_report

TORCH_FILE = os.path.join(sysconfig.get_path("purelib"), "torch", "distributed", "distributed_c10d.py")

#: A Flight Recorder entry as ``_dump_fr_trace(True, True, False)`` returned it for a gloo all_gather
#: that timed out (innermost frame first; the script's frame is the user's call site).
RECORDED_ENTRY = {
    "collective_seq_id": 2, "p2p_seq_id": 0, "is_p2p": False, "input_dtypes": ["Float"], "input_sizes": [[4]],
    "output_dtypes": ["Float"], "output_sizes": [[4, 4]], "process_group": ("0", "default_pg"),
    "profiling_name": "gloo:all_gather", "record_id": 1, "retired": False, "state": "scheduled", "timeout_ms": 3000,
    "frames": [{"name": "all_gather", "filename": TORCH_FILE, "line": 4287},
               {"name": "<module>", "filename": "/home/me/train.py", "line": 91}],
}


def _dump(reason: str, op: str | None, seq: int = 2, site: str = "train.py:91", group: str = "0", desc: str = "dp",
          members: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    collectives = [] if op is None else [{
        "op": op, "seq": seq, "group": group, "group_desc": desc, "group_ranks": list(members),
        "input_sizes": [[4]], "input_dtypes": ["Float"], "call_site": site}]
    return {"reason": reason, "collectives": collectives, "call_site": site}


def test_a_recorded_flight_recorder_entry_is_described_with_the_users_call_site():
    described = collective_trace.describe(RECORDED_ENTRY, {"0": [0, 1, 2, 3]})
    assert (described["op"], described["seq"], described["group_desc"], described["group_ranks"]) == (
        "all_gather", 2, "default_pg", [0, 1, 2, 3])
    assert described["call_site"] == "/home/me/train.py:91"  # not torch's frame
    assert described["input_sizes"] == [[4]] and described["input_dtypes"] == ["Float"]


def test_user_frames_are_the_scripts_not_torchs_nor_torchrigs():
    assert not collective_trace.is_user_file(TORCH_FILE)
    assert not collective_trace.is_user_file(collective_trace.__file__)  # torchrig's own package
    assert not collective_trace.is_user_file("<frozen runpy>")
    assert collective_trace.user_call_site([("/home/me/train.py", 10, "<module>"), ("/home/me/model.py", 5, "step"),
                                            (TORCH_FILE, 4287, "all_reduce")]) == "/home/me/model.py:5"


def test_mismatched_collectives_name_the_odd_rank_both_collectives_and_both_lines():
    dumps = {r: _dump("timeout", "all_gather", site="train.py:91", group="1", desc="tp") for r in (0, 1, 2, 4, 5, 6, 7)}
    dumps[3] = _dump("timeout", "all_reduce", site="train.py:88", group="0", desc="dp")
    diagnosis = hang_report.diagnose(dumps, range(8))
    assert diagnosis["verdict"] == "mismatched"
    assert diagnosis["text"] == (
        "rank 3 is in all_reduce #2 of group dp (ranks 0\u20133) [Float[4]], called at train.py:88; "
        "ranks 0\u20132, 4\u20137 are in all_gather #2 of group tp (ranks 0\u20133) [Float[4]], called at train.py:91: "
        "mismatched collectives, called at train.py:88 vs train.py:91")


def test_a_rank_that_lost_its_peer_inside_a_collective_counts_as_in_it():
    """Under load the first rank to time out exits before a slower one's timeout elapses: the slower one
    fails with gloo's "Connection closed by peer" inside the same collective, and is reported there."""
    lost = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:7091")
    assert collective_trace.is_peer_lost_error(lost) and not collective_trace.is_timeout_error(lost)
    dumps = {r: _dump("timeout", "all_gather") for r in (1, 2)}
    dumps[0] = _dump(collective_trace.PEER_LOST, "all_gather")
    dumps[3] = _dump("timeout", "all_reduce", site="train.py:88")
    diagnosis = hang_report.diagnose(dumps, range(4))
    assert diagnosis["verdict"] == "mismatched"
    assert diagnosis["text"].startswith("rank 3 is in all_reduce #2 of group dp (ranks 0\u20133) [Float[4]], called at "
                                        "train.py:88; ranks 0\u20132 are in all_gather #2")
    assert "wrote no hang dump" not in diagnosis["text"]


def test_ranks_at_different_sequence_numbers_are_out_of_step():
    dumps = {0: _dump("timeout", "all_reduce", seq=5), 1: _dump("stopped", "all_reduce", seq=6, site="train.py:95")}
    diagnosis = hang_report.diagnose(dumps, [0, 1])
    assert diagnosis["verdict"] == "out of step"
    assert diagnosis["text"].startswith("rank 0 is in all_reduce #5 of group dp (ranks 0\u20133) [Float[4]], called at "
                                        "train.py:91; rank 1 is in all_reduce #6")


def test_a_rank_outside_any_collective_is_named_with_where_it_was_and_silent_ranks_are_listed():
    dumps = {0: _dump("timeout", "barrier", seq=2, site="train.py:12"), 1: _dump("stopped", None, site="train.py:11")}
    diagnosis = hang_report.diagnose(dumps, [0, 1, 2])
    assert diagnosis["verdict"] == "not in a collective"
    assert diagnosis["text"].startswith("rank 1 is in no collective, at train.py:11; rank 0 is in barrier #2")
    assert diagnosis["text"].endswith("; rank 2 wrote no hang dump (exited or killed before it could)")


def test_every_rank_in_the_same_collective_says_so():
    diagnosis = hang_report.diagnose({0: _dump("timeout", "all_reduce"), 1: _dump("timeout", "all_reduce")}, [0, 1])
    assert diagnosis["verdict"] == "same collective"
    assert diagnosis["text"].startswith("ranks 0\u20131 are in all_reduce #2 of group dp")


def test_no_timeout_no_diagnosis():
    """Ranks the launcher stopped after a failure elsewhere: not a hang, no report."""
    assert hang_report.diagnose({0: _dump("stopped", "barrier"), 1: _dump("stopped", None)}, [0, 1]) is None


@pytest.mark.parametrize("ranks, text", [([3], "rank 3"), ([0, 1, 2, 4, 5, 6, 7], "ranks 0\u20132, 4\u20137"),
                                         ([0, 2], "ranks 0, 2")])
def test_rank_sets_are_written_as_ranges(ranks, text):
    assert hang_report.format_ranks(ranks) == text


def test_dumps_are_read_back_from_the_log_folder_for_this_attempt_only(tmp_path):
    for rank, attempt in ((0, 1), (1, 0)):
        path = collective_trace.dump_path(str(tmp_path), rank)
        with open(path, "w") as handle:
            json.dump({**_dump("timeout", "all_reduce"), "attempt": attempt}, handle)
    (tmp_path / "rank-2.hang.json").write_text("{not json")
    assert sorted(hang_report.load_dumps(str(tmp_path), [0, 1, 2, 3], attempt=1)) == [0]
    hang_report.forget_dumps(str(tmp_path), [0, 1, 2])
    assert list(tmp_path.iterdir()) == []


def test_the_flight_recorder_is_sized_unless_the_user_chose():
    environ: dict[str, str] = {}
    collective_trace.record_collectives(environ)
    assert environ == {"TORCH_FR_BUFFER_SIZE": str(collective_trace.RECORDED_COLLECTIVES)}
    chosen = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    collective_trace.record_collectives(chosen)
    assert chosen == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
