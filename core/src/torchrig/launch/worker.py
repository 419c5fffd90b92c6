"""The per-rank wrapper: ``python -m torchrig.launch.worker [options] -- TARGET [ARGS...]``.

``torchrig launch`` starts this instead of the user's script so that every rank's fate is
recorded whatever happens to it:

* it dies with the launcher: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` plus a watchdog thread that
  notices a changed parent pid (torchrun's workers survive a ``kill -9`` of torchrun), and so do
  the processes it starts: the rank runs under a subreaper that ends its whole process tree
  (:mod:`torchrig.launch.supervisor`);
* it runs the script in this interpreter with :mod:`runpy` (``run_path`` as ``__main__`` or
  ``run_module``) and the script's own ``sys.argv``, so tracebacks and ``sys.exit`` codes are
  seen here, not guessed from an exit status;
* every exception (``SystemExit`` with a non-zero code included) goes to torch elastic's error
  file (``TORCHELASTIC_ERROR_FILE``, the format of ``ErrorHandler``) and to
  ``<log_dir>/rank-N.status.json`` with the exit time, then the process exits with the same
  code — the launcher names the first failing rank from those times;
* ``SIGTERM`` from the launcher (tearing the job down) is recorded as ``terminated`` with where
  the rank was, which is how a stalled rank is told from one waiting in a collective. A rank
  stuck in native code (a collective) does not run Python signal handlers, so a thread that
  sees the signal through ``signal.set_wakeup_fd`` ends it after a short grace;
* a preemption (``preemption.signals``): the signals are recorded from the first instruction
  (``--preemption_signals``; the launcher starts ranks with SIGUSR1 blocked, unblocked here once the
  handler is in place, so a warning during the interpreter's own start is not lost either), and a script that stopped with
  :class:`~torchrig.resilience.preemption.Preempted` is recorded as ``preempted``, with its checkpoint;
* ``--no_python`` commands run as a child process whose stderr passes through here, so the
  tail of it lands in the status file (there is no Python entry to wrap).

Imports nothing heavy: the user's script pays for torch, not the wrapper.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from torchrig.errors import ConfigError
from torchrig.launch import status as _status
from torchrig.launch.supervisor import set_parent_death_signal, supervise
from torchrig.resilience import collective_trace, preemption, run_status
from torchrig.resilience.liveness import process_is_alive

#: Seconds a rank gets to stop on its own after SIGTERM/SIGINT before it is ended from the
#: watchdog thread (it is then stuck in native code). Below the launcher's SIGKILL grace.
STOP_GRACE_S = 3.0
#: Seconds after a stop signal before the supervisor SIGKILLs the rank's whole tree: after the
#: rank's own grace, before the launcher's SIGKILL (default grace 10 s).
KILL_GRACE_S = STOP_GRACE_S + 2.0
_MODES = ("script", "module", "exec")


class Terminated(BaseException):
    """Raised in the main thread when the launcher sends SIGTERM (a BaseException, so the
    script's ``except Exception`` does not swallow the teardown)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} from the launcher")
        self.signum = signum


def _parse(argv: Sequence[str]) -> tuple[dict[str, str], str, str, list[str]]:
    """``--log_dir D --mode M [--launcher_pid P] [--stop_grace S] [--kill_grace S] [--supervise 0|1]
    [--preemption_signals SIGUSR1,...] -- TARGET ARGS...``; kept dumb and fast."""
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m torchrig.launch.worker --log_dir DIR --mode script|module|exec "
                         "[--launcher_pid PID] -- TARGET [ARGS...]")
    split = argv.index("--")
    options, rest = argv[:split], argv[split + 1:]
    opts: dict[str, str] = {}
    for i in range(0, len(options) - 1, 2):
        opts[options[i].lstrip("-")] = options[i + 1]
    mode = opts.get("mode", "script")
    if mode not in _MODES or not rest:
        raise SystemExit(f"torchrig.launch.worker: bad mode {mode!r} or no target")
    return opts, mode, rest[0], rest[1:]


