"""Run a training function on several processes from Python or a notebook (Accelerate's ``notebook_launcher``).

The processes are started by torch's elastic agent (the same agent ``torchrun`` uses), forked like
Accelerate does so that functions defined in a notebook cell need no pickling; each child sees
``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` and ``FORK_LAUNCHED=1``, so an
``Accelerator`` created inside the function joins the group through the torchelastic cluster
environment. When one rank fails the agent stops the others and the error names the rank, its exit
code and its traceback.

What a launch guarantees when it returns or raises (a notebook outlives every launch, so anything
left behind stays for the session; :mod:`torchrig.launch.notebook_agent` says how):

* nothing it started is alive: the ranks, and every process they started (subprocesses,
  ``multiprocessing`` children, daemons that left the session), each rank running under the same
  supervisor as ``torchrig launch``'s ranks;
* a rank that exits 0 without returning (``os._exit(0)``, ``sys.exit(0)``) is named, and the
  others are torn down, instead of a launch that waits forever;
* Ctrl-C (SIGINT to the notebook) stops the ranks and raises ``KeyboardInterrupt``; another stop
  signal is handled as it would have been without the launch; the notebook's own signal handlers
  are back in place;
* only what the launch made is removed: torch elastic's log directory goes to a private
  directory, and the traceback files ``torch.multiprocessing`` creates for each child
  (``pytorch-errorfile-*.pickle``, never removed by torch) are removed by name. The process-wide
  ``tempfile.tempdir`` is never touched, so another thread's temporary files stay where it put them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchrig.compat.enums import PrecisionType
from torchrig.host.runtime import latest_run
from torchrig.utils.environment import patch_environment

#: Start method per device type: runtimes that initialise themselves in the parent cannot be forked.
_SPAWN_DEVICES = frozenset({"xpu"})


class NotebookLaunchError(RuntimeError):
    """A process started by :func:`notebook_launcher` failed; ``failures`` maps rank to what happened."""

    def __init__(self, message: str, failures: Mapping[int, str]):
        super().__init__(message)
        self.failures = dict(failures)


def _refuse_when_initialised() -> None:
    import torch.distributed as dist

    if latest_run() is not None or (dist.is_available() and dist.is_initialized()):
        raise ValueError("To launch a multi-process training from Python or a notebook, the `Accelerator` (or "
                         "`PartialState`) must only be created inside the launched function; one already exists in "
                         "this process. Restart the notebook kernel and create it inside your training function.")


def _device_type() -> str:
    import torch

    # ``torch.cuda.device_count`` uses NVML and does not initialise CUDA, so forking stays safe.
    return "cuda" if torch.cuda.is_available() else "cpu"


def _failure_report(failures: Mapping[int, Any]) -> tuple[str, dict[int, str]]:
    """One line per failed rank: elastic's ``ProcessFailure`` (exit code, signal, the traceback's
    message) or a :class:`~torchrig.launch.notebook_agent.LeftEarly`."""
    texts: dict[int, str] = {}
    lines = []
    for rank, failure in sorted(failures.items()):
        if getattr(failure, "left_early", False):
            texts[rank] = failure.message
        else:
            what = f"exit code {failure.exitcode}"
            if failure.signal_name() not in ("", "<N/A>", "N/A"):
                what += f" ({failure.signal_name()})"
            message = failure.message
            while isinstance(message, dict):  # elastic's error file: {"message": {"message": "...", "extraInfo": ...}}
                message = message.get("message", "")
            if not os.path.exists(failure.error_file or ""):  # no Python exception: elastic's text is a docs link
                message = "no Python exception (killed, or sys.exit/os._exit inside the function)"
            texts[rank] = f"{what}: {message}".rstrip(": ")
        lines.append(f"  rank {rank} (local rank {failure.local_rank}): {texts[rank]}")
    return "\n".join(lines), texts


#: Signals torch's elastic agent replaces with handlers raising its ``SignalException`` (never restored).
_AGENT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name))


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The caller's signal handlers, back in place when the launch ends."""
    if threading.current_thread() is not threading.main_thread():
        yield  # elastic installs handlers from the main thread only
        return
    saved = {signum: signal.getsignal(signum) for signum in _AGENT_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def _run_agent(function: Callable[..., Any], args: tuple, *, nproc: int, num_nodes: int,
               rdzv_backend: str, rdzv_endpoint: str, rdzv_conf: dict, rdzv_id: str, max_restarts: int,
               monitor_interval: float, start_method: str, log_line_prefix_template: str | None) -> None:
    """Start the ranks with :class:`~torchrig.launch.notebook_agent.NotebookAgent` and wait for them."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    from torchrig.launch.notebook_agent import NotebookAgent, rank_entry

    name = getattr(function, "__name__", repr(function))
    master_addr = master_port = None
    if rdzv_backend == "static":
        host, _, port = rdzv_endpoint.rpartition(":")
        master_addr, master_port = host, int(port)
    rdzv_conf.setdefault("timeout", 900)  # elastic_launch's default rendezvous timeout
    params = RendezvousParameters(backend=rdzv_backend, endpoint=rdzv_endpoint, run_id=rdzv_id, min_nodes=num_nodes,
                                  max_nodes=num_nodes, **rdzv_conf)
    private = tempfile.mkdtemp(prefix="torchrig-notebook-")  # elastic's logs; removed with everything in it
    entry = functools.update_wrapper(functools.partial(rank_entry, function), function)
    agent = None
    shutdown_rdzv = True
    handler = None
    try:
        handler = rdzv_registry.get_rendezvous_handler(params)
        spec = WorkerSpec(role="default", local_world_size=nproc, entrypoint=entry, args=tuple(args),
                          rdzv_handler=handler, max_restarts=max_restarts, monitor_interval=monitor_interval,
                          master_addr=master_addr, master_port=master_port)
        agent = NotebookAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=private), start_method=start_method,
                              log_line_prefix_template=log_line_prefix_template, function_name=name)
        with _signal_handlers_kept():
            try:
                result = agent.run()
            except SignalException as stop:
                shutdown_rdzv = False
                interrupted = stop.sigval
            else:
                interrupted = None
        if interrupted == signal.SIGINT:
            raise KeyboardInterrupt
        if interrupted is not None:  # handled as it would have been without the launch
            signal.raise_signal(interrupted)
            raise SystemExit(128 + int(interrupted))  # a handler that returned: the launch still ended
        if result.is_failed():
            report, failures = _failure_report(result.failures)
            raise NotebookLaunchError(f"notebook_launcher: {len(failures)} of {nproc * num_nodes} processes of "
                                      f"{name!r} failed; the others were stopped.\n{report}", failures)
    finally:
        if agent is not None:
            agent.sweep()  # nothing is left even when the teardown itself was interrupted
        if handler is not None and shutdown_rdzv:
            with contextlib.suppress(Exception):
                handler.shutdown()
        for path in agent.error_files if agent is not None else []:
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(private, ignore_errors=True)


def notebook_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: dict | None = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: str | None = None) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes of this machine (Accelerate's semantics).

    With ``num_processes=1`` the function runs in this process. ``mixed_precision`` other than ``"no"``
    reaches the ``Accelerator`` inside through ``TORCHRIG_MIXED_PRECISION`` (which, as Accelerate's launcher
    setting does, takes precedence over the function's own ``Accelerator(mixed_precision=...)``). Raises
    :class:`NotebookLaunchError` naming every failed rank.
    """
    # PrecisionType is open (precision plugins add modes): the Accelerator inside validates the value
    # against the installed plugins, and a refusal there is reported per rank like any failure.
    precision = PrecisionType(str(mixed_precision).lower())
    if num_processes is None:
        raise ValueError("notebook_launcher: give the number of processes to start, e.g. num_processes=2.")
    if int(num_processes) < 1:
        raise ValueError(f"notebook_launcher: num_processes must be at least 1, got {num_processes}.")
    if node_rank >= num_nodes:
        raise ValueError(f"notebook_launcher: node_rank ({node_rank}) must be less than num_nodes ({num_nodes}).")
    precision_env = {} if precision.value == "no" else {"TORCHRIG_MIXED_PRECISION": precision.value}
    if num_processes == 1 and num_nodes == 1:
        with patch_environment(**precision_env):
            print(f"Launching training on one {_device_type().upper()}.")
            function(*args)
        return
    _refuse_when_initialised()
    device_type = _device_type()
    start_method = "spawn" if device_type in _SPAWN_DEVICES else "fork"
    rdzv_conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        rdzv_conf["rank"] = node_rank
        rdzv_endpoint = rdzv_endpoint or f"{master_addr}:{use_port}"
    environ = {"FORK_LAUNCHED": "1" if start_method == "fork" else "0", "MASTER_ADDR": master_addr,
               "MASTER_PORT": str(use_port), **precision_env}
    print(f"Launching training on {num_processes} {device_type.upper()}s.")
    with patch_environment(**environ):
        _run_agent(function, args, nproc=int(num_processes), num_nodes=num_nodes,
                   rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf, rdzv_id=rdzv_id,
                   max_restarts=max_restarts, monitor_interval=monitor_interval, start_method=start_method,
                   log_line_prefix_template=log_line_prefix_template)
    sys.stdout.flush()


def debug_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` on ``num_processes`` CPU processes with gloo (for debugging, as in Accelerate)."""
    # Hiding the GPUs (rather than setting use_cpu) keeps an explicit Accelerator(cpu=...) free of override warnings.
    with patch_environment(CUDA_VISIBLE_DEVICES=""):
        notebook_launcher(function, args=args, num_processes=num_processes, use_port=str(_free_port()))


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_launch() -> None:
    """Check that a process group can be formed and torn down here (Accelerate's launch self-test)."""
    # Imported here, not at the top: importing the notebook launcher stays torch-free (torchrig.distributed.process
    # needs torch), like the rest of the launcher.
    from torchrig.distributed.process import PartialState

    state = PartialState()
    state.wait_for_everyone()
    state.destroy_process_group()


test_launch.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite its Accelerate name
