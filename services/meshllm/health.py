"""`meshllm health ADDRESS [SERVICE]`: exit 0 when a meshllm gRPC server answers SERVING.

For container healthchecks (compose, Kubernetes exec probes): every meshllm
server serves the standard grpc.health.v1 service. Over TLS give the
process's own `--tls-cert/--tls-key/--tls-ca` (or the same `MESHLLM_TLS_*`
variables as the service it probes).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshllm.config import ConfigError, EnvArgumentParser
from meshllm.lifecycle import command_error
from meshllm.plane.tls import TlsConfig, TlsFiles, channel_credentials

__all__ = ["check", "main"]


async def check(address: str, service: str = "", timeout_s: float = 3.0, *, tls: TlsConfig | None = None) -> str:
    """The health status name of `service` at `address` (e.g. "SERVING"); over TLS when `tls` is given."""
    if tls is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, channel_credentials(TlsFiles(tls).current()))
    async with channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def main(argv: Sequence[str]) -> int:
    parser = EnvArgumentParser(prog="meshllm health", env=os.environ, description="probe a meshllm gRPC server's health")
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help="service name (default: the server as a whole)")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate (TLS)")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default="", help="PEM CA bundle the server is verified against")
    ns = parser.parse_args(list(argv))
    try:
        tls = TlsConfig.from_values(ns.tls_cert, ns.tls_key, ns.tls_ca)
        status = asyncio.run(check(ns.address, ns.service, tls=tls))
    except ConfigError as exc:
        return command_error("health", exc.message)
    except grpc.aio.AioRpcError as exc:
        print(f"meshllm health: {ns.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1