def _env_int(name: str, default: int | None = None) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def _format(exc: BaseException) -> str:
    """The traceback as Python prints it, without the wrapper's and runpy's frames."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}

    def ours(filename: str) -> bool:
        return filename.startswith("<frozen runpy") or os.path.abspath(filename) in skip

    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen: set[int] = set()
    todo = [te]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        item.stack = traceback.StackSummary.from_list([f for f in item.stack if not ours(f.filename)])
        todo += [x for x in (item.__cause__, item.__context__) if x is not None]
    return "".join(te.format())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def write_error_file(message: str, callstack: str, when: float | None = None) -> None:
    """Torch elastic's error file, in ``ErrorHandler.record_exception``'s format (written here so
    the wrapper needs no torch). Elastic reads it for ``ProcessFailure.message``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack, "timestamp": str(int(when or time.time()))}}}
    try:
        _status.write_json_atomic(path, data)
    except OSError:
        pass


class _Watch(threading.Thread):
    """Watchdog thread: exits when the parent changes; ends a rank that ignores a stop signal
    because it is stuck in native code; owns the final status write so it never races the
    main thread's."""

    def __init__(self, status: _status.RankStatus, grace: float) -> None:
        super().__init__(name="torchrig-launch-watch", daemon=True)
        self.status = status
        self.grace = grace
        self.parent = os.getppid()
        self.lock = threading.Lock()
        self.final = False
        #: Set once the outcome is known: later stop signals are ignored (we are exiting anyway).
        self.stopping = False
        self.child: subprocess.Popen[bytes] | None = None
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        """A process the script forks (DataLoader workers) is not this rank: give it Python's
        own signal handling back, or its SIGTERM would reach our watchdog through the pipe."""
        signal.set_wakeup_fd(-1)
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        run_status._set_current(None)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT -> KeyboardInterrupt (as Python does), SIGTERM/SIGHUP -> :class:`Terminated`;
        nothing once the outcome is being recorded."""
        if self.stopping:
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    def _ours(self, signum: int) -> bool:
        return signal.getsignal(signum) == self._on_signal

    def finish(self, **fields: Any) -> bool:
        """Write the final state once; False if the watchdog already did."""
        with self.lock:
            if self.final:
                return False
            self.final = True
            try:
                self.status.update(**fields)
            except OSError as exc:  # a full disk must not change the exit code
                print(f"torchrig launch: cannot write {self.status.path}: {exc}", file=sys.stderr)
            return True

    def run(self) -> None:
        pending: tuple[int, float] | None = None
        while True:
            timeout = 0.25 if pending is None else max(0.0, min(0.25, pending[1] - time.monotonic()))
            try:
                ready, _, _ = select.select([self._read], [], [], timeout)
                data = os.read(self._read, 64) if ready else b""
            except OSError:
                data = b""
            for signum in data:
                if pending is None and signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) and self._ours(signum):
                    pending = (signum, time.monotonic() + self.grace)
            if os.getppid() != self.parent:
                self._end(signal.SIGKILL, "the launcher died (the parent process is gone)", TERMINATED_BY_PARENT)
            if pending is not None and time.monotonic() >= pending[1]:
                name = signal.Signals(pending[0]).name
                self._end(pending[0], f"did not stop within {self.grace:g} s of {name} (stuck in native code)",
                          _status.INTERRUPTED if pending[0] == signal.SIGINT else _status.TERMINATED)

    def _end(self, signum: int, reason: str, state: str) -> None:
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        stack = "".join(traceback.format_stack(main)) if main is not None else ""
        if main is not None:  # stuck in native code: most likely a collective (the hang report says which)
            _dump_collectives(self, collective_trace.STOPPED, collective_trace.frames_of(main))
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
        code = 128 + int(signum)
        now = time.time()
        if self.finish(state=state, exit_code=code, ended_at=now, error=reason, traceback=_status.tail(stack),
                       signal=signal.Signals(signum).name):
            write_error_file(reason, stack, now)
        else:  # the outcome was recorded, but the process did not get to exit: keep its code
            code = int(self.status.data.get("exit_code") or 0)
        os._exit(code)  # no flush: the main thread may hold the stream's lock (workers run with -u)


#: ``state`` of a rank whose launcher vanished.
TERMINATED_BY_PARENT = _status.TERMINATED


def _exit_code(code: Any) -> int:
    """``sys.exit`` semantics: None -> 0, int -> itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_python(mode: str, target: str, args: list[str], watch: _Watch) -> int:
    faulthandler.enable(all_threads=True)  # a segfault still prints where each thread was
    collective_trace.record_collectives()  # before the script creates a process group
    sys.argv = [target, *args]
    if mode == "script":
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    try:
        if mode == "script":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except BaseException as exc:
        watch.stopping = True  # first: a teardown signal must not interrupt the recording
        return _outcome(exc, watch)
    watch.stopping = True
    return _finished(watch)


