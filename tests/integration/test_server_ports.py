"""meshllm.testing's real etcd and nats-server: a port taken between choosing it and binding it is chosen again.

Ports are picked free, then bound by the server, and another process can take one in between (a CI run once
lost a test to "bind: address already in use"). Locks: a first start whose port is held by someone else starts
on another port, with the real etcd and nats-server; a restart keeps its port.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from meshllm.testing.servers import EtcdServer, NatsServer


@contextmanager
def held_port() -> Iterator[int]:
    """A port this test listens on, so that a server told to bind it fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


async def test_etcd_whose_client_port_is_taken_starts_on_another_and_keeps_it_on_restart() -> None:
    with held_port() as taken:
        server = EtcdServer()
        server.port = taken
        async with server:
            assert server.port != taken and server.running
            port = server.port
            await server.restart()
            assert server.port == port and server.running


async def test_nats_server_whose_port_is_taken_starts_on_another() -> None:
    with held_port() as taken:
        server = NatsServer()
        server.port = taken
        async with server:
            assert server.port != taken and server.running
