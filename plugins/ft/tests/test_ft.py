"""The ft strategy (torchrig-ft): torchft replica groups keep training when one dies, and a restarted
group recovers the live state from its peer — no job restart, no checkpoint read.

One lighthouse on loopback (in this process), two replica groups of one process each running
``ft_replica_train.py`` (``Accelerator(strategy="ft")``, a tiny MLP, AdamW); one is killed with
SIGKILL mid-run and started again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torchft.coordination import LighthouseServer
from torchrig.plugin import ClusterInfo, ConfigError, RunContext, TorchrigError
from torchrig.testing import resolved_config
from torchrig_ft.strategy import FTStrategy

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).with_name("ft_replica_train.py")
DEADLINE_S = 180.0  # the whole scenario (~13 s alone, more beside other tests); the processes are killed when it passes


class ReplicaGroup:
    """One replica group's process (its own session, so its whole process group can be killed) and
    the JSON lines it printed."""

    def __init__(self, replica: int, out: Path, lighthouse: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error",
                   TORCHRIG_FT_CONFIG__LIGHTHOUSE=lighthouse, TORCHRIG_FT_CONFIG__HOSTNAME="127.0.0.1",
                   TORCHRIG_FT_CONFIG__REPLICA_ID=f"group{replica}", TORCHRIG_FT_CONFIG__TIMEOUT_S="10")
        self.log = out / f"replica-{replica}-{time.monotonic_ns()}.stderr"
        with open(self.log, "w") as stderr:
            self.process = subprocess.Popen([sys.executable, str(SCRIPT), str(replica), str(out)], env=env,
                                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                                            start_new_session=True)
        self.records: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.records.append(json.loads(line))

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in list(self.records) if "step" in r]

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


def wait_for(condition: Any, what: str, started: float, groups: list[ReplicaGroup]) -> None:
    while not condition():
        if time.monotonic() - started > DEADLINE_S:
            said = "\n".join(f"--- {group.log.name} (exit {group.process.poll()}), last steps {group.steps()[-3:]}:\n"
                             + "\n".join(group.log.read_text(errors="replace").splitlines()[-15:]) for group in groups)
            raise AssertionError(f"timed out waiting for {what}\n{said}")
        time.sleep(0.05)


def test_a_killed_replica_group_rejoins_from_its_live_peer_while_the_other_keeps_stepping(tmp_path: Path) -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    started = time.monotonic()
    groups: list[ReplicaGroup] = []
    try:
        survivor, victim = ReplicaGroup(0, tmp_path, lighthouse.address()), ReplicaGroup(1, tmp_path, lighthouse.address())
        groups += [survivor, victim]
        wait_for(lambda: any(r["participants"] == 2 and r["step"] >= 3 for r in victim.steps()),
                 "both replica groups to commit steps together", started, groups)
        victim.kill()
        step_at_kill = survivor.steps()[-1]["step"]
        wait_for(lambda: any(r["participants"] == 1 and r["step"] >= step_at_kill + 3 for r in survivor.steps()),
                 "the survivor to commit steps alone", started, groups)

        rejoined = ReplicaGroup(1, tmp_path, lighthouse.address())
        groups.append(rejoined)
        wait_for(lambda: any(r["participants"] == 2 for r in rejoined.steps()),
                 "the restarted replica group to step with its peer again", started, groups)
        (tmp_path / "stop_at").write_text(str(max(r["step"] for r in survivor.steps() + rejoined.steps()) + 3))
        for group in (survivor, rejoined):
            group.process.wait(timeout=max(1.0, DEADLINE_S - (time.monotonic() - started)))
            assert group.process.returncode == 0
    finally:
        for group in groups:
            group.kill()
        lighthouse.shutdown()

    # The survivor never restarted: one process, its loop and torchft's step counter ran on through the kill.
    survived = survivor.steps()
    assert {r["pid"] for r in survived} == {survivor.process.pid}
    assert [r["iteration"] for r in survived] == list(range(len(survived)))
    assert all(b["step"] - a["step"] in (0, 1) for a, b in zip(survived, survived[1:]))
    assert any(r["participants"] == 1 and r["step"] > step_at_kill for r in survived)

    # The restarted group did not start over: its first committed step is the peer's, with the peer's parameters.
    first = rejoined.steps()[0]
    assert first["step"] > step_at_kill
    peer_digests = {r["digest"] for r in survived if r["step"] == first["step"]}
    assert peer_digests == {first["digest"]}, f"recovered parameters differ from the peer's at step {first['step']}"

    # Both finish at the same step with equal parameters (model and AdamW state went over the wire).
    assert survived[-1]["step"] == rejoined.steps()[-1]["step"]
    final = [torch.load(tmp_path / f"params-{replica}.pt") for replica in (0, 1)]
    assert final[0].keys() == final[1].keys()
    for name in final[0]:
        assert torch.equal(final[0][name], final[1][name]), name
    # torchft's step counter is in each group's checkpoint: the restarted group's came from its peer.
    saved = [torch.load(tmp_path / f"checkpoint-{replica}" / "torchft_manager.pt", weights_only=True)["step"]
             for replica in (0, 1)]
    assert saved == [survived[-1]["step"]] * 2


def test_no_lighthouse_address_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"ft_config\.lighthouse.*torchft lighthouse"):
        resolved_config({"strategy": "ft"})


def test_the_launcher_refuses_ft_without_a_lighthouse_before_starting_anything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_FT_CONFIG__")}
    result = subprocess.run([sys.executable, "-m", "torchrig", "launch", "--strategy", "ft", str(SCRIPT), "0",
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "ft_config.lighthouse" in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("params-*.pt"))


def test_a_replica_group_of_several_processes_is_refused_naming_the_strategy() -> None:
    """torchft's DistributedDataParallel reduces across groups only: a group of two would train two
    unsynchronised halves, so the run is refused when it is configured, before any model exists."""
    run = RunContext(config=resolved_config({"strategy": "ft", "ft_config.lighthouse": "http://127.0.0.1:1"}),
                     cluster=ClusterInfo(rank=0, world_size=2))
    with pytest.raises(TorchrigError, match=r"strategy 'ft' runs one process per replica group.*--num_processes 1"):
        FTStrategy().torchrig_configure(run=run)
