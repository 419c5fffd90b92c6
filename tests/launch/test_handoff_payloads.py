"""Hostile values on their way to a generated batch script or command line (issue 40, items 1-5).

Every value that reaches the ``sbatch`` script or the ``srun``/``mpirun`` line — each field of the
``slurm:``/``mpi:`` sections, the script's file name and arguments, the log directory, the working
directory, the environment — must either arrive exactly or be refused by name; nothing may run.
``--dry-run`` must print what runs: pasting the printed ``mpirun`` line (``shlex.split``) gives the
argv the real launch executes. The real jobs under Slurm are in tests/builtins/test_slurm.py; here the
refusals (no process), the printed script, and the real ``mpirun``.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import pytest
from torchrig.config.resolve import resolve_config
from torchrig.errors import ConfigError
from torchrig.launch.cli import main, run_launch
from torchrig.testing import make_host
from torchrig.testing.processes import spawn_in_new_session

ECHO = pathlib.Path(__file__).parents[1] / "builtins" / "cluster_scripts" / "echo_argv.py"
MARKER = "PWNED"


def payloads(marker: pathlib.Path) -> list[str]:
    """What a hostile value looks like: each would run ``touch <marker>`` if a shell saw it unquoted."""
    return [f"$(touch {marker})", f"`touch {marker}`", f"a; touch {marker}", f"a\ntouch {marker}",
            "it's \"quoted\" \\ back", "with  space", f"x\n#SBATCH --wrap=touch {marker}",
            f"#SBATCH --wrap='touch {marker}'", "50% %j & | > < * ? ~ ! {a,b} packjob hetjob"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHRIG_", "OMPI_", "PMI_", "MASTER_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('train')\n")
    return tmp_path


def refused(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}: {err}"
    assert "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------------------------
# item 1: a slurm value that cannot be written into an #SBATCH line is refused by name


@pytest.mark.parametrize("field", ["output", "job_name", "partition", "account", "time"])
@pytest.mark.parametrize("control", ["\n", "\r", "\t", "\x1b", "\x0b"])
def test_a_slurm_value_with_a_line_break_or_control_character_is_refused_naming_the_key(
        workdir, capsys, monkeypatch, field, control):
    monkeypatch.setenv(f"TORCHRIG_SLURM__{field.upper()}", f"x{control}#SBATCH --wrap=touch {workdir / MARKER}")
    err = refused(capsys, "--cluster", "slurm", "--dry-run", "train.py")
    assert f"slurm.{field} (environment TORCHRIG_SLURM__{field.upper()})" in err, err
    assert not (workdir / MARKER).exists()


@pytest.mark.parametrize("key", ["sbatch_args", "srun_args"])
@pytest.mark.parametrize("control", ["\n", "\r", "\x00", "\x1b"])
def test_extra_options_with_control_characters_are_refused_naming_the_key(workdir, capsys, key, control):
    entry = json.dumps("--comment=x" + control + "y")
    (workdir / "run.yaml").write_text(f"slurm:\n  {key}:\n    - {entry}\n")
    err = refused(capsys, "--config_file", "run.yaml", "--cluster", "slurm", "--dry-run", "train.py")
    assert f"slurm.{key} (run.yaml:2:3)" in err and "contains a" in err, err


def test_a_wrap_option_that_would_replace_the_script_is_refused(workdir, capsys):
    (workdir / "run.yaml").write_text(f"slurm:\n  sbatch_args: ['--wrap=touch {workdir / MARKER}']\n")
    err = refused(capsys, "--config_file", "run.yaml", "--cluster", "slurm", "--dry-run", "train.py")
    assert "slurm.sbatch_args (run.yaml:2:3)" in err and "--wrap" in err, err


def test_a_log_dir_with_a_newline_is_refused_naming_the_flag(workdir, capsys):
    err = refused(capsys, "--cluster", "slurm", "--dry-run", "--log_dir", f"logs\ntouch {workdir / MARKER}",
                  "train.py")
    assert "--log_dir" in err and "newline" in err, err


# --------------------------------------------------------------------------------------------
# items 1-3: the printed batch script, parsed the way sbatch and bash parse it


def sbatch_options(script: str) -> list[str]:
    """The options sbatch reads from a script's ``#SBATCH`` lines (Slurm 22.05's ``_opt_batch_script``
    and ``get_argument``: lines up to the first command; quotes group, a backslash escapes, an
    unquoted ``#`` ends the line, ``packjob`` blanks out)."""
    options: list[str] = []
    for line in script.splitlines()[1:]:
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.lstrip().startswith("#"):
                break
            continue
        rest = line[len("#SBATCH"):]
        lowered = rest.lower()
        if "packjob" in lowered:
            at = lowered.index("packjob")
            rest = rest[:at] + " " * 7 + rest[at + 7:]
        i = 0
        while i < len(rest):
            while i < len(rest) and rest[i].isspace():
                i += 1
            if i == len(rest):
                break
            word, quote, escaped = "", "", False
            while i < len(rest) and (quote or not rest[i].isspace()):
                char = rest[i]
                i += 1
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                    continue
                elif quote:
                    if char == quote:
                        quote = ""
                        continue
                elif char in "\"'":
                    quote = char
                    continue
                elif char == "#":
                    i = len(rest)
                    break
                word += char
            assert not quote, f"unmatched quote in {line!r}"
            if word:
                options.append(word)
    return options


