"""torchrig on a real one-node Slurm (Debian's slurm-wlm 22.05 + munge, started by the suite).

The session fixture (:mod:`slurm_cluster`) starts munged, slurmctld and slurmd from a temp
directory; without the packages, or when a daemon does not come up, every test here skips with
the reason. Each test submits real jobs (``srun``, ``sbatch``) and waits for their states with
hard timeouts; at the end every job is cancelled and no process of the cluster may survive.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest

from .slurm_cluster import SlurmTestCluster, Unavailable

pytestmark = [pytest.mark.multiprocess]

TESTS = pathlib.Path(__file__).parent
WORKER = TESTS / "cluster_scripts" / "worker.py"
PREEMPTIBLE = TESTS.parent / "resilience" / "preemption_scripts" / "preemptible_train.py"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    cluster = SlurmTestCluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
    except Unavailable as exc:
        pytest.skip(f"no Slurm cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
        left = cluster.leftover_processes()
        assert not left, f"processes of the Slurm cluster left behind: {left}"


def worker_env(**extra: str) -> dict[str, str]:
    """What a job needs to find this checkout's torchrig, on top of the cluster's environment."""
    return {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


DETECT = ("import json, os, attrs; from torchrig.testing import make_host; host = make_host(); "
          "host.select_auto('cluster'); info = host.hook.torchrig_detect_cluster(environ=dict(os.environ)); "
          "print(json.dumps(attrs.asdict(info)))")


@pytest.mark.timeout(120)
def test_the_slurm_plugin_reads_the_variables_a_real_srun_sets(slurm: SlurmTestCluster, tmp_path):
    proc = slurm.run(["srun", "-J", "detect", "-n2", "--kill-on-bad-exit=1", sys.executable, "-c", DETECT],
                     env=worker_env(), cwd=str(tmp_path), timeout=90)
    infos = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                   key=lambda info: info["rank"])
    assert len(infos) == 2, proc.stdout + proc.stderr
    for rank, info in enumerate(infos):
        assert info["source"] == "slurm", info
        assert (info["rank"], info["local_rank"], info["world_size"], info["local_world_size"]) == (rank, rank, 2, 2)
        assert (info["node_rank"], info["num_nodes"]) == (0, 1), info
        assert info["master_addr"] == slurm.host, info
        assert 10000 <= info["master_port"] < 30000, info
    assert infos[0]["master_port"] == infos[1]["master_port"]


def write_script(path: pathlib.Path, *lines: str) -> str:
    path.write_text("#!/bin/bash\nset -e\n" + "\n".join(lines) + "\n")
    return str(path)


def results(out: pathlib.Path) -> list[dict]:
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


def assert_trained_together(ranks: list[dict], source: str) -> None:
    for rank, seen in enumerate(ranks):
        assert seen["rank"] == rank and seen["num_processes"] == 2 and seen["source"] == source, seen
        assert seen["distributed_type"] == "MULTI_CPU" and seen["reduced"] == 3.0, seen
    assert ranks[0]["weights"] == ranks[1]["weights"], "DDP must leave identical weights on both ranks"


def run_batch(slurm: SlurmTestCluster, tmp_path: pathlib.Path, body: str, *options: str) -> dict[str, str]:
    script = write_script(tmp_path / "job.sh", body)
    job = slurm.sbatch(script, "-J", "train", "-o", str(tmp_path / "slurm-%j.out"), *options, cwd=str(tmp_path),
                       env=worker_env())
    return slurm.wait_state(job, {"COMPLETED"}, timeout=150)


LAUNCH = f"{sys.executable} -m torchrig.launch"


@pytest.mark.timeout(180)
def test_sbatch_srun_trains_two_slurm_tasks(slurm: SlurmTestCluster, tmp_path):
    record = run_batch(slurm, tmp_path, f"srun {sys.executable} -u {WORKER} plain {tmp_path}", "-n2")
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", record
    assert_trained_together(results(tmp_path), "slurm")


@pytest.mark.timeout(180)
def test_torchrig_launch_in_a_batch_script_hands_the_allocation_to_srun(slurm: SlurmTestCluster, tmp_path):
    record = run_batch(slurm, tmp_path, f"{LAUNCH} {WORKER} plain {tmp_path}", "-n2")
    output = slurm.output(record)
    assert "handing off to srun: srun --nodes=1 --ntasks-per-node=2 --ntasks=2" in output, output
    status = json.loads(next((tmp_path / "torchrig_logs").glob("*/run_status.json")).read_text())
    assert (status["state"], status["exit_code"], status["plan"]["handed_off_to"]) == ("finished", 0, "srun"), status
    ranks = results(tmp_path)
    assert_trained_together(ranks, "slurm")
    assert all(seen["environ"]["TORCHELASTIC_RUN_ID"] is None for seen in ranks), ranks


@pytest.mark.timeout(180)
def test_srun_torchrig_launch_is_the_node_agent_of_torch_elastic(slurm: SlurmTestCluster, tmp_path):
    record = run_batch(slurm, tmp_path, f"srun {LAUNCH} --num_processes 2 {WORKER} plain {tmp_path}", "-n1", "-c2")
    assert "handing off" not in slurm.output(record)
    ranks = results(tmp_path)
    assert_trained_together(ranks, "torchelastic")
    assert all(seen["environ"]["TORCHELASTIC_RUN_ID"] for seen in ranks), ranks


def submit(slurm: SlurmTestCluster, tmp_path: pathlib.Path, *args: str, env: dict[str, str] | None = None) -> int:
    """``torchrig launch --cluster slurm ...`` from outside any allocation; the job id it printed."""
    proc = slurm.run([sys.executable, "-m", "torchrig.launch", "--cluster", "slurm", *args], cwd=str(tmp_path),
                     env=worker_env(**(env or {})), timeout=90)
    line = next((line for line in proc.stdout.splitlines() if "submitted Slurm job" in line), None)
    assert line is not None, proc.stdout + proc.stderr
    assert "squeue -j" in proc.stdout and "tail -f" in proc.stdout, proc.stdout
    return int(line.split("submitted Slurm job ", 1)[1].split()[0])


@pytest.mark.timeout(180)
def test_launch_cluster_slurm_submits_a_batch_job_that_trains(slurm: SlurmTestCluster, tmp_path):
    job = submit(slurm, tmp_path, "--num_processes", "2", str(WORKER), "plain", str(tmp_path),
                 env={"TORCHRIG_SLURM__JOB_NAME": "submitted", "TORCHRIG_SLURM__TIME": "10"})
    record = slurm.wait_state(job, {"COMPLETED"}, timeout=150)
    assert (record["JobName"], record["NumTasks"], record["TimeLimit"]) == ("submitted", "2", "00:10:00"), record
    assert record["StdOut"].endswith(f"slurm-{job}.out") and "torchrig_logs" in record["StdOut"], record
    status = json.loads((pathlib.Path(record["StdOut"]).parent / "run_status.json").read_text())
    assert (status["state"], status["headline"]) == ("submitted", f"submitted Slurm job {job}"), status
    assert_trained_together(results(tmp_path), "slurm")


def wait_for_steps(log: pathlib.Path, steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"{log} did not reach {steps} steps in {timeout:g}s")


@pytest.mark.timeout(300)
def test_a_preempted_job_checkpoints_requeues_and_resumes_bit_identically(slurm: SlurmTestCluster, tmp_path):
    import torch

    preemption = {"TORCHRIG_PREEMPTION__SIGNALS": "SIGUSR1", "TORCHRIG_PREEMPTION__REQUEUE": "true"}
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    for project in (straight, preempted):
        project.mkdir()
    args = ["--num_processes", "2", str(PREEMPTIBLE), "--steps", "30", "--delay", "0.25"]
    job = submit(slurm, tmp_path, *args[:3], str(preempted), *args[3:], env=preemption)
    wait_for_steps(preempted / "log-rank0.jsonl", 5, timeout=90)
    slurm.run(["scancel", "--signal=USR1", str(job)])  # to the tasks of the job's steps, as --signal=USR1@N does
    pending = slurm.wait_requeued(job, timeout=60)
    assert pending["Reason"] == "BeginTime", pending  # requeued by the job itself (scontrol requeue), held by Slurm
    committed = sorted(p.name for p in (preempted / "checkpoints").iterdir())
    assert committed, "the preemption checkpoint must be committed before the job is requeued"
    record = slurm.wait_state(job, {"COMPLETED"}, timeout=120)
    output = slurm.output(record)
    assert int(record["Restarts"]) == 1, record
    resumed = sorted({int(line.split()[-1]) for line in output.splitlines() if line.startswith("resumed at step")})
    assert len(resumed) == 1 and 5 <= resumed[0] < 30, output

    reference = submit(slurm, tmp_path, *args[:3], str(straight), *args[3:], env=preemption)
    slurm.wait_state(reference, {"COMPLETED"}, timeout=150)
    a = torch.load(straight / "final.pt", weights_only=True)["params"]
    b = torch.load(preempted / "final.pt", weights_only=True)["params"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed run must equal a straight one"


# --------------------------------------------------------------------------------------------
# issue 40: hostile values reach the real sbatch, bash and srun exactly; sbatch's own failure is named

ECHO = TESTS / "cluster_scripts" / "echo_argv.py"
MARKER = "PWNED"
#: Each would run ``touch PWNED`` (in whatever directory) if a shell or sbatch's parser misread it.
PAYLOADS = ["$(touch PWNED)", "`touch PWNED`", "a; touch PWNED", "a\ntouch PWNED", "it's \"quoted\" \\ back",
            "with  space", "x\n#SBATCH --wrap=touch PWNED", "#SBATCH --wrap='touch PWNED'",
            "50% %j & | > < * ? ~ ! {a,b} packjob hetjob #x"]


def squeue_field(slurm: SlurmTestCluster, job: int, field: str) -> str:
    proc = slurm.run(["squeue", "--states=all", "-h", "-j", str(job), "-O", f"{field}:2000"])
    return proc.stdout.rstrip("\n").rstrip(" ")


@pytest.mark.timeout(180)
def test_a_submitted_job_receives_every_hostile_value_exactly_and_nothing_runs(slurm: SlurmTestCluster, tmp_path):
    project = tmp_path / "proj $(touch PWNED) 'q' \"d\" ;`touch PWNED`#"
    results = tmp_path / "results"
    for path in (project, results):
        path.mkdir()
    script = project / "train $(touch PWNED) `touch PWNED`\n;'q' #.py"
    script.write_text(ECHO.read_text())
    job_name = "j$(touch${IFS}PWNED)`touch${IFS}PWNED`;#\"q'\\packjob"
    comment = "--comment=" + " ".join(p for p in PAYLOADS if "\n" not in p)
    output = str(project / "o %j $(touch PWNED) `x` ; #z.out")
    section = {"job_name": job_name, "output": output, "sbatch_args": [comment], "srun_args": [f"--chdir={project}"]}
    config = project / "run $(touch PWNED)\n'q'.yaml"
    config.write_text(json.dumps({"slurm": section}))
    log_dir = project / "logs $(touch PWNED) %j \"d\" #"
    args = ["--num_processes", "2", "--config_file", str(config), "--log_dir", str(log_dir), str(script),
            str(results), *PAYLOADS]
    dry = slurm.run([sys.executable, "-m", "torchrig.launch", "--cluster", "slurm", "--dry-run", *args],
                    cwd=str(project), env=worker_env(), timeout=90)
    job = submit(slurm, project, *args)
    record = slurm.wait_state(job, {"COMPLETED"}, timeout=150)
    assert record["ExitCode"] == "0:0", record
    # the dry run printed the script that was submitted, verbatim
    printed = dry.stdout[dry.stdout.index("#!/bin/bash\n"):]
    assert printed == (log_dir / "sbatch.sh").read_text() + "\n", printed
    for rank in (0, 1):
        seen = json.loads((results / f"rank-{rank}.json").read_text())
        assert seen["argv"] == [str(script), str(results), *PAYLOADS], seen["argv"]
        assert seen["cwd"] == str(project), seen
        assert seen["environ"]["TORCHRIG_CONFIG_FILE"] == str(config), seen
        assert seen["environ"]["SLURM_JOB_NAME"] == job_name, seen
    assert squeue_field(slurm, job, "Name") == job_name
    assert squeue_field(slurm, job, "Comment") == comment.split("=", 1)[1]
    assert (project / f"o {job} $(touch PWNED) `x` ; #z.out").exists(), sorted(p.name for p in project.iterdir())
    status = json.loads((log_dir / "run_status.json").read_text())
    assert status["state"] == "submitted", status
    assert not list(tmp_path.rglob(MARKER)), list(tmp_path.rglob(MARKER))


@pytest.mark.timeout(120)
def test_a_derived_job_name_and_default_output_reach_slurm_sanitised_and_literal(slurm: SlurmTestCluster, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    script = tmp_path / "my train\n$(touch PWNED).py"
    script.write_text(ECHO.read_text())
    log_dir = tmp_path / "logs 50%j"
    job = submit(slurm, tmp_path, "--num_processes", "1", "--log_dir", str(log_dir), str(script), str(results))
    slurm.wait_state(job, {"COMPLETED"}, timeout=120)
    assert squeue_field(slurm, job, "Name") == "torchrig-my_train___touch_PWNED_"
    assert (log_dir / f"slurm-{job}.out").exists(), sorted(p.name for p in log_dir.iterdir())
    assert not list(tmp_path.rglob(MARKER))


@pytest.mark.timeout(120)
def test_when_sbatch_rejects_the_job_its_exit_code_and_stderr_are_the_diagnosis(slurm: SlurmTestCluster, tmp_path):
    log_dir = tmp_path / "logs"
    proc = slurm.run([sys.executable, "-m", "torchrig.launch", "--cluster", "slurm", "--log_dir", str(log_dir),
                      str(ECHO), str(tmp_path)], cwd=str(tmp_path), check=False, timeout=90,
                     env=worker_env(TORCHRIG_SLURM__PARTITION="nosuchpartition"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "sbatch rejected the job (exit 1)" in proc.stderr and "invalid partition" in proc.stderr.lower(), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    status = json.loads((log_dir / "run_status.json").read_text())
    assert (status["state"], status["reason"]) == ("failed", "sbatch_failed"), status
    assert status["handoff"]["exit_code"] == 1 and "invalid partition" in status["handoff"]["stderr"].lower(), status
    assert "sbatch rejected the job (exit 1)" in status["headline"], status
    assert "did not all finish" not in json.dumps(status), status
