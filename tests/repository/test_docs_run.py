"""Every fenced block in docs/*.md runs as written (issue 41, item 11).

The convention, in the block's info string (after the language; GitHub shows only the language):

* ```` ```python ```` — a whole script: run with ``python`` in a fresh directory, exit 0.
* ```` ```yaml ```` — a torchrig configuration file: ``torchrig config validate`` accepts it (the real loader
  and validator, the same messages a user gets).
* ```` ```bash ```` — command lines, in the doc's directory: each ``torchrig`` line in this process (as the
  console script runs it), ``torchrig launch`` with ``--dry-run`` (every flag, config file, plugin and
  parallelism size checked, each rank's environment built; nothing starts); the other lines (``sed``...)
  with ``bash -e``. A block whose info string says ``launch`` runs whole with ``bash -e``, starting for real,
  so it keeps to the smallest settings (2 CPU processes).
* ``file=NAME`` — the block is also written to ``NAME`` in the doc's directory, where the commands of the same
  doc find it (``--config_file NAME``); a script a command names as ``train.py`` is ``examples/train_mlp.py``
  unless the doc writes its own; ``launch.sh`` is an ``accelerate launch`` line.
* ``fragment: <why>`` — not meant to run alone (a method of a class shown above, a cluster's job file, the
  output of a command). It must still parse (python, yaml, toml, json; shell words) and must give its reason.
* ```` ```text ```` — output, usage lines and diagrams: not code.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
import tomllib
import yaml
from torchrig.cli.main import main as torchrig_main
from torchrig.estimate.memory_model import ModelSpecError, resolve_model

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
LANGUAGES = ("python", "yaml", "bash", "toml", "json", "text")
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>.*)$")

#: What a doc's script or launch must leave behind — the effect, not only the exit status — keyed by
#: (doc, a line of the block).
EXPECTED_FILES = {
    ("checkpoints.md", "accelerator.save_state()"): ["runs/exp1/checkpoints/checkpoint_*/torchrig_checkpoint.json"],
    ("preemption.md", "accelerator.save_state()"): ["run42/checkpoints/checkpoint_*/torchrig_checkpoint.json"],
    ("trackers.md", 'log_with=["tensorboard", "wandb"]'): ["runs/exp1/my-project/events.out.tfevents.*",
                                                          "runs/exp1/wandb/offline-run-*/run-*.wandb"],
    ("trackers.md", "class PrintTracker"): ["metrics.txt", "runs/exp2/print-demo/events.out.tfevents.*"],
    ("parallelism.md", "examples/train_tp.py"): ["tp_run/checkpoints/checkpoint_*/torchrig_checkpoint.json"],
}


class Block:
    """One fenced block: where it is, its language, its info-string words, its text."""

    def __init__(self, doc: str, line: int, info: str, text: str) -> None:
        self.doc, self.line, self.text = doc, line, text
        language, _, rest = info.strip().partition(" ")
        self.language = language
        rest = rest.strip()
        self.fragment_reason: str | None = None
        if rest.startswith("fragment"):
            self.fragment_reason = rest.partition(":")[2].strip()
            rest = ""
        words = rest.split()
        self.file = next((word.split("=", 1)[1] for word in words if word.startswith("file=")), None)
        self.launch = "launch" in words
        self.unknown_words = [word for word in words if word != "launch" and not word.startswith("file=")]

    @property
    def fragment(self) -> bool:
        return self.fragment_reason is not None

    @property
    def where(self) -> str:
        return f"docs/{self.doc}:{self.line}"

    def __repr__(self) -> str:
        return self.where


def doc_blocks(path: pathlib.Path) -> list[Block]:
    blocks, lines, index = [], path.read_text().splitlines(), 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if match:
            end = index + 1
            while not lines[end].strip().startswith("```"):
                end += 1
            indent = len(match["indent"])
            body = "\n".join(line[indent:] for line in lines[index + 1:end]) + "\n"
            blocks.append(Block(path.name, index + 1, match["info"], body))
            index = end
        index += 1
    return blocks


ALL_BLOCKS = [block for path in sorted(DOCS.glob("*.md")) for block in doc_blocks(path)]


def call_cli(argv: list[str]) -> tuple[int, str, str]:
    """``torchrig ARGV`` in this process, as the console script runs it: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = torchrig_main(argv)
        except SystemExit as exit_:
            status = exit_.code
    return status, out.getvalue(), err.getvalue()


def blocks(language: str, *, runnable: bool | None = None) -> list[Block]:
    return [block for block in ALL_BLOCKS if block.language == language
            and (runnable is None or runnable != block.fragment)]


