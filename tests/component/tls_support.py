"""Shared pieces of the TLS tests: certificates, a secured mesh of real servers, raw TLS clients."""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshllm.certs import CertFiles, DevPki
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.plane.auth import MeshSecurity
from meshllm.plane.tls import TlsConfig
from meshllm.testing.minimesh import MiniMesh, start_mini_mesh

PLANE = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
MODEL = "mocker"


@dataclass
class Pki:
    """The mesh CA's certificates and the bad ones: another CA's, an expired one."""

    ca: DevPki
    dir: Path
    worker: CertFiles
    router: CertFiles
    frontend: CertFiles
    client: CertFiles
    other_ca: CertFiles
    expired: CertFiles

    def security(self, leaf: CertFiles, *, mutual: bool = True) -> MeshSecurity:
        return MeshSecurity(tls=TlsConfig(cert=leaf.cert, key=leaf.key, ca=leaf.ca if mutual else None))


def make_pki(directory: Path) -> Pki:
    ca, other = DevPki.create(directory, common_name="mesh CA"), DevPki.create(directory / "other", common_name="intruder CA")
    return Pki(
        ca,
        directory,
        worker=ca.issue("worker"),
        router=ca.issue("router"),
        frontend=ca.issue("frontend"),
        client=ca.issue("client"),
        other_ca=other.issue("other"),
        expired=ca.issue("expired", expired=True),
    )


def mocker() -> MockerEngine:
    return MockerEngine(MockerConfig(block_size=16, num_gpu_blocks=4096, speedup_ratio=1000.0, context_length=2048))


SecureMesh = MiniMesh


async def start_secure_mesh(
    pki: Pki | None, *, security: MeshSecurity | None = None, api_client_certs: bool = True
) -> SecureMesh:
    """A mocker worker, a router server and a frontend that uses the router (not an embedded core).

    All with mTLS from `pki` (each its own certificate), or all with `security`.
    """

    def sec(name: str) -> MeshSecurity:
        if pki is None:
            assert security is not None
            return security
        return pki.security(getattr(pki, name))

    return await start_mini_mesh(
        engine=mocker(), security=sec, via_router=True, router_mode="kv", max_inflight=4096, api_client_certs=api_client_certs
    )


# ---------------------------------------------------------------- raw clients


def grpc_credentials(pki: Pki, leaf: CertFiles | None) -> grpc.ChannelCredentials:
    """Client credentials trusting the mesh CA, presenting `leaf` (None = no certificate)."""
    if leaf is None:
        return grpc.ssl_channel_credentials(root_certificates=pki.ca.ca_path.read_bytes())
    return grpc.ssl_channel_credentials(pki.ca.ca_path.read_bytes(), leaf.key.read_bytes(), leaf.cert.read_bytes())


async def health_status(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """SERVING / NOT_SERVING, or the status code name of the failed call (a refused handshake: UNAVAILABLE)."""
    channel = grpc.aio.insecure_channel(address) if credentials is None else grpc.aio.secure_channel(address, credentials)
    async with channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def ssl_client(pki: Pki, leaf: CertFiles | None, *, alpn: list[str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=pki.ca.ca_path.read_text())
    if leaf is not None:
        ctx.load_cert_chain(leaf.cert, leaf.key)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


async def https(port: int, ctx: ssl.SSLContext, method: str, path: str, body: Any = None) -> tuple[int | None, bytes]:
    """One HTTP/1.1 request over TLS: (status, body), status None when the server refused the connection."""
    data = b"" if body is None else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), 10)
        try:
            writer.write(head.encode() + data)
            raw = await asyncio.wait_for(reader.read(-1), 10)
        finally:
            writer.close()
    except (ssl.SSLError, ConnectionError, OSError):
        return None, b""
    if not raw.startswith(b"HTTP/1.1 "):
        return None, raw
    headers, _, payload = raw.partition(b"\r\n\r\n")
    return int(headers.split()[1]), payload


async def peer_certificate_cn(port: int, ctx: ssl.SSLContext) -> str:
    """The common name of the certificate a TLS server presents to a new connection."""
    _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), 10)
    try:
        cert = writer.get_extra_info("peercert")
    finally:
        writer.close()
    return next(v for rdn in cert["subject"] for k, v in rdn if k == "commonName")
