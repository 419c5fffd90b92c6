"""``torchrig launch`` handing the ranks to Slurm or MPI, seen through ``--dry-run`` (nothing started).

The real runs (sbatch, srun, mpirun) are in tests/builtins/test_slurm.py and tests/builtins/test_mpi.py; here the
generated batch script, ``srun`` and ``mpirun`` lines, and the configuration errors, exactly.
"""

from __future__ import annotations

import io
import os
import shlex
import sys

import pytest
from torchrig.launch.cli import main, run_launch

#: The batch script of `sbatch -N2 --ntasks-per-node=2 job.sh` (no step: not an srun task).
BATCH_SCRIPT = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "4",
                "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_PROCID": "0",
                "SLURM_JOB_NAME": "train"}
#: A task of `srun torchrig launch ...`: a regular step.
SRUN_TASK = BATCH_SCRIPT | {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHRIG_", "OMPI_", "PMI_", "MASTER_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('train')\n")
    return tmp_path


def dry_run(*argv: str) -> str:
    out = io.StringIO()
    assert run_launch(["--dry-run", "--log_dir", "logs", *argv], stdout=out) == 0
    return out.getvalue()


def handoff(text: str) -> str:
    assert "Hand-off" in text, text
    return text.split("Hand-off", 1)[1]


def test_outside_an_allocation_cluster_slurm_prints_the_batch_script(workdir, monkeypatch):
    monkeypatch.setenv("TORCHRIG_PREEMPTION__SIGNALS", "SIGUSR1")
    monkeypatch.setenv("TORCHRIG_PREEMPTION__REQUEUE", "true")
    (workdir / "run.yaml").write_text(
        "slurm:\n  nodes: 2\n  partition: gpu\n  account: proj7\n  time: '1-02:00:00'\n  cpus_per_task: 8\n  gpus_per_task: 1\n"
        "  signal_seconds: 300\n  sbatch_args: ['--mem=64G', '--qos=high']\n  srun_args: '--mpi=none'\n")
    text = handoff(dry_run("--config_file", "run.yaml", "--cluster", "slurm", "--num_processes", "8", "train.py",
                           "--lr", "0.1"))
    script = [line.strip() for line in text.splitlines()]
    log_dir = os.path.join(str(workdir), "logs")
    assert f"Slurm: `torchrig launch` would write this batch script to {log_dir}/sbatch.sh and submit it with " \
           "sbatch (verbatim, to the end of this output):\n#!/bin/bash\n" in text
    start = script.index("#!/bin/bash")
    assert script[start:start + 16] == [
        "#!/bin/bash", "#SBATCH --job-name=torchrig-train", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
        "#SBATCH --cpus-per-task=8", "#SBATCH --gpus-per-task=1", "#SBATCH --time=1-02:00:00",
        "#SBATCH --partition=gpu", "#SBATCH --account=proj7", f"#SBATCH --output={log_dir}/slurm-%j.out",
        "#SBATCH --signal=USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --mem=64G",
        "#SBATCH --qos=high", "",
    ]
    assert f"cd {shlex.quote(str(workdir))}" in script
    assert any(line.startswith(f"export TORCHRIG_CONFIG_FILE={workdir}/run.yaml") for line in script), script
    assert any(line.startswith("export TORCHRIG_LAUNCH_OVERRIDES=") and '"cluster"' in line for line in script)
    assert f"exec srun --nodes=2 --ntasks-per-node=4 --ntasks=8 --cpus-per-task=8 --kill-on-bad-exit=1 --mpi=none " \
           f"{sys.executable} -u train.py --lr 0.1" in script
    assert "Environment of each rank" not in text


def test_without_preemption_there_is_no_signal_nor_requeue_and_defaults_apply(workdir):
    text = handoff(dry_run("--cluster", "slurm", "--num_processes", "2", "train.py"))
    assert "#SBATCH --nodes=1" in text and "#SBATCH --ntasks-per-node=2" in text
    for absent in ("--signal", "--requeue", "--time", "--partition", "--account", "--cpus-per-task", "--gpus"):
        assert absent not in text, text


def test_outside_an_allocation_without_cluster_slurm_torch_elastic_runs_here(workdir):
    text = dry_run("--num_processes", "2", "train.py")
    assert "Hand-off" not in text and "Environment of each rank" in text


def test_in_a_batch_script_the_launch_is_one_srun_step_over_the_allocation(workdir, monkeypatch):
    for name, value in BATCH_SCRIPT.items():
        monkeypatch.setenv(name, value)
    text = handoff(dry_run("train.py"))
    assert "inside Slurm job" in text
    assert f"srun --nodes=2 --ntasks-per-node=2 --ntasks=4 --kill-on-bad-exit=1 {sys.executable} -u train.py" in text
    # num_processes / num_machines given: they win over the allocation's tasks
    text = handoff(dry_run("--num_processes", "2", "train.py"))
    assert f"srun --nodes=2 --ntasks-per-node=1 --ntasks=2 --kill-on-bad-exit=1 {sys.executable} -u train.py" in text


def test_in_an_srun_task_torchrig_launch_is_the_node_agent(workdir, monkeypatch):
    for name, value in SRUN_TASK.items():
        monkeypatch.setenv(name, value)
    text = dry_run("--num_processes", "2", "train.py")
    assert "Hand-off" not in text and "Environment of each rank" in text


def test_cluster_mpi_prints_the_mpirun_line(workdir, monkeypatch):
    monkeypatch.setenv("TORCHRIG_MPI__HOSTS", "a:2 b:2")
    monkeypatch.setenv("TORCHRIG_MPI__MPIRUN_ARGS", "--oversubscribe")
    text = handoff(dry_run("--cluster", "mpi", "--num_processes", "4", "--main_process_port", "29511",
                           "-m", "json.tool"))
    assert ("mpirun -np 4 -H a:2,b:2 -x MASTER_ADDR=a -x MASTER_PORT=29511 -x PATH -x TORCHRIG_LAUNCH_OVERRIDES "
            f"--oversubscribe {sys.executable} -u -m json.tool") in text, text


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("TORCHRIG_SLURM__TIME", "soon", "slurm.time (environment TORCHRIG_SLURM__TIME): expected a Slurm time limit"),
    ("TORCHRIG_SLURM__CPUS_PER_TASK", "0", "slurm.cpus_per_task (environment TORCHRIG_SLURM__CPUS_PER_TASK): must "
                                          "be at least 1"),
    ("TORCHRIG_SLURM__PARTITION", "a b", "slurm.partition (environment TORCHRIG_SLURM__PARTITION): expected one word"),
    ("TORCHRIG_SLURM__SIGNAL_SECONDS", "70000", "slurm.signal_seconds (environment TORCHRIG_SLURM__SIGNAL_SECONDS): "
                                               "must be between 1 and 65535"),
    ("TORCHRIG_SLURM__SBATCH_ARGS", "mem=1G", "slurm.sbatch_args (environment TORCHRIG_SLURM__SBATCH_ARGS): expected "
                                             "command-line options"),
    ("TORCHRIG_MPI__MPIRUN_ARGS", "x", "mpi.mpirun_args (environment TORCHRIG_MPI__MPIRUN_ARGS): expected "
                                      "command-line options"),
])
def test_bad_values_are_usage_errors_naming_the_key(workdir, monkeypatch, capsys, variable, value, message):
    monkeypatch.setenv(variable, value)
    assert main(["--cluster", "slurm", "--dry-run", "train.py"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_processes_that_do_not_divide_over_the_nodes_are_refused(workdir, monkeypatch, capsys):
    monkeypatch.setenv("TORCHRIG_SLURM__NODES", "2")
    assert main(["--dry-run", "--cluster", "slurm", "--num_processes", "3", "train.py"]) == 2
    assert "slurm: num_processes 3 does not divide over slurm.nodes 2" in capsys.readouterr().err
    monkeypatch.delenv("TORCHRIG_SLURM__NODES")
    for name, value in BATCH_SCRIPT.items():
        monkeypatch.setenv(name, value)
    assert main(["--dry-run", "--num_processes", "3", "train.py"]) == 2
    assert "slurm: 3 processes do not divide over the allocation's 2 nodes" in capsys.readouterr().err
