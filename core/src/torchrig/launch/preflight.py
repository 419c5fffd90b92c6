"""Checks made before any worker starts, so a wrong address or a busy port is one clear line
instead of a hang at the first collective (accelerate#412, #1804).

* A port this machine must listen on (the rendezvous store of machine 0, or ``main_process_port``
  of a single-machine run) must be free: otherwise the launch stops naming the port.
* A machine of rank > 0 must reach ``main_process_ip:main_process_port`` within a bounded time
  (machine 0 may start a little later, so it is retried until the deadline).
* ``main_process_ip`` given to machine 0 should be one of its own addresses (a warning: behind
  NAT the public address is not local).

Torch-free; every check is bounded in time.
"""

from __future__ import annotations

import socket
import time

from torchrig.errors import TorchrigError


class PreflightError(TorchrigError):
    """A check before the launch failed; nothing was started."""


def port_is_free(port: int) -> bool:
    """Whether this machine could listen on ``port`` (on every interface, as the TCP store does)."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address, port))
            except OSError as exc:
                if exc.errno in (98, 48, 10048):  # EADDRINUSE on Linux, macOS, Windows
                    return False
                continue  # e.g. no IPv6 on this machine
    return True


def check_port_free(port: int, what: str) -> None:
    if port and not port_is_free(port):
        raise PreflightError(
            f"port {port} ({what}) is already in use on this machine: another job or torchrig launch may "
            f"hold it; pass a different --main_process_port (or 0 for a free one on a single machine)")


def is_local_address(host: str) -> bool:
    """Whether ``host`` resolves to an address of this machine (it can be bound)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((address[0], 0))
                return True
        except OSError:
            continue
    return False


def wait_reachable(host: str, port: int, timeout: float, *, interval: float = 0.5) -> None:
    """Connect to ``host:port`` until it accepts or ``timeout`` seconds pass; then fail clearly."""
    deadline = time.monotonic() + max(0.0, timeout)
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.2, min(2.0, remaining))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() + interval >= deadline:
            break
        time.sleep(interval)
    reason = last.strerror if last is not None and last.strerror else str(last)
    raise PreflightError(
        f"cannot reach the rendezvous of machine 0 at {host}:{port} within {timeout:g} s ({reason}). Check that "
        f"machine_rank 0 is running with the same --main_process_port, that --main_process_ip is its address as "
        f"this machine sees it (not 127.0.0.1 on another machine), and that no firewall blocks the port "
        f"(--preflight_timeout sets how long to wait)")


__all__ = ["PreflightError", "check_port_free", "is_local_address", "port_is_free", "wait_reachable"]
