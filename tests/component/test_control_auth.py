"""Control RPCs accept only mesh peers, and a request can be aborted only by its caller (issue 13).

Real gRPC servers: a worker (and a router) with a mesh token refuse every
internal RPC from a caller without it (UNAUTHENTICATED) while health stays
open; under mTLS a caller without a mesh certificate cannot even connect; a
second client that knows a request's id cannot abort the first client's
stream, by token or by certificate.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from tls_support import PLANE, Pki, grpc_credentials, health_status, make_pki, start_secure_mesh

from meshllm.config import ConfigError
from meshllm.engine.sample import SampleEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.plane.auth import TOKEN_HEADER, MeshSecurity
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.types import TokenChunk
from meshllm.router.client import RouterClient
from meshllm.testing.waiting import wait_until
from meshllm.v1 import generate_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from meshllm.worker.client import WorkerClient
from meshllm.worker.runtime import Worker

pytestmark = pytest.mark.timeout(60)

TOKEN = "mesh-secret-0123456789abcdef"
TOKEN_SEC = MeshSecurity(token=TOKEN)


def worker_config(security: MeshSecurity) -> WorkerConfig:
    return WorkerConfig(engine="sample", plane=PLANE, grace_period_s=0.0, health_check_interval_s=3600, security=security)


async def start_worker(security: MeshSecurity, *, token_delay_ms: float = 0.0) -> Worker:
    return await Worker.start(SampleEngine(token_delay_ms=token_delay_ms), worker_config(security))


def control_calls(
    stub: worker_pb2_grpc.WorkerStub, metadata: tuple[tuple[str, str], ...]
) -> dict[str, Callable[[], Awaitable[Any]]]:
    async def pull() -> Any:
        return [c async for c in stub.PullKv(worker_pb2.PullKvRequest(kv_handle=b"x"), metadata=metadata, timeout=5)]

    async def generate() -> Any:
        req = generate_pb2.GenerateRequest(request_id="r", token_ids=[1, 2])
        return [c async for c in stub.Generate(req, metadata=metadata, timeout=5)]

    return {
        "Abort": lambda: stub.Abort(worker_pb2.AbortRequest(request_id="r"), metadata=metadata, timeout=5),
        "ClearKvBlocks": lambda: stub.ClearKvBlocks(worker_pb2.ClearKvBlocksRequest(), metadata=metadata, timeout=5),
        "GetKvSnapshot": lambda: stub.GetKvSnapshot(worker_pb2.GetKvSnapshotRequest(), metadata=metadata, timeout=5),
        "PullKv": pull,
        "Generate": generate,
        "GetInfo": lambda: stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=metadata, timeout=5),
        "Drain": lambda: stub.Drain(worker_pb2.DrainRequest(), metadata=metadata, timeout=5),  # last: it stops the worker
    }


async def status_of(call: Callable[[], Awaitable[Any]]) -> str:
    try:
        await call()
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


async def test_a_worker_with_a_mesh_token_refuses_every_internal_rpc_without_it() -> None:
    async with await start_worker(TOKEN_SEC) as worker:
        assert worker.servicer is not None
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for metadata in ((), ((TOKEN_HEADER, "wrong-token-0123456789"),), ((TOKEN_HEADER, TOKEN[:-1]),)):
                got = {name: await status_of(call) for name, call in control_calls(stub, metadata).items()}
                assert set(got.values()) == {"UNAUTHENTICATED"}, got
            assert worker.servicer.admitting, "a refused Drain must not drain the worker"
            assert await health_status(worker.address, None) == "SERVING"  # health stays open
            # The same calls with the token reach the handlers.
            got = {name: await status_of(call) for name, call in control_calls(stub, ((TOKEN_HEADER, TOKEN),)).items()}
        assert got == {
            "Abort": "OK",
            "ClearKvBlocks": "UNIMPLEMENTED",  # the sample engine has no KV cache
            "GetKvSnapshot": "OK",
            "PullKv": "UNIMPLEMENTED",
            "Generate": "OK",
            "GetInfo": "OK",
            "Drain": "OK",
        }, got
        servicer = worker.servicer
        await wait_until(lambda: not servicer.admitting, timeout_s=10, what="the authorised Drain to drain the worker")


async def test_mesh_clients_send_the_token_and_pass() -> None:
    async with await start_worker(TOKEN_SEC) as worker, ChannelCache(security=TOKEN_SEC) as channels:
        client = WorkerClient(channels, worker.address)
        chunks = [c async for c in client.generate({"request_id": "a", "token_ids": [5], "stop": {"max_tokens": 3}})]
        assert chunks[-1]["finish_reason"] == "length"  # over the Generate session
        chunks = [c async for c in client.generate_call({"request_id": "b", "token_ids": [5], "stop": {"max_tokens": 3}})]
        assert chunks[-1]["finish_reason"] == "length"
        assert (await client.get_kv_snapshot()).worker_id == worker.id


async def test_under_mtls_a_caller_without_a_mesh_certificate_cannot_drain_a_worker(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with await start_worker(pki.security(pki.worker)) as worker:
        assert worker.servicer is not None
        for creds in (grpc_credentials(pki, None), grpc_credentials(pki, pki.other_ca)):
            async with grpc.aio.secure_channel(worker.address, creds) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                got = {name: await status_of(call) for name, call in control_calls(stub, ()).items()}
            assert set(got.values()) == {"UNAVAILABLE"}, got
        assert worker.servicer.admitting


async def test_a_router_with_a_mesh_token_refuses_generate_without_it() -> None:
    mesh = await start_secure_mesh(None, security=TOKEN_SEC)
    try:
        async with grpc.aio.insecure_channel(mesh.router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            req = generate_pb2.GenerateRequest(request_id="r", model="mocker", token_ids=[1, 2])
            assert await status_of(lambda: _drain(stub.Generate(req, timeout=5))) == "UNAUTHENTICATED"
            assert await status_of(lambda: _drain(stub.GenerateSession(iter(()), timeout=5))) == "UNAUTHENTICATED"
        # Mesh clients (here the frontend → router → worker path and a RouterClient) carry the token.
        async with ChannelCache(security=TOKEN_SEC) as channels:
            chunks = [
                c
                async for c in RouterClient(channels, mesh.router.address).generate(
                    {"request_id": "ok", "model": "mocker", "token_ids": [1, 2, 3], "stop": {"max_tokens": 2}}
                )
            ]
        assert chunks[-1]["finish_reason"] == "length"
    finally:
        await mesh.aclose()


async def _drain(call: AsyncIterator[Any]) -> None:
    async for _ in call:
        pass


# ---------------------------------------------------------------- abort scoping


async def first_chunk(stream: AsyncIterator[TokenChunk]) -> TokenChunk:
    return await asyncio.wait_for(anext(stream), 10)


async def abort_scoping(worker: Worker, owner: ChannelCache, other: ChannelCache) -> None:
    """`other` knows the id of `owner`'s request and cannot abort it; `owner` can."""
    mine, theirs = WorkerClient(owner, worker.address), WorkerClient(other, worker.address)
    request = {"request_id": "shared-id", "token_ids": [5], "stop": {"max_tokens": 2000}}
    stream = mine.generate_call(request)  # type: ignore[arg-type]
    await first_chunk(stream)
    assert await theirs.abort("shared-id") is False
    more = await first_chunk(stream)  # still streaming
    assert "finish_reason" not in more
    # Nor can it start its own request under that id to collide with it.
    with pytest.raises(Exception, match="already in flight"):
        await first_chunk(theirs.generate_call(request))  # type: ignore[arg-type]
    assert await mine.abort("shared-id") is True
    rest = [c async for c in stream]
    assert rest[-1]["finish_reason"] == "cancelled"

    # The same over the owner's Generate session: its streams belong to the session's caller.
    session_stream = mine.generate({"request_id": "session-id", "token_ids": [5], "stop": {"max_tokens": 2000}})
    await first_chunk(session_stream)
    assert await theirs.abort("session-id") is False
    assert "finish_reason" not in await first_chunk(session_stream)
    assert await mine.abort("session-id") is True
    assert [c async for c in session_stream][-1]["finish_reason"] == "cancelled"