def _outcome(exc: BaseException, watch: _Watch) -> int:
    if isinstance(exc, preemption.Preempted):
        return _preempted(watch, exc)
    if isinstance(exc, SystemExit):
        code = _exit_code(exc.code)
        if code == 0:
            return _finished(watch)
        return _failed(watch, code, f"SystemExit: {exc.code}", _format(exc))
    if isinstance(exc, (Terminated, KeyboardInterrupt)):
        _dump_collectives(watch, collective_trace.STOPPED, collective_trace.frames_of(exc.__traceback__))
        return _stopped(watch, exc.signum if isinstance(exc, Terminated) else signal.SIGINT, _format(exc))
    if collective_trace.is_timeout_error(exc):
        _dump_collectives(watch, collective_trace.TIMEOUT, collective_trace.frames_of(exc.__traceback__))
    elif collective_trace.is_peer_lost_error(exc):
        _dump_collectives(watch, collective_trace.PEER_LOST, collective_trace.frames_of(exc.__traceback__))
    if isinstance(exc, ConfigError):
        return _config_error(exc, watch)
    text = _format(exc)
    sys.stderr.write(text)
    sys.stderr.flush()
    return _failed(watch, 1, _first_line(exc), text)


def _dump_collectives(watch: _Watch, reason: str, stack: list[tuple[str, int, str]]) -> None:
    """The rank's hang dump next to its status file: which collective it is in, and where."""
    collective_trace.write_dump(os.path.dirname(watch.status.path), int(watch.status.data.get("rank") or 0),
                                reason=reason, stack=stack, attempt=watch.status.data.get("attempt"))


def _config_error(exc: ConfigError, watch: _Watch) -> int:
    """A ConfigError already says what is wrong and what to do: every rank shows it with the line of
    the script that called into torchrig, not a traceback through torchrig's internals (~30 lines a
    rank); the full traceback stays in the rank's error file."""
    where = _script_frame(exc)
    short = f"{type(exc).__name__}: {exc}\n" + (f"  (raised by {where})\n" if where else "")
    sys.stderr.write(short)
    sys.stderr.flush()
    now = time.time()
    message = _first_line(exc)
    if watch.finish(state=_status.FAILED, exit_code=1, ended_at=now, error=message, traceback=_status.tail(short)):
        write_error_file(message, _format(exc), now)
    return 1


