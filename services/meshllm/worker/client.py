"""Typed async client of the Worker service: what routers and tests import.

Chunks and requests are the internal TypedDicts; errors are `meshllm.errors`
classes (the same class the worker raised). Dropping a `generate` iterator
cancels the gRPC call, which cancels the request on the worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from meshllm.plane.session import SessionClient
from meshllm.plane.transport import CallInfo, ChannelCache, generate_stream, mesh_error, translate_errors
from meshllm.protocol.convert import request_to_proto
from meshllm.protocol.types import GenerateChunk, GenerateRequest
from meshllm.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["WorkerClient"]

SESSION = "worker-session"


def _session_of(address: str) -> Callable[[grpc.aio.Channel], SessionClient]:
    return lambda channel: SessionClient(
        worker_pb2_grpc.WorkerStub(channel).GenerateSession, f"worker {address}", "/meshllm.v1.Worker/Generate"
    )


class WorkerClient:
    """Client of one worker address over a shared ChannelCache."""

    def __init__(self, channels: ChannelCache, address: str) -> None:
        self.address = address
        self._channels = channels
        self._stub = worker_pb2_grpc.WorkerStub(channels.get(address))

    def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]:
        """Stream chunks, then one terminal, over the process's one session to this worker (plane/session.py).

        A worker in this very process (meshllm run) is called directly (plane/local.py).
        """
        info = call or CallInfo()
        local = self._channels.local.get(self.address) if self._channels.local is not None else None
        if local is not None:
            return local.generate(request, info)
        session = self._channels.shared(self.address, SESSION, _session_of(self.address))
        return session.generate(request, traceparent=info.traceparent, deadline=info.deadline)

    async def generate_call(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]:
        """The same stream as one unary Generate call of its own (what non-meshllm clients use)."""
        info = call or CallInfo()
        rpc = self._stub.Generate(request_to_proto(request), metadata=info.metadata(), timeout=info.timeout())
        async for chunk in generate_stream(rpc, f"worker {self.address}"):
            yield chunk

    async def abort(self, request_id: str) -> bool:
        resp = await translate_errors(self._stub.Abort(worker_pb2.AbortRequest(request_id=request_id)))
        return bool(resp.found)

    async def get_info(self, *, timeout_s: float | None = 10.0) -> worker_pb2.WorkerInfo:
        return await translate_errors(self._stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout_s))

    async def get_kv_snapshot(self, *, timeout_s: float | None = 30.0) -> worker_pb2.KvSnapshot:
        return await translate_errors(self._stub.GetKvSnapshot(worker_pb2.GetKvSnapshotRequest(), timeout=timeout_s))

    async def drain(self) -> int:
        resp = await translate_errors(self._stub.Drain(worker_pb2.DrainRequest()))
        return int(resp.in_flight)

    async def clear_kv_blocks(self) -> int:
        resp = await translate_errors(self._stub.ClearKvBlocks(worker_pb2.ClearKvBlocksRequest()))
        return int(resp.cleared_blocks)

    async def pull_kv(self, kv_handle: bytes, *, layout: str = "", request_id: str = "") -> AsyncIterator[worker_pb2.KvChunk]:
        rpc = self._stub.PullKv(worker_pb2.PullKvRequest(kv_handle=kv_handle, layout=layout, request_id=request_id))
        try:
            async for chunk in rpc:
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise mesh_error(exc) from None

    async def get_model_files(self, names: list[str] | None = None) -> dict[str, bytes]:
        """Fetch whole files by name (all the worker serves when `names` is empty)."""
        files: dict[str, bytearray] = {}
        rpc = self._stub.GetModelFiles(worker_pb2.GetModelFilesRequest(names=names or []))
        try:
            async for chunk in rpc:
                files.setdefault(chunk.name, bytearray()).extend(chunk.data)
        except grpc.aio.AioRpcError as exc:
            raise mesh_error(exc) from None
        return {k: bytes(v) for k, v in files.items()}