async def test_a_second_token_holder_cannot_abort_the_first_ones_request() -> None:
    async with (
        await start_worker(TOKEN_SEC, token_delay_ms=20) as worker,
        ChannelCache(security=TOKEN_SEC) as owner,
        ChannelCache(security=TOKEN_SEC) as other,
    ):
        await abort_scoping(worker, owner, other)


async def test_a_client_with_another_certificate_cannot_abort_the_first_ones_request(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    alice, bob = pki.ca.issue("alice"), pki.ca.issue("bob")
    async with (
        await start_worker(pki.security(pki.worker), token_delay_ms=20) as worker,
        ChannelCache(security=Pki.security(pki, alice)) as owner,
        ChannelCache(security=Pki.security(pki, bob)) as other,
    ):
        await abort_scoping(worker, owner, other)


def test_mesh_token_settings_are_checked_at_startup(tmp_path: Path) -> None:
    import argparse

    def ns(**kw: str) -> argparse.Namespace:
        base = {"tls_cert": "", "tls_key": "", "tls_ca": "", "mesh_token": "", "mesh_token_file": ""}
        return argparse.Namespace(**{**base, **kw})

    with pytest.raises(ConfigError, match="too short"):
        MeshSecurity.from_namespace(ns(mesh_token="short"))
    with pytest.raises(ConfigError, match="cannot read"):
        MeshSecurity.from_namespace(ns(mesh_token_file=str(tmp_path / "missing")))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert MeshSecurity.from_namespace(ns(mesh_token_file=str(token_file))).token == TOKEN
    assert TOKEN not in repr(MeshSecurity(token=TOKEN))
    assert not MeshSecurity.from_namespace(ns()).enabled
