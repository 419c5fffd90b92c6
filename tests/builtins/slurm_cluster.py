"""A real one-node Slurm for the test suite: munged, slurmctld and slurmd started from a temp dir.

Debian's ``slurm-wlm`` (22.05) and ``munge`` packages run without systemd or cgroups
(``ProctrackType=proctrack/linuxproc``); every file (key, sockets, state, spool, logs) lives in
the fixture's directory and the ports are picked free, so nothing of the machine's own
configuration is read or changed. :func:`start_cluster` raises :class:`Unavailable` (the tests
skip with it) when a binary is missing or a daemon does not come up, with the daemon's log tail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence

#: The binaries the fixture needs (Debian: slurm-wlm, munge).
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
START_TIMEOUT_S = 30.0
#: Lifetime of job credentials; a requeued job may start again after it (``AuthInfo=cred_expire``).
CRED_EXPIRE_S = 10
COMMAND_TIMEOUT_S = 30.0
FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                             "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


class Unavailable(Exception):
    """Slurm cannot run here; the message says why (for ``pytest.skip``)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:]).strip() or "(empty)"
    except OSError as exc:
        return f"(no log: {exc})"


def _memory_mb() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


class SlurmTestCluster:
    """munged + slurmctld + slurmd of one node, and the client commands with ``SLURM_CONF`` set."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.host = socket.gethostname()
        self.cpus = len(os.sched_getaffinity(0))
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge", "munge.socket")
        self.logs = {name: os.path.join(self.root, "log", f"{name}.log") for name in ("munged", "slurmctld", "slurmd")}
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._munged_pid: int | None = None
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        for name in [n for n in self.env if n.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if name != "SLURM_CONF":
                del self.env[name]

    # -- start / stop ------------------------------------------------------------------------

    def start(self) -> None:
        missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
        if missing:
            raise Unavailable(f"not installed: {', '.join(missing)} (Debian packages slurm-wlm and munge)")
        if os.geteuid() != 0:
            raise Unavailable("slurmd must run as root (it starts each job as its user); the tests run as "
                              f"uid {os.geteuid()}")
        for sub in ("munge", "log", "state", "spool", "run"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
        try:
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", ["-D", "-f", self.conf])
            self._spawn("slurmd", ["-D", "-f", self.conf, "-N", self.host])
            self._wait_idle()
        except BaseException:
            self.stop()
            raise

    def _binary(self, name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def _start_munge(self) -> None:
        key = os.path.join(self.root, "munge", "munge.key")
        subprocess.run([self._binary("mungekey"), "--create", "--keyfile", key, "--force"], check=True,
                       capture_output=True, timeout=COMMAND_TIMEOUT_S)
        os.chmod(key, 0o400)
        pid_file = os.path.join(self.root, "munge", "munged.pid")
        proc = subprocess.run(
            [self._binary("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={pid_file}", f"--log-file={self.logs['munged']}",
             f"--seed-file={os.path.join(self.root, 'munge', 'munged.seed')}"],
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if proc.returncode != 0:
            raise Unavailable(f"munged did not start (exit {proc.returncode}): {proc.stderr.strip()} "
                              f"{_tail(self.logs['munged'])}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (os.path.exists(self.munge_socket) and os.path.exists(pid_file)):
            if time.monotonic() > deadline:
                raise Unavailable(f"munged did not create its socket in {START_TIMEOUT_S:g}s: "
                                  f"{_tail(self.logs['munged'])}")
            time.sleep(0.1)
        with open(pid_file) as handle:
            self._munged_pid = int(handle.read().strip())

    def _write_conf(self) -> None:
        r = self.root
        lines = [
            "ClusterName=torchrigtest",
            f"SlurmctldHost={self.host}(127.0.0.1)",  # the host name need not resolve
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: how long a requeued job is held (cred_expire + 1 s; Slurm's default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd.pid",
            f"SlurmctldLogFile={self.logs['slurmctld']}",
            f"SlurmdLogFile={self.logs['slurmd']}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=5",
            "MinJobAge=300",
            "MessageTimeout=10",
            "SlurmdTimeout=60",
            f"PlugStackConfig={r}/plugstack.conf",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={min(_memory_mb(), 4096)} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(os.path.join(r, "plugstack.conf"), "w"):
            pass
        with open(self.conf, "w") as handle:
            handle.write("\n".join(lines) + "\n")

    def _spawn(self, name: str, args: Sequence[str]) -> None:
        out = open(os.path.join(self.root, "log", f"{name}.console"), "wb")
        self._daemons[name] = subprocess.Popen([self._binary(name), *args], env=self.env, stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True)
        out.close()

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self._daemons.items():
                if proc.poll() is not None:
                    raise Unavailable(f"{name} exited with {proc.returncode}: {_tail(self.logs[name])} "
                                      f"{_tail(os.path.join(self.root, 'log', name + '.console'))}")
            result = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=10)
            state = result.stdout.strip()
            if result.returncode == 0 and state.rstrip("*") == "idle":
                return
            time.sleep(0.5)
        raise Unavailable(f"the Slurm node is not idle after {START_TIMEOUT_S:g}s (sinfo: {state!r}); "
                          f"slurmctld: {_tail(self.logs['slurmctld'])}; slurmd: {_tail(self.logs['slurmd'])}")

    def stop(self) -> None:
        """Cancel every job, stop the daemons, then kill whatever of theirs is left."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--quiet", "--user", "root"], check=False, timeout=10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False, timeout=10).stdout.strip():
                time.sleep(0.3)
        for name in ("slurmd", "slurmctld"):
            proc = self._daemons.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            _kill_group(proc.pid)
        for pid in self._leftovers():
            _kill(pid)
        if self._munged_pid is not None:
            _kill(self._munged_pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _alive(self._munged_pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            _kill(self._munged_pid)
            self._munged_pid = None

    def _leftovers(self) -> list[int]:
        """Processes that mention this cluster's directory (slurmstepd, job scripts, tasks)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    environ = handle.read().decode(errors="replace") + "\0"
            except OSError:
                continue
            if self.root in cmdline or f"SLURM_CONF={self.conf}\0" in environ:
                found.append(int(entry))
        return found

    def leftover_processes(self) -> list[int]:
        return self._leftovers()

    # -- clients -----------------------------------------------------------------------------

    def run(self, args: Sequence[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT_S,
            env: Mapping[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (``sbatch``, ``srun``...) against this cluster."""
        proc = subprocess.run(list(args), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited with {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def sbatch(self, script: str, *options: str, cwd: str, env: Mapping[str, str] | None = None) -> int:
        """Submit ``script`` (a path) and return its job id."""
        proc = self.run(["sbatch", "--parsable", *options, script], env=env, cwd=cwd)
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty when the job is gone)."""
        proc = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if proc.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: int, states: Iterable[str], timeout: float) -> dict[str, str]:
        """Wait until the job is in one of ``states`` (or finished otherwise); the job's record."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        record: dict[str, str] = {}
        while time.monotonic() < deadline:
            record = self.job(job_id)
            state = record.get("JobState", "")
            if state in wanted or (state in FINISHED_STATES and not wanted & FINISHED_STATES):
                return record
            if state in FINISHED_STATES - wanted:
                raise AssertionError(f"job {job_id} ended {state} (wanted {sorted(wanted)}): {record}\n"
                                     f"{self.output(record)}")
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} not in {sorted(wanted)} after {timeout:g}s: {record}\n{self.output(record)}")

    def wait_requeued(self, job_id: int, timeout: float) -> dict[str, str]:
        """Wait until the job was requeued: pending again with ``Restarts`` >= 1 (Slurm then holds it
        for ``cred_expire`` + 1 s, reason ``BeginTime``, before it may start again)."""
        deadline = time.monotonic() + timeout
        record: dict[str, str] = {}
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record.get("JobState") == "PENDING" and int(record.get("Restarts", "0")) >= 1:
                return record
            if record.get("JobState") in FINISHED_STATES:
                raise AssertionError(f"job {job_id} ended {record['JobState']} instead of being requeued: {record}\n"
                                     f"{self.output(record)}")
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} was not requeued in {timeout:g}s: {record}\n{self.output(record)}")

    def output(self, record: Mapping[str, str]) -> str:
        """The job's stdout (and stderr when separate) file contents."""
        texts = []
        for key in ("StdOut", "StdErr"):
            path = record.get(key)
            if path and os.path.exists(path) and path not in [record.get("StdOut")] * (key == "StdErr"):
                with open(path, errors="replace") as handle:
                    texts.append(handle.read())
        return "".join(texts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def start_cluster(root: str) -> SlurmTestCluster:
    cluster = SlurmTestCluster(root)
    cluster.start()
    return cluster
