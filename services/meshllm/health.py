"""`meshllm health ADDRESS [SERVICE]`: exit 0 when a meshllm gRPC server answers SERVING.

For container healthchecks (compose, Kubernetes exec probes): every meshllm
server serves the standard grpc.health.v1 service.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["check", "main"]


async def check(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The health status name of `service` at `address` (e.g. "SERVING")."""
    async with grpc.aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: meshllm health HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    try:
        status = asyncio.run(check(argv[0], argv[1] if len(argv) > 1 else ""))
    except grpc.aio.AioRpcError as exc:
        print(f"meshllm health: {argv[0]}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1
