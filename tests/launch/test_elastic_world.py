"""Elastic world size (issue 38): ``torchrig launch --num_machines MIN:MAX``.

What is tested here: the flag's parsing and its refusals (exit 2, naming the flag), and that the
c10d rendezvous it configures really goes on with fewer machines than MAX (a real rendezvous
round on loopback, not a mock). The two-launcher kill test is not built yet (docs/resilience.md,
"Elastic world size", says what remains).
"""

from __future__ import annotations

import time

import pytest
from torchrig.launch.cli import main, split_machine_range
from torchrig.launch.rendezvous import free_port, rendezvous_handler
from torchrig.plugin.types import LaunchPlan


def test_num_machines_range_is_max_and_min_machines():
    assert split_machine_range(["--cpu", "--num_machines", "1:2"]) == [
        "--cpu", "--num_machines", "2", "--min_machines", "1"]
    assert split_machine_range(["--num_machines=2:4"]) == ["--num_machines", "4", "--min_machines", "2"]
    assert split_machine_range(["--num_machines", "3"]) == ["--num_machines", "3"]


@pytest.mark.parametrize(("flags", "named"), [
    (["--num_machines", "3:2"], "--num_machines 3:2"),
    (["--num_machines", "a:2"], "--num_machines a:2"),
    (["--num_machines", "0:2"], "--num_machines 0:2"),
    (["--num_machines", "1:2", "--rdzv_backend", "static"], "min_machines 1"),
    (["--num_machines", "2", "--min_machines", "3"], "min_machines 3 is above num_machines 2"),
])
def test_bad_machine_range_is_exit_2_naming_it(flags, named, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    code = main([*flags, "--cpu", "--main_process_ip", "127.0.0.1", "--main_process_port", "29500",
                 "--dry_run", str(script)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert named in err and "Traceback" not in err


def test_elastic_rendezvous_goes_on_with_the_minimum():
    """``--num_machines 1:2`` with one machine up: the c10d round closes with a world of 1 once
    the last call has passed, instead of waiting for the second machine (node rank 0: the round's)."""
    endpoint = f"127.0.0.1:{free_port()}"
    plan = LaunchPlan(command=["true"], num_nodes=2, min_nodes=1, node_rank=0, rdzv_backend="c10d",
                      rdzv_endpoint=endpoint, master_addr="127.0.0.1",
                      rdzv_configs={"join_timeout": 20, "last_call_timeout": 1})
    handler, _, _ = rendezvous_handler(plan)
    started = time.monotonic()
    try:
        info = handler.next_rendezvous()
    finally:
        handler.shutdown()
    assert (info.rank, info.world_size) == (0, 1)
    assert time.monotonic() - started < 15
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
