"""Run a command on a pseudo-terminal and read back what a person would see: for tests of what the
launcher prints on a terminal (progress bars redrawn in place, rank prefixes)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from typing import Any


def run_on_a_terminal(command: list[str], env: dict[str, str], guard: Any, timeout: float) -> tuple[int, str]:
    """Run ``command`` with a pseudo-terminal as its stdin, stdout and stderr (in a new session, tracked by
    ``guard``, a :class:`~torchrig.testing.ProcessGuard`); its exit code and everything it wrote."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal, env=env, close_fds=True,
                            start_new_session=True)
    guard.track(proc)
    os.close(terminal)
    received = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 0.2)
        if ready:
            try:
                data = os.read(controller, 65536)
            except OSError:  # the terminal closed: every process holding it has ended
                break
            if not data:
                break
            received += data
        elif proc.poll() is not None:
            break
    os.close(controller)
    return proc.wait(timeout=timeout), received.decode(errors="replace")


def screen(raw: str) -> list[str]:
    """The non-empty lines a terminal shows after ``raw`` (carriage return, line feed, overwrite)."""
    lines: list[list[str]] = [[]]
    column = 0
    for char in raw:
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append([])
            column = 0
        else:
            line = lines[-1]
            line[column:column + 1] = [char]
            column += 1
    return ["".join(line) for line in lines if line]


__all__ = ["run_on_a_terminal", "screen"]