def _script_frame(exc: BaseException) -> str | None:
    """``file:line (code)`` of the innermost frame outside torchrig and its plugins (packages named
    ``torchrig``/``torchrig_*``), installed packages and the standard library: the user's call that
    led to ``exc``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if collective_trace.is_user_file(f.filename)]
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno}" + (f" ({frame.line.strip()})" if frame.line else "")


def _finished(watch: _Watch) -> int:
    failures = _unfinished_work_failures()
    if failures:  # the script returned, but work it started (a last asynchronous save) failed
        message = "; ".join(failures)
        print(f"torchrig: checkpoint lost: {message}", file=sys.stderr, flush=True)
        return _failed(watch, 1, message, message)
    watch.finish(state=_status.FINISHED, exit_code=0, ended_at=time.time())
    return 0


def _unfinished_work_failures() -> list[str]:
    """Finish the asynchronous checkpoint saves the script left running (they are part of the
    script: a rank is ``finished`` only once they committed). Looked up, never imported: a
    script that never saved has none."""
    pending = sys.modules.get("torchrig.checkpoint.pending")
    return list(pending.finish_all()) if pending is not None else []


def _preempted(watch: _Watch, exc: preemption.Preempted) -> int:
    """Stopped after its preemption checkpoint committed: the launcher neither restarts nor blames it."""
    code = _exit_code(exc.code)
    failures = _unfinished_work_failures()
    if failures:
        message = "; ".join(failures)
        return _failed(watch, 1, message, message)
    watch.finish(state=_status.PREEMPTED, exit_code=code, ended_at=time.time(), error=str(exc))
    return code


def _failed(watch: _Watch, code: int, message: str, text: str, **extra: Any) -> int:
    now = time.time()
    if watch.finish(state=_status.FAILED, exit_code=code, ended_at=now, error=message,
                    traceback=_status.tail(text) if text else None, **extra):
        write_error_file(message, text, now)
    return code


def _stopped(watch: _Watch, signum: int, text: str) -> int:
    """Stopped by the launcher (teardown or a forwarded Ctrl-C): not a failure of this rank."""
    code = 128 + int(signum)
    now = time.time()
    name = signal.Signals(signum).name
    state = _status.INTERRUPTED if signum == signal.SIGINT else _status.TERMINATED
    if watch.finish(state=state, exit_code=code, ended_at=now, signal=name, error=f"stopped by {name}",
                    traceback=_status.tail(text)):
        write_error_file(f"stopped by {name}", text, now)
    return code


def _run_command(target: str, args: list[str], watch: _Watch) -> int:
    """A ``--no_python`` command: a child process whose stderr passes through us, keeping its tail."""
    try:
        child = subprocess.Popen([target, *args], stderr=subprocess.PIPE,
                                 preexec_fn=set_parent_death_signal)
    except OSError as exc:
        print(f"torchrig launch: cannot run {target!r}: {exc}", file=sys.stderr)
        return _failed(watch, 127, f"cannot run {target!r}: {exc}", "")
    watch.child = child
    kept: collections.deque[str] = collections.deque(maxlen=_status.TAIL_LINES)
    out = sys.stderr.buffer
    stop: int | None = None
    assert child.stderr is not None
    while True:
        try:
            line = child.stderr.readline()
            if not line:
                break
            out.write(line)
            out.flush()
            kept.append(line.decode(errors="replace").rstrip("\n"))
        except (Terminated, KeyboardInterrupt) as exc:
            stop = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
            if child.poll() is None:
                child.send_signal(stop)
    code = _wait(child, watch.grace)
    watch.stopping = True
    if stop is not None:
        return _stopped(watch, stop, "\n".join(kept))
    if code == 0:
        return _finished(watch)
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return _failed(watch, 128 - code if code < 0 else code, f"{target} {how}", "",
                   stderr_tail="\n".join(kept) or None)


def _wait(child: subprocess.Popen[bytes], grace: float) -> int:
    deadline = time.monotonic() + grace
    while True:
        try:
            return child.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
        except (Terminated, KeyboardInterrupt):
            continue


def main(argv: Sequence[str] | None = None) -> int:
    opts, mode, target, args = _parse(sys.argv[1:] if argv is None else argv)
    launcher = int(opts.get("launcher_pid") or 0)
    if launcher and os.getppid() != launcher and not process_is_alive(launcher):
        return 128 + signal.SIGKILL  # the launcher died before we could ask to die with it
    if opts.get("supervise", "1") != "0":
        supervise(float(opts.get("kill_grace", KILL_GRACE_S)))  # returns in the rank; the supervisor never returns
    set_parent_death_signal()
    if launcher and not process_is_alive(launcher):
        return 128 + signal.SIGKILL
    rank = _env_int("RANK", 0)
    log_dir = opts.get("log_dir") or os.getcwd()
    status = _status.RankStatus(
        _status.rank_status_path(log_dir, rank),
        rank=rank, local_rank=_env_int("LOCAL_RANK", 0), world_size=_env_int("WORLD_SIZE", 1),
        node_rank=_env_int("GROUP_RANK", 0), attempt=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
        host=socket.gethostname(), mode=mode, command=[target, *args],
    )
    run_status._set_current(status)
    watch = _Watch(status, float(opts.get("stop_grace", STOP_GRACE_S)))
    early = [name for name in opts.get("preemption_signals", "").split(",") if name]
    if early:  # before the script: a scheduler's warning during its imports is kept, not fatal
        preemption.install_signal_handlers(early)
    # The launcher starts ranks with SIGUSR1 blocked (torchrig.launch.elastic), so one that arrived
    # while this interpreter started is pending: delivered now, to the handler just installed (or,
    # with no preemption configured, with its default action, as for a rank that is running).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    watch.start()
    try:
        if mode == "exec":
            return _run_command(target, args, watch)
        return _run_python(mode, target, args, watch)
    except (Terminated, KeyboardInterrupt) as exc:  # landed in the instant before `stopping` was set
        watch.stopping = True
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        if watch.final:
            return int(status.data.get("exit_code") or 128 + signum)
        return _stopped(watch, signum, _format(exc))


if __name__ == "__main__":
    sys.exit(main())
