"""Issue 34, "the no_trainer scripts": transformers' ``run_*_no_trainer.py`` are written for Accelerate; after
``sed -E 's/\\baccelerate\\b/torchrig/g'`` on the script and its launch command they must run under
``torchrig launch`` on 1 and 2 CPU processes, with ``--with_tracking``, ``--checkpointing_steps`` then
``--resume_from_checkpoint``, ``--gradient_accumulation_steps`` and ``--mixed_precision bf16``.

Inputs are built offline by ``tests/end_to_end/no_trainer/build_inputs.py`` (a locally trained tokenizer, tiny models saved with
``save_pretrained``, csv/json files); ``tests/end_to_end/no_trainer/stand_ins/evaluate`` stands in for the ``evaluate`` package,
whose ``load`` fetches metric scripts from the Hub. Two sets of scripts run:

* ``tests/end_to_end/no_trainer/run_task_no_trainer.py``: torchrig's own script that makes the no_trainer scripts' Accelerate
  calls in their order (clm, mlm and glue tasks), always run;
* transformers' own scripts, from a transformers checkout named by ``TORCHRIG_TRANSFORMERS_EXAMPLES`` (its
  ``examples/pytorch`` folder, at the tag of the installed transformers). They are not in this repository (they are
  transformers' code); without the variable those tests are skipped with the command that gets them.

Every run has a hard timeout and the process guard checks that no launcher or rank outlives the test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "no_trainer"
SCRIPT = HERE / "run_task_no_trainer.py"
STAND_INS = HERE / "stand_ins"
RUN_TIMEOUT = 240  # seconds one run may take (a 2-rank run of a tiny model takes ~30-45 s on 2 shared cores)
EPOCH_LINE = re.compile(r"^(?:\[rank(\d+)\]: )?epoch (\d+): (\{.*\})$", re.MULTILINE)
UPSTREAM_ENV = "TORCHRIG_TRANSFORMERS_EXAMPLES"

pytestmark = pytest.mark.multiprocess


def rename(text: str) -> str:
    """The whole migration, as the issue states it."""
    return re.sub(r"\baccelerate\b", "torchrig", text)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The offline models, tokenizer and data files, built once for the module in a child process (so the test
    process does not import transformers)."""
    root = tmp_path_factory.mktemp("no-trainer-inputs")
    done = subprocess.run([sys.executable, str(HERE / "build_inputs.py"), str(root)], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, env=_environment(root))
    assert done.returncode == 0, done.stderr[-4000:]
    return {line.split()[0]: Path(line.split()[1]) for line in done.stdout.splitlines() if line.count(" ") == 1}


