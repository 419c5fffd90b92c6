"""Run a training function on several processes from Python or a notebook (Accelerate's ``notebook_launcher``).

The processes are started by torch's elastic agent (the same agent ``torchrun`` uses), forked like
Accelerate does so that functions defined in a notebook cell need no pickling; each child sees
``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` and ``FORK_LAUNCHED=1``, so an
``Accelerator`` created inside the function joins the group through the torchelastic cluster
environment. When one rank fails the agent stops the others (no orphans) and the error names the
rank, its exit code and its traceback.

Nothing is left in the temporary directory: torch elastic's own log directory (``torchelastic_*``) and
the traceback files ``torch.multiprocessing`` creates for each child (``pytorch-errorfile-*.pickle``,
never removed by torch) go to a private directory removed when the launch ends, failed or not; the
children get the temporary directory back, so what the function writes there is its own.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchrig.enums import PrecisionType
from torchrig.runtime import latest_run
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


def _failure_report(error: Any) -> tuple[str, dict[int, str]]:
    failures: dict[int, str] = {}
    lines = []
    for rank, failure in sorted(error.failures.items()):
        what = f"exit code {failure.exitcode}"
        if failure.signal_name() not in ("", "<N/A>", "N/A"):
            what += f" ({failure.signal_name()})"
        message = failure.message
        while isinstance(message, dict):  # elastic's error file: {"message": {"message": "...", "extraInfo": ...}}
            message = message.get("message", "")
        failures[rank] = f"{what}: {message}".rstrip(": ")
        lines.append(f"  rank {rank} (local rank {failure.local_rank}): {failures[rank]}")
    return "\n".join(lines), failures


@contextlib.contextmanager
def _private_tempdir() -> Iterator[str]:
    """While active, this process's temporary files go to a fresh directory, removed afterwards."""
    private = tempfile.mkdtemp(prefix="torchrig-notebook-")
    saved = tempfile.tempdir
    tempfile.tempdir = private
    try:
        yield private
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(private, ignore_errors=True)


def _child_entry(tempdir: str | None, function: Callable[..., Any], *args: Any) -> Any:
    """A launched child's entry: the user's temporary directory back, then the function."""
    tempfile.tempdir = tempdir
    return function(*args)


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
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    device_type = _device_type()
    start_method = "spawn" if device_type in _SPAWN_DEVICES else "fork"
    rdzv_conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        rdzv_conf["rank"] = node_rank
        rdzv_endpoint = rdzv_endpoint or f"{master_addr}:{use_port}"
    environ = {"FORK_LAUNCHED": "1" if start_method == "fork" else "0", "MASTER_ADDR": master_addr,
               "MASTER_PORT": str(use_port), **precision_env}
    print(f"Launching training on {num_processes} {device_type.upper()}s.")
    user_tempdir = tempfile.tempdir
    with patch_environment(**environ), _private_tempdir() as private:
        config = LaunchConfig(min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=int(num_processes),
                              run_id=rdzv_id, rdzv_endpoint=rdzv_endpoint, rdzv_backend=rdzv_backend,
                              rdzv_configs=rdzv_conf, max_restarts=max_restarts, monitor_interval=monitor_interval,
                              start_method=start_method, log_line_prefix_template=log_line_prefix_template,
                              logs_specs=DefaultLogsSpecs(log_dir=private))
        entry = functools.update_wrapper(functools.partial(_child_entry, user_tempdir, function), function)
        try:
            elastic_launch(config=config, entrypoint=entry)(*args)
        except ChildFailedError as error:
            report, failures = _failure_report(error)
            raise NotebookLaunchError(f"notebook_launcher: {len(failures)} of {num_processes * num_nodes} "
                                      f"processes of {getattr(function, '__name__', function)!r} failed; the "
                                      f"others were stopped.\n{report}", failures) from None
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
    # Imported here, not at the top: importing the notebook launcher stays torch-free (torchrig.process
    # needs torch), like the rest of the launcher.
    from torchrig.process import PartialState

    state = PartialState()
    state.wait_for_everyone()
    state.destroy_process_group()


test_launch.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite its Accelerate name
