"""Tests of the gloo worker pool (torchrig.testing.pool) and the process guard.

One module-scoped pool serves most tests: starting one costs seconds (every rank imports
torch), running a task milliseconds. Tests that break the pool (stuck ranks, timeouts, a rank
that SIGKILLs itself) check that the very next run works on fresh workers. Task functions are
module-level because they travel to the workers with plain pickle; they import torch
themselves so this test process imports it as little as possible. Every ``run`` has an explicit
timeout, a hard limit only: nothing here measures time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from torchrig.testing.pool import PoolTimeout, WorkerContext, WorkerDied, WorkerError, WorkerPool
from torchrig.testing.processes import ProcessGuard, leftover_processes, spawn_in_new_session

# Every test here runs on a pool of worker processes.
pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool needs Linux")]

T = 60.0  # per-run hard limit for tasks that should finish at once


# --- tasks (module level: sent to the workers with plain pickle) -----------------------------


def whoami(ctx: WorkerContext) -> tuple[int, int, int, int, int]:
    import torch.distributed as dist

    return ctx.rank, ctx.world_size, dist.get_rank(), dist.get_world_size(), os.getpid()


def all_reduce_sum(ctx: WorkerContext, scale: float, *, offset: float = 0.0) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([scale * (ctx.rank + 1) + offset])
    dist.all_reduce(t)
    return float(t.item())


def rank_times_ten_late_rank_zero(ctx: WorkerContext) -> int:
    import torch.distributed as dist

    if ctx.rank == 0:
        time.sleep(0.3)  # rank 0 answers last: results must still be indexed by rank
    dist.barrier()
    return ctx.rank * 10


def worker_environment(ctx: WorkerContext, names: list[str]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def scratch_roundtrip(ctx: WorkerContext, token: str) -> str:
    import torch.distributed as dist

    path = os.path.join(ctx.scratch_dir, "shared.txt")
    if ctx.rank == 0:
        with open(path, "w") as f:
            f.write(token)
    dist.barrier()
    with open(path) as f:
        return f.read()


def raise_on_rank_one(ctx: WorkerContext) -> int:
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    return ctx.rank


def raise_on_rank_zero_while_peer_waits(ctx: WorkerContext) -> None:
    import torch.distributed as dist

    if ctx.rank == 0:
        raise RuntimeError("rank 0 fails before the barrier")
    dist.barrier()  # rank 1 waits here for rank 0, which never comes


def sleep_forever(ctx: WorkerContext) -> None:
    time.sleep(3600)


def sigkill_rank_one(ctx: WorkerContext) -> int:
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached
    return ctx.rank


def leak_grandchild(ctx: WorkerContext) -> int:
    # A process the task forgets: it stays in the worker's process group, which close() kills.
    return subprocess.Popen(["sleep", "300"]).pid


def return_unpicklable(ctx: WorkerContext) -> object:
    return lambda: None


def destroy_default_group(ctx: WorkerContext) -> str:
    import torch.distributed as dist

    dist.destroy_process_group()
    return "destroyed"


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(world_size=2, error_grace=3.0)
    try:
        yield p
    finally:
        pids = p.started_pids
        p.close()
        assert leftover_processes(pids) == []


# --- tests ------------------------------------------------------------------------------------


def test_ranks_agree_on_rank_and_world_size(pool: WorkerPool) -> None:
    results = pool.run(whoami, timeout=T)
    assert [r[:4] for r in results] == [(0, 2, 0, 2), (1, 2, 1, 2)]
    assert [r[4] for r in results] == pool.pids


def test_all_reduce_sums_over_ranks(pool: WorkerPool) -> None:
    assert pool.run(all_reduce_sum, 2.0, offset=1.0, timeout=T) == [8.0, 8.0]  # (2+1) + (4+1)


def test_results_are_indexed_by_rank(pool: WorkerPool) -> None:
    assert pool.run(rank_times_ten_late_rank_zero, timeout=T) == [0, 10]


def test_workers_get_one_omp_thread(pool: WorkerPool) -> None:
    assert pool.run(worker_environment, ["OMP_NUM_THREADS"], timeout=T) == [{"OMP_NUM_THREADS": "1"}] * 2


def test_scratch_dir_is_shared(pool: WorkerPool) -> None:
    assert pool.run(scratch_roundtrip, "hello from rank 0", timeout=T) == ["hello from rank 0"] * 2


def test_lambda_is_refused_before_sending(pool: WorkerPool) -> None:
    with pytest.raises(TypeError, match="module level"):
        pool.run(lambda ctx: 1, timeout=T)
    assert [r[0] for r in pool.run(whoami, timeout=T)] == [0, 1]


def test_unpicklable_result_is_a_worker_error(pool: WorkerPool) -> None:
    pids = pool.pids
    with pytest.raises(WorkerError, match="could not be pickled"):
        pool.run(return_unpicklable, timeout=T)
    assert pool.run(all_reduce_sum, 1.0, timeout=T) == [3.0, 3.0]
    assert pool.pids == pids  # nothing was stuck: the workers were kept


def test_error_on_one_rank_reports_its_traceback(pool: WorkerPool) -> None:
    pids = pool.pids
    with pytest.raises(WorkerError) as info:
        pool.run(raise_on_rank_one, timeout=T)
    err = info.value
    assert type(err) is WorkerError
    assert set(err.failures) == {1}
    assert "ValueError: boom from rank 1" in str(err)
    assert "raise_on_rank_one" in err.failures[1]
    assert err.results == {0: 0}
    assert isinstance(err.exceptions[1], ValueError)
    # The pool recovered (here without a restart: every rank answered).
    assert pool.run(all_reduce_sum, 1.0, timeout=T) == [3.0, 3.0]
    assert pool.pids == pids


def test_error_while_peer_waits_in_collective(pool: WorkerPool) -> None:
    old = pool.pids
    with pytest.raises(WorkerError) as info:
        pool.run(raise_on_rank_zero_while_peer_waits, timeout=T)
    err = info.value
    assert set(err.failures) == {0}
    assert err.stuck == (1,)
    assert "rank 0 fails before the barrier" in str(err)
    assert "barrier" in err.stacks.get(1, "")  # rank 1's stack shows where it was stuck
    assert leftover_processes(old) == []
    assert pool.run(all_reduce_sum, 1.0, timeout=T) == [3.0, 3.0]
    assert set(pool.pids).isdisjoint(old)


def test_hanging_task_times_out(pool: WorkerPool) -> None:
    old = pool.pids
    with pytest.raises(PoolTimeout) as info:
        pool.run(sleep_forever, timeout=3)
    err = info.value
    assert err.stuck == (0, 1)
    assert set(err.failures) == {0, 1}
    assert "did not answer within 3 s" in str(err)
    assert "sleep_forever" in err.stacks[0]
    assert leftover_processes(old) == []
    assert [r[:2] for r in pool.run(whoami, timeout=T)] == [(0, 2), (1, 2)]


def test_rank_killing_itself_is_reported_and_pool_restarts(pool: WorkerPool) -> None:
    old = pool.pids
    with pytest.raises(WorkerDied) as info:
        pool.run(sigkill_rank_one, timeout=T)
    err = info.value
    assert 1 in err.exitcodes and err.exitcodes[1] == -signal.SIGKILL
    assert "rank 1" in str(err) and "SIGKILL" in str(err)
    assert leftover_processes(old) == []
    assert pool.run(all_reduce_sum, 1.0, timeout=T) == [3.0, 3.0]
    assert set(pool.pids).isdisjoint(old)


def test_restart_gives_new_workers_and_keeps_scratch(pool: WorkerPool) -> None:
    pool.run(scratch_roundtrip, "kept", timeout=T)
    old = pool.pids
    pool.restart()
    assert set(pool.pids).isdisjoint(old) and len(pool.pids) == 2
    assert leftover_processes(old) == []
    assert pool.run(scratch_roundtrip, "kept", timeout=T) == ["kept", "kept"]


def test_worker_killed_between_tasks_is_replaced(pool: WorkerPool) -> None:
    pool.start()
    old = pool.pids
    os.kill(old[0], signal.SIGKILL)
    # Wait until it is really dead (a zombie counts as dead; reap=False leaves it to the pool),
    # otherwise the next task may race with the kill and report WorkerDied instead.
    deadline = time.monotonic() + 30
    while leftover_processes([old[0]], reap=False) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.run(all_reduce_sum, 1.0, timeout=T) == [3.0, 3.0]
    assert set(pool.pids).isdisjoint(old)
    assert leftover_processes(old) == []


def test_task_destroying_the_process_group_gets_a_fresh_one(pool: WorkerPool) -> None:
    assert pool.run(destroy_default_group, timeout=T) == ["destroyed", "destroyed"]
    assert pool.pids == []  # the broken workers left; the next run starts new ones
    assert pool.run(all_reduce_sum, 1.0, timeout=T) == [3.0, 3.0]


def test_stop_ends_the_workers_and_the_next_run_starts_new_ones(pool: WorkerPool) -> None:
    """What the session pools do between test modules: old ranks (and the gloo groups they piled up) leave."""
    pool.run(all_reduce_sum, 1.0, timeout=T)
    before = pool.started_pids
    pool.stop()
    assert pool.pids == [] and leftover_processes(before) == []
    assert pool.run(all_reduce_sum, 1.0, timeout=T) == [3.0, 3.0]
    assert set(pool.pids).isdisjoint(before)


def test_a_task_from_a_module_off_sys_path_is_loaded_from_its_file(pool: WorkerPool, tmp_path) -> None:
    """pytest's --import-mode=importlib imports test modules without their folder on sys.path: the ranks load
    the task's module from its file under the same name."""
    from torchrig.testing.scripts import load_script

    script = tmp_path / "off_path_task_module.py"
    script.write_text("def rank_twice(ctx):\n    return 2 * ctx.rank\n")
    module = load_script(script)
    assert pool.run(module.rank_twice, timeout=T) == [0, 2]


