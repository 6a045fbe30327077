"""Typed async client of the Worker service: what routers and tests import.

Chunks and requests are the internal TypedDicts; errors are `meshllm.errors`
classes (the same class the worker raised). Dropping a `generate` iterator
cancels the stream, which cancels the request on the worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from meshllm.plane.request.peers import PeerClient, session_key
from meshllm.plane.request.transport import mesh_error, translate_errors
from meshllm.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["WorkerClient"]

SESSION = session_key("Worker")


class WorkerClient(PeerClient):
    """Client of one worker address over a shared ChannelCache."""

    service = "Worker"
    stub_class = worker_pb2_grpc.WorkerStub

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