def _environment(tmp_path: Path) -> dict[str, str]:
    """No TORCHRIG_* settings from the caller (a private config home), one thread per process, no network, and the
    ``evaluate`` stand-in first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", WANDB_MODE="offline",
               WANDB_SILENT="true", TOKENIZERS_PARALLELISM="false", DISABLE_TELEMETRY="1",
               PYTHONPATH=os.pathsep.join([str(STAND_INS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> Run:
        assert self.returncode == 0, (f"exit {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n"
                                      f"--- stderr\n{self.stderr[-6000:]}")
        return self

    def epochs(self) -> dict[int, dict]:
        """The ``epoch N: {...}`` metric lines; only the main process may print them."""
        found = EPOCH_LINE.findall(self.stdout)
        assert {rank or "0" for rank, _, _ in found} <= {"0"}, self.stdout[-3000:]
        return {int(epoch): json.loads(metrics) for _, epoch, metrics in found}


def run_script(script: Path, processes: int, args: list[str], workdir: Path, guard, launch: list[str] = (),
               env: dict[str, str] | None = None) -> Run:
    """Copy ``script`` renamed into ``workdir`` and run it there: ``python script.py`` on one process, otherwise the
    ``accelerate launch --cpu --num_processes N`` command renamed like the script (``torchrig launch`` ->
    ``python -m torchrig launch``, this interpreter). The launcher and its ranks are tracked by the guard."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / script.name).write_text(rename(script.read_text()))
    log_dir = workdir / f"launch-logs-{len(list(workdir.glob('launch-logs-*')))}"
    if processes == 1 and not launch:
        command = [sys.executable, script.name, *args]
    else:
        accelerate_command = shlex.join(["accelerate", "launch", "--cpu", "--num_processes", str(processes),
                                         *launch, script.name, *args])
        renamed = shlex.split(rename(accelerate_command))
        assert renamed[:2] == ["torchrig", "launch"], renamed
        command = [sys.executable, "-m", "torchrig", "launch", "--log_dir", str(log_dir), *renamed[2:]]
    proc = subprocess.Popen(command, cwd=workdir, env={**_environment(workdir), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    guard.track(proc)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        status = log_dir / "run_status.json"
        if status.exists():
            for rank in json.loads(status.read_text()).get("ranks", []):
                if rank.get("pid"):
                    guard.track(int(rank["pid"]))
    return Run(proc.returncode, stdout, stderr)


def task_args(task: str, inputs: dict[str, Path], *extra: str) -> list[str]:
    data = "pairs" if task == "glue" else "text"
    model = {"clm": "gpt2", "mlm": "bert-mlm", "glue": "bert-classifier"}[task]
    return ["--task", task, "--model_name_or_path", str(inputs[model]), "--train_file", str(inputs[f"{data}-train"]),
            "--validation_file", str(inputs[f"{data}-validation"]), "--seed", "0", *extra]


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_clm_bf16_accumulation_tracking_checkpoint_then_resume_on_2_processes(inputs, tmp_path, process_guard):
    """The issue's whole list in one 2-rank run and its resume: bf16, 2 micro-batches per step, every tracker
    (``--report_to all``) written by rank 0, a checkpoint every 2 optimizer steps; resuming from ``step_2`` into the
    same ``--output_dir`` finishes with the same evaluation loss and bit-identical saved weights as the
    uninterrupted run."""
    common = ["--gradient_accumulation_steps", "2", "--checkpointing_steps", "2", "--with_tracking"]
    launch = ["--mixed_precision", "bf16"]
    first = run_script(SCRIPT, 2, task_args("clm", inputs, *common, "--output_dir", "full"), tmp_path, process_guard,
                       launch).check()
    out = tmp_path / "full"
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2", "step_4"], sorted(os.listdir(out))
    assert (out / "step_2" / "torchrig_checkpoint.json").exists()
    metrics_csv = (out / "clm_no_trainer" / "metrics.csv").read_text()
    assert "eval_loss" in metrics_csv and "train_loss" in metrics_csv, metrics_csv
    assert list((out / "clm_no_trainer").glob("events.out.tfevents.*")), "no tensorboard events"
    assert "optimizer step 5 (epoch 0)" in first.stdout and "optimizer step 6" not in first.stdout

    weights = (out / "model.safetensors").read_bytes()
    # Resumed as users do, with the same --output_dir: step_4 is saved again over the first run's (Accelerate
    # overwrites; torchrig refused it before a resumed run could replace its own checkpoints).
    resumed = run_script(SCRIPT, 2, task_args("clm", inputs, *common, "--output_dir", "full",
                                              "--resume_from_checkpoint", str(out / "step_2")),
                         tmp_path, process_guard, launch).check()
    assert "Resumed from checkpoint" in resumed.stdout
    assert "optimizer step 3 (epoch 0)" in resumed.stdout and "optimizer step 2 " not in resumed.stdout
    assert resumed.epochs() == first.epochs(), (resumed.epochs(), first.epochs())
    assert (out / "model.safetensors").read_bytes() == weights
    assert "replacing" in resumed.stdout + resumed.stderr and (out / "step_4" / "torchrig_checkpoint.json").exists()


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_glue_epoch_checkpoints_resume_and_every_validation_row_counted_once(inputs, tmp_path, process_guard):
    """Sentence-pair classification on 2 ranks with the evaluate stand-in: the 13 validation rows are each counted
    once (gather_for_metrics drops rank 1's padding), ``--checkpointing_steps epoch`` saves ``epoch_0`` and
    ``epoch_1``, and resuming from ``epoch_0`` runs epoch 1 alone and ends with the same metrics and weights."""
    common = ["--num_train_epochs", "2", "--checkpointing_steps", "epoch"]
    first = run_script(SCRIPT, 2, task_args("glue", inputs, *common, "--output_dir", "full"), tmp_path,
                       process_guard).check()
    printed = first.epochs()
    assert sorted(printed) == [0, 1] and all(m["samples"] == 13 for m in printed.values()), printed
    assert sorted(p.name for p in (tmp_path / "full").glob("epoch_*")) == ["epoch_0", "epoch_1"]

    resumed = run_script(SCRIPT, 2, task_args("glue", inputs, *common, "--output_dir", "resumed",
                                              "--resume_from_checkpoint", str(tmp_path / "full" / "epoch_0")),
                         tmp_path, process_guard).check()
    assert resumed.epochs() == {1: printed[1]}, (resumed.epochs(), printed)
    assert ((tmp_path / "resumed" / "model.safetensors").read_bytes()
            == (tmp_path / "full" / "model.safetensors").read_bytes())

    # Accelerate resumes a 2-process checkpoint on one process; torchrig refuses it unless the configuration
    # allows it, which such a script (it cannot pass load_state(allow_world_size_change=True)) takes from the
    # environment.
    refused = run_script(SCRIPT, 1, task_args("glue", inputs, *common, "--output_dir", "one",
                                              "--resume_from_checkpoint", str(tmp_path / "full" / "epoch_0")),
                         tmp_path, process_guard)
    assert refused.returncode != 0 and "allow_world_size_change" in refused.stderr, refused.stderr[-3000:]
    one = run_script(SCRIPT, 1, task_args("glue", inputs, *common, "--output_dir", "one",
                                          "--resume_from_checkpoint", str(tmp_path / "full" / "epoch_0")),
                     tmp_path, process_guard, env={"TORCHRIG_PROJECT_CONFIG__ALLOW_WORLD_SIZE_CHANGE": "1"}).check()
    assert sorted(one.epochs()) == [1] and one.epochs()[1]["samples"] == 13, one.epochs()


@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_mlm_on_one_process_without_the_launcher(inputs, tmp_path, process_guard):
    """``python run_mlm...py`` (no launcher) with accumulation and a checkpoint, as a user first tries it."""
    run = run_script(SCRIPT, 1, task_args("mlm", inputs, "--gradient_accumulation_steps", "2",
                                          "--checkpointing_steps", "3", "--output_dir", "out"),
                     tmp_path, process_guard).check()
    assert sorted(run.epochs()) == [0] and run.epochs()[0]["eval_loss"] > 0
    assert (tmp_path / "out" / "step_3" / "torchrig_checkpoint.json").exists()
    assert (tmp_path / "out" / "model.safetensors").exists()


# transformers' own scripts: (path under examples/pytorch, task whose inputs it takes, extra flags).
UPSTREAM = [
    pytest.param("language-modeling/run_clm_no_trainer.py", "clm", ["--block_size", "16"], id="run_clm_no_trainer"),
    pytest.param("language-modeling/run_mlm_no_trainer.py", "mlm", ["--max_seq_length", "16"],
                 id="run_mlm_no_trainer"),
    pytest.param("text-classification/run_glue_no_trainer.py", "glue", ["--max_length", "32"],
                 id="run_glue_no_trainer"),
]


def _upstream_script(relative: str) -> Path:
    root = os.environ.get(UPSTREAM_ENV)
    if not root:
        pytest.skip(f"{UPSTREAM_ENV} is not set: point it at examples/pytorch of a transformers checkout at the "
                    f"installed version (git clone --depth 1 --branch v<version> "
                    f"https://github.com/huggingface/transformers) to run transformers' own scripts")
    script = Path(root) / relative
    if not script.is_file():
        pytest.fail(f"{UPSTREAM_ENV}={root}: no {relative} there (it should be transformers' examples/pytorch)")
    return script


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("relative, task, extra", UPSTREAM)
def test_transformers_script_checkpoints_and_resumes_on_2_processes(relative, task, extra, inputs, tmp_path,
                                                                    process_guard):
    """transformers' script, renamed, under ``torchrig launch --cpu --num_processes 2 --mixed_precision bf16`` with
    tracking, accumulation and a checkpoint every 2 steps, then resumed from ``step_2``."""
    script = _upstream_script(relative)
    args = task_args(task, inputs, *extra, "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
                     "--num_train_epochs", "1", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "2",
                     "--with_tracking", "--report_to", "tensorboard")[2:]  # no --task: that flag is ours
    for utility in script.parent.glob("utils_*.py"):
        (tmp_path / utility.name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / utility.name).write_text(rename(utility.read_text()))
    run_script(script, 2, [*args, "--output_dir", "full"], tmp_path, process_guard, ["--mixed_precision", "bf16"]
               ).check()
    assert (tmp_path / "full" / "step_2" / "torchrig_checkpoint.json").exists()
    resumed = run_script(script, 2, [*args, "--output_dir", "resumed", "--resume_from_checkpoint",
                                     str(tmp_path / "full" / "step_2")],
                         tmp_path, process_guard, ["--mixed_precision", "bf16"]).check()
    assert "Resumed from checkpoint" in resumed.stdout + resumed.stderr
