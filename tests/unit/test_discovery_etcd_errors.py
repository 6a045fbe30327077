"""The etcd backend's one error translation, and its argument checks (no etcd needed)."""

from __future__ import annotations

import aetcd
import grpc
import pytest

from meshllm.config import ConfigError
from meshllm.errors import CannotConnect, InvalidArgument, NotFound, Unavailable
from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.plane.discovery.etcd_client import etcd_error


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def wrapped(exc_type: type[aetcd.ClientError], cause: grpc.aio.AioRpcError) -> aetcd.ClientError:
    """An aetcd error raised `from` a grpc error, as aetcd raises them."""
    try:
        raise exc_type(cause.details()) from cause
    except aetcd.ClientError as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (aetcd.ConnectionFailedError("refused"), CannotConnect),
        (rpc_error(grpc.StatusCode.UNAVAILABLE, "socket closed"), CannotConnect),
        (wrapped(aetcd.ClientError, rpc_error(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")),
         NotFound),
        (aetcd.ClientError("etcdserver: requested lease not found"), NotFound),
        (aetcd.ConnectionTimeoutError("deadline"), Unavailable),
        (aetcd.WatchTimeoutError(), Unavailable),
        (aetcd.RevisionCompactedError(7), Unavailable),
        (TimeoutError(), Unavailable),
    ],
)  # fmt: skip
def test_etcd_errors_become_mesh_errors(exc: BaseException, expected: type[Exception]) -> None:
    """Locks: every aetcd / grpc failure maps to CannotConnect, NotFound or Unavailable, naming the endpoint."""
    err = etcd_error(exc, "put", "127.0.0.1:2379")
    assert type(err) is expected
    assert "127.0.0.1:2379" in err.message and "put" in err.message


def test_etcd_discovery_checks_its_arguments() -> None:
    """Locks: bad endpoints or TTLs fail at construction with a clear error."""
    with pytest.raises(InvalidArgument):
        EtcdDiscovery([], "meshllm")
    with pytest.raises(ConfigError):
        EtcdDiscovery(["no-port"], "meshllm")
    with pytest.raises(InvalidArgument):
        EtcdDiscovery(["127.0.0.1:2379"], "meshllm", lease_ttl_s=0)
