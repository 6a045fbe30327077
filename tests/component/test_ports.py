"""gRPC servers bind their port exclusively; a taken port is one PortInUse line naming the flag (issue 14)."""

from __future__ import annotations

import socket

import pytest

from meshllm.config import ConfigError, ServerConfig
from meshllm.plane.request.server import start_server
from meshllm.ports import PortInUse, check_free


async def test_a_second_grpc_server_on_a_taken_port_is_port_in_use() -> None:
    first = await start_server(ServerConfig(port=0), [])
    try:
        with pytest.raises(PortInUse) as caught:
            await start_server(ServerConfig(port=first.port), [], port_flag="--router-port")
        assert caught.value.message == (
            f"port {first.port} is already in use; choose another with --router-port or MESHLLM_ROUTER_PORT"
        )
        # Even a server that would share the port (SO_REUSEPORT) is refused: the first did not offer it.
        with pytest.raises(ConfigError):
            await start_server(ServerConfig(port=first.port), [], reuse_port=True)
    finally:
        await first.aclose()


async def test_servers_of_one_group_share_a_port_only_when_both_ask_for_it() -> None:
    """`meshllm frontend --workers N`: its processes share the Inference gRPC port on purpose."""
    first = await start_server(ServerConfig(port=0), [], reuse_port=True)
    try:
        second = await start_server(ServerConfig(port=first.port), [], reuse_port=True)
        await second.aclose()
        with pytest.raises(PortInUse):
            await start_server(ServerConfig(port=first.port), [])  # a stranger binds exclusively: refused
    finally:
        await first.aclose()


def test_check_free_passes_port_0_and_refuses_any_listener_even_one_with_so_reuseport() -> None:
    check_free("127.0.0.1", 0, "--port")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        with pytest.raises(PortInUse, match="--port or MESHLLM_PORT"):
            check_free("127.0.0.1", port, "--port")
        with pytest.raises(PortInUse):
            check_free("0.0.0.0", port, "--http-port")  # the wildcard address overlaps it too
