"""TLS and mTLS on every server of the mesh, with real handshakes (issue 13).

A worker, a router and a frontend (HTTPS and Inference gRPC) run with
certificates from one CA. A client without a certificate, with one from
another CA, with an expired one, or in plaintext is refused by every server;
the mesh's own certificates work end to end (frontend → router → worker over
mTLS); reflection and health answer over TLS; a worker picks up replaced
certificate files for new connections without a restart.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tls_support import (
    PLANE,
    Pki,
    SecureMesh,
    grpc_credentials,
    health_status,
    https,
    make_pki,
    mocker,
    peer_certificate_cn,
    ssl_client,
    start_secure_mesh,
)

from meshllm.certs import DevPki
from meshllm.config import ConfigError, ServerConfig
from meshllm.engine.worker_config import WorkerConfig
from meshllm.errors import Unavailable
from meshllm.plane.auth import MeshSecurity
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.session import SessionClient
from meshllm.plane.tls import TlsConfig
from meshllm.protocol.types import TokenChunk
from meshllm.testing.waiting import wait_until
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
async def mesh(pki: Pki) -> AsyncIterator[SecureMesh]:
    m = await start_secure_mesh(pki)
    try:
        yield m
    finally:
        await m.aclose()


def grpc_servers(mesh: SecureMesh) -> dict[str, str]:
    assert mesh.frontend.grpc_address is not None
    return {"worker": mesh.worker.address, "router": mesh.router.address, "frontend": mesh.frontend.grpc_address}


async def test_every_grpc_server_refuses_clients_without_a_mesh_certificate(pki: Pki, mesh: SecureMesh) -> None:
    for name, address in grpc_servers(mesh).items():
        got = {
            "right": await health_status(address, grpc_credentials(pki, pki.client)),
            "no certificate": await health_status(address, grpc_credentials(pki, None)),
            "other CA": await health_status(address, grpc_credentials(pki, pki.other_ca)),
            "expired": await health_status(address, grpc_credentials(pki, pki.expired)),
            "plaintext": await health_status(address, None),
        }
        assert got == {
            "right": "SERVING",
            "no certificate": "UNAVAILABLE",
            "other CA": "UNAVAILABLE",
            "expired": "UNAVAILABLE",
            "plaintext": "UNAVAILABLE",
        }, name


async def test_https_refuses_clients_without_a_mesh_certificate(pki: Pki, mesh: SecureMesh) -> None:
    port = mesh.frontend.http.port if mesh.frontend.http is not None else 0
    assert mesh.frontend.url.startswith("https://")
    assert (await https(port, ssl_client(pki, pki.client), "GET", "/health"))[0] == 200
    for leaf in (None, pki.other_ca, pki.expired):
        status, _ = await https(port, ssl_client(pki, leaf), "GET", "/health")
        assert status is None, leaf
    # Plain HTTP on the HTTPS port gets no HTTP answer.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    assert not raw.startswith(b"HTTP/1.1 200")


async def test_a_request_crosses_frontend_router_and_worker_over_mtls(pki: Pki, mesh: SecureMesh) -> None:
    port = mesh.frontend.http.port if mesh.frontend.http is not None else 0
    body = {"model": "mocker", "prompt": "hello over mTLS", "max_tokens": 5}
    status, payload = await https(port, ssl_client(pki, pki.client), "POST", "/v1/completions", body)
    assert status == 200, payload
    assert b'"completion_tokens":5' in payload.replace(b" ", b"")
    assert mesh.worker.servicer is not None and mesh.worker.servicer.requests_served >= 1


async def test_reflection_answers_over_mtls(pki: Pki, mesh: SecureMesh) -> None:
    for address in grpc_servers(mesh).values():
        async with grpc.aio.secure_channel(address, grpc_credentials(pki, pki.client)) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = [s.name async for resp in call for s in resp.list_services_response.service]
        assert "grpc.health.v1.Health" in names and any(n.startswith("meshllm.v1.") for n in names), names


async def test_a_running_worker_serves_replaced_certificate_files_to_new_connections(pki: Pki, tmp_path: Path) -> None:
    files = pki.ca.issue("worker-v1")
    sec = MeshSecurity(tls=TlsConfig(cert=files.cert, key=files.key, ca=files.ca))
    config = secure_worker_config(sec)
    async with await Worker.start(mocker(), config) as worker:
        port = int(worker.address.rsplit(":", 1)[1])
        tls = ssl_client(pki, pki.client, alpn=["h2"])
        old = grpc.aio.secure_channel(worker.address, grpc_credentials(pki, pki.client))
        try:
            assert await peer_certificate_cn(port, tls) == "worker-v1"
            assert await health_status(worker.address, grpc_credentials(pki, pki.client)) == "SERVING"
            await grpc.aio.Channel.channel_ready(old)
            # Rotate: write the new pair over the files the worker was started with.
            v2 = pki.ca.issue("worker-v2")
            files.key.write_bytes(v2.key.read_bytes())
            files.cert.write_bytes(v2.cert.read_bytes())
            await wait_until(
                lambda: _cn_is(port, tls, "worker-v2"),
                timeout_s=10,
                what="the new certificate on a new connection",
            )
            assert await health_status(worker.address, grpc_credentials(pki, pki.client)) == "SERVING"
            # The connection made before the rotation keeps working.
            resp = await health_pb2_grpc.HealthStub(old).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await old.close()


def secure_worker_config(sec: MeshSecurity, *, session_port: int | None = None) -> WorkerConfig:
    """An in-process mocker worker with `sec`, quiet (no canaries), its sessions on TCP too when `session_port` is set."""
    return WorkerConfig(
        engine="mocker", plane=PLANE, grace_period_s=0.0, health_check_interval_s=3600, security=sec,
        server=ServerConfig(session_port=session_port),
    )  # fmt: skip


async def _cn_is(port: int, ctx: ssl.SSLContext, cn: str) -> bool:
    return await peer_certificate_cn(port, ctx) == cn


async def test_a_rotated_client_certificate_is_used_by_new_channels(pki: Pki, mesh: SecureMesh, tmp_path: Path) -> None:
    files = pki.ca.issue("rotating-client")
    sec = MeshSecurity(tls=TlsConfig(cert=files.cert, key=files.key, ca=files.ca))
    async with ChannelCache(security=sec) as channels:
        first = channels.get(mesh.worker.address)
        assert (await WorkerClient(channels, mesh.worker.address).get_info()).engine.model == "mocker"
        # Replace the client's files with a certificate from a CA the servers do not trust: new channels must use it.
        foreign = DevPki.create(tmp_path / "elsewhere").issue("rotating-client")
        files.key.write_bytes(foreign.key.read_bytes())
        files.cert.write_bytes(foreign.cert.read_bytes())
        await wait_until(lambda: channels.get(mesh.worker.address) is not first, timeout_s=10, what="a new channel")
        with pytest.raises(Unavailable):  # the worker refuses the handshake: the new certificate was presented
            await WorkerClient(channels, mesh.worker.address).get_info(timeout_s=3)


async def test_a_workers_session_port_serves_replaced_certificate_files_to_new_connections(pki: Pki) -> None:
    """The TCP session port (plane/request/tcp_session.py) follows certificate files as the gRPC port does."""
    files = pki.ca.issue("worker-v1")
    sec = MeshSecurity(tls=TlsConfig(cert=files.cert, key=files.key, ca=files.ca))
    config = secure_worker_config(sec, session_port=0)
    async with await Worker.start(mocker(), config) as worker:
        assert worker.server is not None and worker.server.session_port is not None
        port = worker.server.session_port
        tls = ssl_client(pki, pki.client)
        assert await peer_certificate_cn(port, tls) == "worker-v1"
        v2 = pki.ca.issue("worker-v2")
        files.key.write_bytes(v2.key.read_bytes())
        files.cert.write_bytes(v2.cert.read_bytes())
        await wait_until(lambda: _cn_is(port, tls, "worker-v2"), timeout_s=10, what="the new certificate on the session port")


async def test_a_rotated_client_certificate_is_used_by_new_tcp_sessions(pki: Pki, tmp_path: Path) -> None:
    files = pki.ca.issue("rotating-client")
    sec = MeshSecurity(tls=TlsConfig(cert=files.cert, key=files.key, ca=files.ca))
    server_files = pki.ca.issue("worker-tcp")
    server_sec = MeshSecurity(tls=TlsConfig(cert=server_files.cert, key=server_files.key, ca=server_files.ca))
    config = secure_worker_config(server_sec, session_port=0)
    request = {"request_id": "r", "model": "mocker", "token_ids": [5, 6, 7], "stop": {"max_tokens": 2}}
    async with await Worker.start(mocker(), config) as worker, ChannelCache(security=sec) as channels:
        assert worker.server is not None
        channels.route_sessions(worker.address, f"127.0.0.1:{worker.server.session_port}")

        async def one_stream(rid: str) -> list[TokenChunk]:
            make = channels.session_call(worker.address, "Worker")
            assert make is not None
            session = SessionClient(make, "worker", "/meshllm.v1.Worker/Generate")
            try:
                return [c async for c in session.generate({**request, "request_id": rid})]  # type: ignore[typeddict-item]
            finally:
                await session.aclose()

        assert (await one_stream("before"))[-1]["finish_reason"] == "length"
        # Replace the client's files with a certificate from a CA the worker does not trust.
        foreign = DevPki.create(tmp_path / "elsewhere").issue("rotating-client")
        files.key.write_bytes(foreign.key.read_bytes())
        files.cert.write_bytes(foreign.cert.read_bytes())

        async def refused() -> bool:
            try:
                await one_stream("after")
            except Unavailable:
                return True  # the worker refused the handshake: the new certificate was presented
            return False

        await wait_until(refused, timeout_s=10, what="a new TCP session with the new certificate")


def test_unusable_tls_files_are_one_line_startup_errors(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--tls-cert .* cannot read"):
        TlsConfig(cert=tmp_path / "missing.pem", key=pki.worker.key)
    with pytest.raises(ConfigError, match="does not belong to the certificate"):
        TlsConfig(cert=pki.worker.cert, key=pki.router.key)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="not a PEM certificate"):
        TlsConfig(cert=garbage, key=pki.worker.key)
    with pytest.raises(ConfigError, match="must be given together"):
        TlsConfig.from_values(str(pki.worker.cert), "", "")
    assert TlsConfig.from_values("", "", "") is None


async def test_public_apis_without_client_certificates_while_the_mesh_stays_mtls(pki: Pki) -> None:
    mesh = await start_secure_mesh(pki, api_client_certs=False)
    try:
        assert mesh.frontend.http is not None and mesh.frontend.grpc_address is not None
        no_cert = ssl_client(pki, None)
        body = {"model": "mocker", "prompt": "public client", "max_tokens": 3}
        status, payload = await https(mesh.frontend.http.port, no_cert, "POST", "/v1/completions", body)
        assert status == 200, payload  # served through the router and the worker over mTLS
        assert await health_status(mesh.frontend.grpc_address, grpc_credentials(pki, None)) == "SERVING"
        assert await health_status(mesh.router.address, grpc_credentials(pki, None)) == "UNAVAILABLE"
        assert await health_status(mesh.worker.address, grpc_credentials(pki, None)) == "UNAVAILABLE"
    finally:
        await mesh.aclose()


async def test_the_https_api_serves_replaced_certificate_files_to_new_connections(pki: Pki, mesh: SecureMesh) -> None:
    assert mesh.frontend.http is not None
    port, tls = mesh.frontend.http.port, ssl_client(pki, pki.client)
    assert await peer_certificate_cn(port, tls) == "frontend"
    v2 = pki.ca.issue("frontend-v2")
    pki.frontend.key.write_bytes(v2.key.read_bytes())
    pki.frontend.cert.write_bytes(v2.cert.read_bytes())
    await wait_until(lambda: _cn_is(port, tls, "frontend-v2"), timeout_s=10, what="the new HTTPS certificate")
    assert (await https(port, tls, "GET", "/health"))[0] == 200