def test_close_leaves_no_process_behind() -> None:
    pool = WorkerPool(world_size=2, env={"TORCHRIG_POOL_TEST": "yes"})
    with pool:
        assert pool.pids == []  # lazy: nothing started yet
        env = pool.run(worker_environment, ["TORCHRIG_POOL_TEST"], timeout=T)
        assert env == [{"TORCHRIG_POOL_TEST": "yes"}] * 2
        assert "TORCHRIG_POOL_TEST" not in os.environ
        grandchildren = pool.run(leak_grandchild, timeout=T)
        pids = pool.pids
        assert leftover_processes(pids + grandchildren) == pids + grandchildren
    assert pool.pids == []
    assert leftover_processes(pids + grandchildren) == []
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(whoami, timeout=T)


def test_guard_kills_and_reports_a_leaked_process() -> None:
    guard = ProcessGuard()
    proc = spawn_in_new_session(["sleep", "60"], guard=guard)
    with pytest.raises(AssertionError, match="sleep 60"):
        guard.assert_none_left(grace=0.2)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert leftover_processes([proc.pid]) == []
    guard.assert_none_left(grace=0)


def test_guard_follows_the_process_group_after_the_leader_exits() -> None:
    guard = ProcessGuard()
    try:
        # The shell exits at once; the sleep it started stays in the shell's group and session.
        script = "sleep 60 >/dev/null 2>&1 & echo $!"
        shell = spawn_in_new_session(["sh", "-c", script], guard=guard, stdout=subprocess.PIPE, text=True)
        out, _ = shell.communicate(timeout=10)
        sleeper = int(out.strip())
        assert leftover_processes([shell.pid]) == [shell.pid]
        guard.kill_all()
        assert guard.leftovers() == []
        assert leftover_processes([shell.pid, sleeper]) == []
    finally:
        guard.kill_all()


def test_guard_accepts_processes_that_exit() -> None:
    with ProcessGuard() as guard:
        proc = spawn_in_new_session(["true"], guard=guard)
        guard.track(proc.pid)  # tracking twice is harmless
    assert proc.returncode == 0