def test_every_block_says_what_it_is():
    problems = []
    for block in ALL_BLOCKS:
        if block.language not in LANGUAGES:
            problems.append(f"{block.where}: info string {block.language!r}: say one of {LANGUAGES} "
                            "(text for output, usage lines and diagrams)")
        if block.fragment and not block.fragment_reason:
            problems.append(f"{block.where}: 'fragment' needs its reason: ```{block.language} fragment: <why>")
        if block.unknown_words:
            problems.append(f"{block.where}: unknown info-string words {block.unknown_words}")
        if block.launch and block.language != "bash":
            problems.append(f"{block.where}: 'launch' is for bash blocks")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", blocks("python"), ids=repr)
def test_python_blocks_parse(block):
    ast.parse(block.text, filename=block.where)


@pytest.mark.parametrize("block", blocks("toml") + blocks("json"), ids=repr)
def test_toml_and_json_blocks_parse(block):
    if block.language == "toml":
        tomllib.loads(block.text)
    else:
        json.loads(block.text)


@pytest.mark.parametrize("block", blocks("bash"), ids=repr)
def test_shell_blocks_split_into_words(block):
    for command in shell_commands(block.text):
        assert shlex.split(command, comments=True), f"{block.where}: {command!r}"


@pytest.mark.parametrize("block", blocks("yaml"), ids=repr)
def test_yaml_blocks_pass_the_config_validator(block, tmp_path, monkeypatch):
    """A configuration shown in the docs is one ``torchrig config validate`` accepts; a fragment
    (a Kubernetes manifest, part of a file) must at least be YAML."""
    document = yaml.safe_load(block.text)
    if block.fragment:
        return
    assert isinstance(document, dict), f"{block.where}: a config file is a mapping"
    for name in [name for name in os.environ if name.startswith("TORCHRIG_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / (block.file or "config.yaml")
    path.write_text(block.text)
    status, out, err = call_cli(["config", "validate", str(path)])
    assert status == 0, f"{block.where}: torchrig config validate says:\n{err}{out}"
    assert "valid" in out


def shell_commands(text: str) -> list[str]:
    """Command lines of a shell block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words and not line.lstrip().startswith("#"):
            commands.append(line)
    return commands


def clean_env(home: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "WANDB_"))}
    env.update(TORCHRIG_CONFIG_HOME=str(home), OMP_NUM_THREADS="1", HOME=str(home),
               PATH=os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")]))
    return env


def doc_directory(tmp_path: pathlib.Path, doc: str) -> pathlib.Path:
    """The doc's working directory: its ``file=`` blocks, ``examples/``, and the user's ``train.py`` and
    ``launch.sh`` stood in for."""
    directory = tmp_path / doc.removesuffix(".md")
    directory.mkdir(parents=True)
    (directory / "examples").symlink_to(REPO / "examples")
    shutil.copy(REPO / "examples" / "train_mlp.py", directory / "train.py")
    (directory / "launch.sh").write_text("accelerate launch --num_processes 2 train.py\n")  # "your launch script"
    for block in ALL_BLOCKS:
        if block.doc == doc and block.file:
            (directory / block.file).write_text(block.text)
    return directory


def check_effects(block: Block, directory: pathlib.Path) -> None:
    patterns = [pattern for (doc, line), globs in EXPECTED_FILES.items() if doc == block.doc and line in block.text
                for pattern in globs]
    missing = [pattern for pattern in patterns if not list(directory.glob(pattern))]
    assert not missing, f"{block.where}: ran, but left no {missing} in {directory}"


def run(command: list[str], directory: pathlib.Path, where: str, timeout: int, guard) -> subprocess.CompletedProcess:
    """Run in its own session, tracked by the process guard (nothing may outlive the test); killed whole
    on a timeout."""
    proc = subprocess.Popen(command, cwd=directory, env=clean_env(directory), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    guard.track(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{where} ran past {timeout} s\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-6000:]}")
    result = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
    assert result.returncode == 0, (f"{where} exited {result.returncode}\n--- stdout\n{stdout[-4000:]}\n"
                                    f"--- stderr\n{stderr[-6000:]}")
    return result


SCRIPTS = blocks("python", runnable=True)


#: Runs each (directory, script) given as arguments as ``python script`` would (``__main__``, its directory
#: the working directory and sys.path[0]), one after the other in one interpreter — torch is imported once,
#: not once per script — and reports each one's traceback between markers.
SCRIPT_RUNNER = """
import os, runpy, sys, traceback
failed = 0
for directory, script in zip(sys.argv[1::2], sys.argv[2::2]):
    os.chdir(directory)
    sys.path.insert(0, directory)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            failed += 1
            print(f"@@@ {script}\\nexit status {exit_.code}\\n@@@", file=sys.stderr, flush=True)
    except BaseException:
        failed += 1
        print(f"@@@ {script}\\n{traceback.format_exc()}@@@", file=sys.stderr, flush=True)
    finally:
        sys.path.remove(directory)
sys.exit(1 if failed else 0)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_python_scripts_run(tmp_path, process_guard):
    """Every runnable Python block, as a script in a fresh directory of its own; then the files its doc says
    it writes are there (checkpoints, tracker event files)."""
    arguments, directories = [], []
    for block in SCRIPTS:
        directory = doc_directory(tmp_path / f"line{block.line}", block.doc)
        script = directory / f"doc_block_{block.line}.py"
        script.write_text(block.text)
        arguments += [str(directory), str(script)]
        directories.append(directory)
    run([sys.executable, "-c", SCRIPT_RUNNER, *arguments], tmp_path, f"the scripts of {SCRIPTS}", timeout=400,
        guard=process_guard)
    for block, directory in zip(SCRIPTS, directories):
        check_effects(block, directory)


ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def split_command(command: str) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 torchrig launch ...`` -> ({A: 1, B: 2}, [torchrig, launch, ...])."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


@pytest.fixture
def restored_environ():
    """The launcher's checks may set variables for the workers; put os.environ back as it was."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


COMMAND_BLOCKS = blocks("bash", runnable=True)


# A dry launch starts nothing, but resolves and imports each selected plugin's runtime (seconds on a loaded
# machine): kept with the launches, off the fast tier.
@pytest.mark.multiprocess
@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=repr)
def test_torchrig_command_lines_pass(block, tmp_path, monkeypatch, restored_environ):
    """Every ``torchrig`` line of a runnable shell block, in this process: ``torchrig launch`` with
    ``--dry-run`` (the flags, config file, plugins, parallelism sizes and each rank's environment are
    resolved and checked; nothing starts), the other subcommands as written. Exit status 0."""
    directory = doc_directory(tmp_path, block.doc)
    for name in [name for name in os.environ if name.startswith(("TORCHRIG_", "WANDB_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(directory))
    monkeypatch.chdir(directory)
    ran = 0
    for command in shell_commands(block.text):
        env, words = split_command(command)
        if words[0] != "torchrig":
            continue
        if words[1] == "launch" and "--dry-run" not in words:
            words.insert(2, "--dry-run")
        with monkeypatch.context() as scoped:
            for name, value in env.items():
                scoped.setenv(name, value)
            status, out, err = call_cli(words[1:])
        assert status == 0, f"{block.where}: {command}\nexited {status}:\n{err}{out[-3000:]}"
        ran += 1
    assert ran or any(split_command(c)[1][0] != "torchrig" for c in shell_commands(block.text))


SHELL_RUN_BLOCKS = [block for block in COMMAND_BLOCKS
                    if block.launch or any(split_command(c)[1][0] != "torchrig" for c in shell_commands(block.text))]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", SHELL_RUN_BLOCKS, ids=repr)
def test_shell_blocks_run(block, tmp_path, process_guard):
    """The blocks that start something (``launch``: for real, 2 CPU processes), whole, with ``bash -e`` as a
    user pastes them; of the others, the lines that are not ``torchrig`` (``sed``...), which the in-process
    test above leaves out."""
    directory = doc_directory(tmp_path, block.doc)
    text = block.text if block.launch else "\n".join(
        command for command in shell_commands(block.text) if split_command(command)[1][0] != "torchrig")
    run(["bash", "-e", "-c", text], directory, block.where, timeout=280, guard=process_guard)
    if block.launch:
        check_effects(block, directory)


def test_estimate_memory_suggests_a_download_command_that_is_installed(monkeypatch, tmp_path):
    """Its message for a model name not in the local cache names the Hugging Face CLI to fetch the config
    with: ``hf`` (huggingface_hub's current CLI, installed with transformers), not the retired
    ``huggingface-cli``."""
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelSpecError) as error:
        resolve_model("no-such-org/no-such-model")
    command = re.search(r"fetch it where there is a network \((\S+) download", str(error.value))
    assert command, str(error.value)
    assert shutil.which(command[1]), f"the message suggests {command[1]!r}, which is not installed: {error.value}"


@pytest.mark.parametrize("flags, message", [
    (["--num_processes", "3", "--tp_size", "2", "--dp_shard_size", "-1"],
     "-1 cannot be inferred: the world size 3 is not a multiple of the other sizes' product 2"),
    (["--num_processes", "4", "--tp_size", "2", "--cp_size", "2", "--pp_size", "2"],
     "the sizes multiply to 8 (cp_size=2, tp_size=2, pp_size=2) but the world size is 4"),
], ids=["minus_one_on_3_ranks", "product_8_on_4_ranks"])
def test_parallelism_sizes_that_cannot_fill_the_world_stop_the_launch_before_any_rank(
        flags, message, tmp_path, monkeypatch, restored_environ):
    """docs/parallelism.md, "Checked before anything starts": a real (not dry) launch exits 2 naming the
    flag, in this process, starting nothing (the fast tier fails a test that starts a process)."""
    monkeypatch.chdir(doc_directory(tmp_path, "parallelism.md"))
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path))
    status, _, err = call_cli(["launch", "--use_fsdp", "--cpu", *flags, "examples/train_tp.py"])
    assert status == 2
    assert message in err and "(flag --" in err and "Traceback" not in err, err
