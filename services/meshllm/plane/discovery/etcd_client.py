"""An `aetcd.Client` that speaks TLS (client certificates too) and authenticates again when etcd forgets its token.

Also the backend's one translation of aetcd and grpc errors into `meshllm.errors`
(`etcd_error`), and its channel options.

aetcd 1.0 opens only plaintext channels and authenticates once, at connect.
`SecureClient` overrides `connect` to open a TLS channel when credentials
ask for one (files read at each connect, so rotated certificates are picked
up by the next connection), closes the channel again when the connect fails
(aetcd leaks it), and offers `reauthenticate()`: etcd's simple tokens live
in memory only, so after an etcd restart every call answers "invalid auth
token" until the client logs in again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher
from aetcd.client import _handle_errors

from meshllm.credentials import EtcdCredentials
from meshllm.errors import CannotConnect, MeshError, NotFound, Unavailable

__all__ = [
    "CHANNEL_OPTIONS",
    "TLS_MARKERS",
    "TRANSLATED",
    "SecureClient",
    "auth_hint",
    "etcd_error",
    "is_auth_failure",
    "is_invalid_token",
]

log = logging.getLogger(__name__)


# Reconnect fast after an etcd restart; ping a live stream (watch) so a dead
# peer is noticed (etcd refuses pings more often than every 5 s, and pings
# without a call in flight).
CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 250,
    "grpc.min_reconnect_backoff_ms": 250,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.http2.max_pings_without_data": 0,
}


def etcd_error(exc: BaseException, what: str, endpoint: str) -> MeshError:
    """The MeshError an aetcd / grpc / timeout error stands for (the one translation)."""
    cause = exc.__cause__ if isinstance(exc.__cause__, grpc.aio.AioRpcError) else exc
    code = cause.code() if isinstance(cause, grpc.aio.AioRpcError) else None
    detail = cause.details() if isinstance(cause, grpc.aio.AioRpcError) else str(exc)
    message = f"etcd {endpoint}: {what} failed: {detail or type(exc).__name__}"
    if isinstance(exc, aetcd.ConnectionFailedError) or code == grpc.StatusCode.UNAVAILABLE:
        return CannotConnect(message)
    if code == grpc.StatusCode.NOT_FOUND or "lease not found" in str(detail):
        return NotFound(message)
    return Unavailable(message)


# How a failed TLS handshake shows in grpc's "failed to connect" details.
TLS_MARKERS = ("ssl", "tls", "handshake", "certificate", "socket closed", "tsi_", "unwrap failed")


def auth_hint(message: str) -> str:
    if "permission denied" in message:
        return "the etcd user needs a role with readwrite on the key prefix 'meshllm/'"
    if "not enabled" in message:
        return "etcd has auth disabled: drop --etcd-user or run `etcdctl auth enable`"
    return "check --etcd-user and the password: MESHLLM_ETCD_PASSWORD or --etcd-password-file"


TRANSLATED = (aetcd.ClientError, grpc.aio.AioRpcError, TimeoutError, OSError)


_AUTH_FAILURES = (
    "authentication failed",
    "authentication is not enabled",
    "user name is empty",
    "user name not found",
    "permission denied",
)


def _status(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    cause = exc.__cause__ if isinstance(exc.__cause__, grpc.aio.AioRpcError) else exc
    if isinstance(cause, grpc.aio.AioRpcError):
        return cause.code(), cause.details() or ""
    return None, str(exc)


def is_invalid_token(exc: BaseException) -> bool:
    """etcd no longer knows the client's auth token (restarted, or the token expired): log in again."""
    code, detail = _status(exc)
    return code == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in detail


def is_auth_failure(exc: BaseException) -> bool:
    """etcd refused who we are: wrong user or password, no user while auth is on, or no permission."""
    code, detail = _status(exc)
    return code == grpc.StatusCode.PERMISSION_DENIED or any(m in detail for m in _AUTH_FAILURES)


class SecureClient(aetcd.Client):
    """`aetcd.Client` with TLS from `EtcdCredentials` and re-authentication."""

    # Set by aetcd.Client (untyped); declared for the type checker.
    _is_connecting: bool
    metadata: tuple[tuple[str, str], ...] | None

    def __init__(self, host: str, port: int, credentials: EtcdCredentials, *, tls: bool, **kwargs: Any) -> None:
        super().__init__(host, port, username=credentials.user or None, password=credentials.password or None, **kwargs)
        self._credentials = credentials
        self._tls = tls

    @_handle_errors
    async def connect(self) -> None:
        """Open the channel (TLS when configured) and log in when a user is configured."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self._tls:
                self.channel = rpc.secure_channel(target, self._credentials.channel_credentials(), options=options)
            else:
                self.channel = rpc.insecure_channel(target, options=options)
            try:
                await self._authenticate()
            except BaseException:
                channel, self.channel = self.channel, None
                await channel.close()
                raise
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False

    async def _authenticate(self) -> None:
        if not self._credentials.user:
            return
        self.auth_stub = rpc.AuthStub(self.channel)
        request = rpc.AuthenticateRequest(name=self._credentials.user, password=self._credentials.password)
        reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
        self.metadata = (("token", reply.token),)

    @_handle_errors
    async def reauthenticate(self) -> None:
        """Log in again on the open channel; later calls and new watch streams carry the new token."""
        if self.channel is None or not self._credentials.user:
            return
        await self._authenticate()
        if self._watcher is not None:
            self._watcher._metadata = self.metadata
        log.info("etcd: authenticated again as %r", self._credentials.user)
