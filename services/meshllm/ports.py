"""Listening ports: a taken port is one line naming the flag (and variable) that changes it.

Every meshllm listener binds exclusively (gRPC servers without SO_REUSEPORT,
see `meshllm.plane.request.server.start_server`), so a second process on the same
port fails to bind instead of silently sharing it. Entry points call
`check_free` before they start anything (a worker loads no model, a router
opens no plane), and the binds themselves turn EADDRINUSE into the same
`PortInUse`, for the race between the two.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable

from meshllm.config import ConfigError, env_name

__all__ = ["PortInUse", "bind_error", "check_free", "check_free_all", "free_port"]


class PortInUse(ConfigError):
    """host:port is taken; the message names the flag and the MESHLLM_* variable to change it."""

    def __init__(self, port: int, flag: str) -> None:
        super().__init__(f"port {port} is already in use; choose another with {flag} or {env_name(flag)}", param=flag)
        self.port = port
        self.flag = flag


def bind_error(host: str, port: int, flag: str, exc: OSError) -> ConfigError:
    """The one-line error for a failed bind: PortInUse for EADDRINUSE, else a ConfigError naming host:port."""
    if exc.errno == errno.EADDRINUSE:
        return PortInUse(port, flag)
    return ConfigError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}", param=flag)


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple[object, ...]]]:
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror:
        return []  # the listener's own bind reports an unknown host
    seen: dict[tuple[object, ...], socket.AddressFamily] = {}
    for family, _, _, _, addr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            seen.setdefault(tuple(addr), family)
    return [(family, addr) for addr, family in seen.items()]


def check_free(host: str, port: int, flag: str) -> None:
    """Raise PortInUse when something already listens on (or holds exclusively) host:port; port 0 always passes.

    Probes with SO_REUSEADDR and without SO_REUSEPORT: a listener of any
    process (even one that set SO_REUSEPORT itself) makes the bind fail, a
    connection in TIME_WAIT does not.
    """
    if port == 0:
        return
    for family, addr in _addresses(host, port):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUse(port, flag) from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    continue  # e.g. ::1 on a host without IPv6: the listener reports what it cannot bind
                raise bind_error(host, port, flag, exc) from None


def check_free_all(ports: Iterable[tuple[str, int | None, str]]) -> None:
    """`check_free` for each (host, port, flag); a None port (listener off) is skipped."""
    for host, port, flag in ports:
        if port is not None:
            check_free(host, port, flag)


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (another process may take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