def printed_script(text: str) -> str:
    start = text.index("#!/bin/bash\n")
    return text[start:]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_every_slurm_field_file_name_argument_and_path_reaches_sbatch_and_bash_exactly(workdir, monkeypatch):
    marker = workdir / MARKER
    hostile = [p for p in payloads(marker) if "\n" not in p]
    project = workdir / "proj $(touch PWNED) 'q' ;#"
    project.mkdir()
    monkeypatch.chdir(project)
    relative = payloads(pathlib.Path(MARKER))  # a file name cannot hold '/'
    script_name = f"train {relative[0]} {relative[1]}\n{relative[4]}.py"
    (project / script_name).write_text("print('train')\n")
    comment = "--comment=" + " ".join(hostile)
    job_name = "j$(touch${IFS}PWNED)`touch${IFS}PWNED`;#\"q'\\packjob"  # one word: a name has no spaces
    account = "acc;`touch${IFS}PWNED`#hetjob"
    output = str(project / "o %j $(touch PWNED) `x` ; #z.out")
    section = {"job_name": job_name, "account": account, "output": output, "sbatch_args": [comment],
               "srun_args": ["--chdir=" + str(project)]}
    (project / "run.yaml").write_text(json.dumps({"slurm": section}))
    log_dir = project / "logs $(touch PWNED) %j \"d\" #"
    out = io.StringIO()
    assert run_launch(["--dry-run", "--log_dir", str(log_dir), "--config_file", "run.yaml", "--cluster", "slurm",
                       script_name, *payloads(marker)], stdout=out) == 0
    script = printed_script(out.getvalue())
    options = sbatch_options(script)
    assert options[0] == "--job-name=" + job_name, options
    assert "--account=" + account in options and "--output=" + output in options, options
    assert comment in options, options
    # bash: run the script's body up to the srun step with `exec srun` replaced by printing its argv
    body = script.replace("\nexec srun ", "\nprintf '%s\\0' srun ", 1)
    proc = subprocess.run(["bash", "-c", body], capture_output=True, timeout=30, cwd=str(workdir),
                          env={k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")})
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.decode().split("\0")[:-1]
    assert argv[-len(payloads(marker)) - 1:] == [script_name, *payloads(marker)], argv
    assert "--chdir=" + str(project) in argv
    assert not list(workdir.rglob(MARKER))


def test_a_derived_job_name_is_sanitised_and_a_default_output_keeps_the_log_dir_literal(workdir):
    (workdir / "my train\n$(x).py").write_text("print(1)\n")
    out = io.StringIO()
    assert run_launch(["--dry-run", "--log_dir", "logs 50%j", "--cluster", "slurm", "my train\n$(x).py"],
                      stdout=out) == 0
    options = sbatch_options(printed_script(out.getvalue()))
    assert options[0] == "--job-name=torchrig-my_train___x_", options
    # '%' of the directory doubled (Slurm's literal percent); the file name's %j stays a pattern
    assert f"--output={workdir}/logs 50%%j/slurm-%j.out" in options, options


def test_the_dry_run_prints_the_batch_script_verbatim(workdir):
    out = io.StringIO()
    assert run_launch(["--dry-run", "--log_dir", "logs", "--cluster", "slurm", "train.py", "a\n  b"],
                      stdout=out) == 0
    script = printed_script(out.getvalue())
    assert "\n'a\n  b'\n" in script + "\n" or "'a\n  b'" in script, script  # the argument's own line, unindented
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=torchrig-train\n"), script


# --------------------------------------------------------------------------------------------
# item 5: mpi.hosts and the other mpi/slurm fields, through the real config loader


def test_mpi_hosts_as_a_comma_separated_string_means_those_hosts(workdir):
    (workdir / "run.yaml").write_text("mpi:\n  hosts: 'a:1, b:3'\n")
    assert resolve_config(make_host(), config_file="run.yaml").get("mpi.hosts") == ["a:1", "b:3"]
    out = io.StringIO()
    assert run_launch(["--dry-run", "--config_file", "run.yaml", "--cluster", "mpi", "--num_processes", "4",
                       "--main_process_port", "29500", "train.py"], stdout=out) == 0
    assert " -H a:1,b:3 " in out.getvalue(), out.getvalue()


@pytest.mark.parametrize(("yaml", "key", "message"), [
    ("mpi:\n  hosts: 'a;touch x'\n", "mpi.hosts (run.yaml:2:3)", "not a host name"),
    ("mpi:\n  hosts: ['-oProxyCommand=touch x']\n", "mpi.hosts (run.yaml:2:3)", "not a host name"),
    ("mpi:\n  hosts: 'a:x'\n", "mpi.hosts (run.yaml:2:3)", "slots"),
    ("mpi:\n  hosts: 'a:0'\n", "mpi.hosts (run.yaml:2:3)", "slots"),
    ("mpi:\n  hosts: {a: 1}\n", "mpi.hosts (run.yaml:2:3)", "expected a list"),
    ("mpi:\n  mpirun_args: 7\n", "mpi.mpirun_args (run.yaml:2:3)", "expected a list"),
    ("mpi:\n  mpirun_args: [\"--x\\nrm\"]\n", "mpi.mpirun_args (run.yaml:2:3)", "contains a newline"),
    ("slurm:\n  nodes: two\n", "slurm.nodes (run.yaml:2:3)", "expected an integer"),
    ("slurm:\n  output: {a: 1}\n", "slurm.output (run.yaml:2:3)", "expected a string"),
    ("slurm:\n  job_name: 'a b'\n", "slurm.job_name (run.yaml:2:3)", "one word"),
])
def test_bad_mpi_and_slurm_values_name_the_dotted_key_and_file_line(workdir, capsys, yaml, key, message):
    (workdir / "run.yaml").write_text(yaml)
    with pytest.raises(ConfigError) as error:
        resolve_config(make_host(), config_file="run.yaml")
    assert key in str(error.value) and message in str(error.value), str(error.value)
    err = refused(capsys, "--config_file", "run.yaml", "--cluster", "mpi", "--dry-run", "train.py")
    assert key in err and message in err, err


def test_main_process_ip_with_shell_characters_is_refused_for_mpirun(workdir, capsys):
    err = refused(capsys, "--cluster", "mpi", "--dry-run", "--main_process_ip", "h;touch x", "train.py")
    assert "main_process_ip" in err and "'h;touch x'" in err, err


# --------------------------------------------------------------------------------------------
# item 4: --dry-run prints the mpirun line that runs; the ranks receive the exact strings


def printed_mpirun(text: str) -> list[str]:
    """The printed line, pasted: everything from ``mpirun`` to the end of the output, split as a shell does."""
    return shlex.split(text[text.index("\n  mpirun ") + 3:])


def test_the_printed_mpirun_line_splits_back_to_the_argv_for_every_payload(workdir):
    marker = workdir / MARKER
    out = io.StringIO()
    assert run_launch(["--dry-run", "--cluster", "mpi", "--num_processes", "2", "--main_process_port", "29500",
                       "train.py", *payloads(marker)], stdout=out) == 0
    argv = printed_mpirun(out.getvalue())
    assert argv[0] == "mpirun" and argv[-len(payloads(marker)) - 1:] == ["train.py", *payloads(marker)], argv


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed (Debian package openmpi-bin)")
def test_mpirun_runs_exactly_the_printed_line_and_the_ranks_get_the_exact_strings(tmp_path, process_guard):
    marker = tmp_path / MARKER
    cwd = tmp_path / "cwd $(touch PWNED) 'q' ;#"
    results = tmp_path / "results"
    for path in (cwd, results):
        path.mkdir()
    script = cwd / f"echo {payloads(pathlib.Path(MARKER))[0]}\n;'q'.py"
    shutil.copy(ECHO, script)
    args = [str(results), *payloads(marker)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHRIG_"))}
    env |= {"OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "TORCHRIG_MPI__MPIRUN_ARGS": "--oversubscribe", "PYTHONPATH": os.pathsep.join(sys.path)}
    launch = [sys.executable, "-m", "torchrig.launch", "--cluster", "mpi", "--num_processes", "2",
              "--main_process_port", "29517", "--log_dir", str(tmp_path / "logs"), str(script), *args]
    dry = subprocess.run([*launch[:3], "--dry-run", *launch[3:]], capture_output=True, text=True, env=env,
                         cwd=str(cwd), timeout=60)
    assert dry.returncode == 0, dry.stderr
    log = tmp_path / "launch.log"
    with open(log, "w") as handle:
        proc = spawn_in_new_session(launch, guard=process_guard, env=env, cwd=str(cwd), stdout=handle,
                                    stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.returncode == 0, log.read_text()[-4000:]
    status = json.loads((tmp_path / "logs" / "run_status.json").read_text())
    assert printed_mpirun(dry.stdout) == status["plan"]["command"], (dry.stdout, status["plan"]["command"])
    for rank in (0, 1):
        seen = json.loads((results / f"rank-{rank}.json").read_text())
        assert seen["argv"] == [str(script), *args] and seen["cwd"] == str(cwd), seen
    assert not list(tmp_path.rglob(MARKER))


@pytest.mark.parametrize(("cluster", "argv", "named"), [
    ("slurm", ["--log_dir", "logs\ntouch PWNED"], "--log_dir"),
    ("mpi", ["--main_process_ip", "$(touch PWNED)"], "main_process_ip"),
])
def test_a_real_launch_refuses_before_handing_off_exit_2_and_records_why(workdir, capsys, cluster, argv, named):
    assert main(["--cluster", cluster, *argv, "train.py"]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err
    log_dir = argv[1] if named == "--log_dir" else None
    if log_dir is not None:
        status = json.loads((workdir / log_dir / "run_status.json").read_text())
        assert (status["state"], status["reason"], status["exit_code"]) == ("failed", "refused", 2), status
    assert not list(workdir.rglob(MARKER))


def test_an_unbalanced_quote_in_a_string_of_options_names_the_key(workdir, capsys, monkeypatch):
    monkeypatch.setenv("TORCHRIG_SLURM__SRUN_ARGS", "--comment='a")
    err = refused(capsys, "--cluster", "slurm", "--dry-run", "train.py")
    assert "slurm.srun_args (environment TORCHRIG_SLURM__SRUN_ARGS)" in err and "No closing quotation" in err, err


def test_hosts_without_enough_slots_name_mpi_hosts(workdir, capsys, monkeypatch):
    monkeypatch.setenv("TORCHRIG_MPI__HOSTS", "a:1,b:1")
    err = refused(capsys, "--cluster", "mpi", "--num_processes", "3", "--dry-run", "train.py")
    assert "mpi.hosts ['a:1', 'b:1'] cannot hold num_processes 3" in err, err
