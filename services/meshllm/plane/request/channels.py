"""One process's channels and Generate sessions to its peers: `ChannelCache`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from meshllm.errors import Cancelled
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.request.liveness import SessionLiveness
from meshllm.plane.request.transport import channel_options

if TYPE_CHECKING:
    from meshllm.plane.auth import ClientSecurity, MeshSecurity
    from meshllm.plane.request.local import LocalPeers

__all__ = ["ChannelCache"]

S = TypeVar("S", bound=AsyncCloseable)


class ChannelCache(AsyncCloseable):
    """One grpc.aio channel per address, shared by every client of a process.

    `shared` keeps one more object per address and key over that channel (the
    Generate session of `meshllm.plane.request.session`); it is closed with the channel.
    `local` (meshllm run) names the peers that live in this process
    (`meshllm.plane.request.local`): clients call those directly instead of over gRPC.
    `liveness` bounds how long the process's sessions may stall.
    `security` (plane/auth.py): channels use TLS with this process's
    certificate and send the mesh token; when the certificate files change,
    channels made from then on use the new ones (channels already made keep
    their connections until they are dropped).
    `session_routes` maps a peer's gRPC address to the TCP address where it
    serves Generate sessions too (`Instance.session_address`,
    plane/request/tcp_session.py); a session opened to a peer listed there uses it.
    """

    def __init__(
        self,
        *,
        max_message_bytes: int = 64 * 1024 * 1024,
        local: LocalPeers | None = None,
        liveness: SessionLiveness | None = None,
        security: MeshSecurity | None = None,
    ) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._security: ClientSecurity | None = None
        if security is not None and security.enabled:
            from meshllm.plane.auth import ClientSecurity

            self._security = ClientSecurity(security)
        self._shared: dict[tuple[str, str], AsyncCloseable] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._options = channel_options(max_message_bytes)
        self.local = local
        self.liveness = liveness if liveness is not None else SessionLiveness()
        self.session_routes: dict[str, str] = {}
        self._max_message_bytes = max_message_bytes
        self._caller_id = uuid.uuid4().hex

    def route_sessions(self, address: str, session_address: str) -> None:
        """Open sessions to the peer at gRPC `address` on TCP at `session_address` ("" = over gRPC)."""
        if session_address:
            self.session_routes[address] = session_address
        else:
            self.session_routes.pop(address, None)

    def session_call(self, address: str, service: str) -> Callable[[], Any] | None:
        """A maker of TCP session calls to `address`'s `service`, or None when it serves sessions on gRPC only."""
        target = self.session_routes.get(address)
        if target is None:
            return None
        from meshllm.plane.request.tcp_session import TcpCall

        self._follow_rotation()  # a new session presents the certificate files as they are now
        sec = self._security
        token, caller = (sec.token, sec.caller_id) if sec is not None else (None, self._caller_id)
        ctx = sec.ssl_context() if sec is not None else None
        limit = self._max_message_bytes
        return lambda: TcpCall(target, service, caller=caller, token=token, ssl_context=ctx, max_message_bytes=limit)

    def _follow_rotation(self) -> None:
        """When the certificate files changed: channels and TCP sessions made from now on use the new ones."""
        if self._security is not None and self._security.rotated():
            self._retired.extend(self._channels.values())  # in-flight calls finish on them; closed with the cache
            self._channels = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if self.closed:
            raise Cancelled("channel cache is closed")
        self._follow_rotation()
        ch = self._channels.get(address)
        if ch is None:
            if self._security is not None:
                ch = self._security.channel(address, self._options)
            else:
                ch = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = ch
        return ch

    def shared(self, address: str, key: str, make: Callable[[grpc.aio.Channel], S]) -> S:
        """The one object `make(channel)` built for (address, key), built on first use."""
        obj = self._shared.get((address, key))
        if obj is None:
            obj = self._shared[(address, key)] = make(self.get(address))
        return obj  # type: ignore[return-value]

    async def drop(self, address: str) -> None:
        """Close and forget the channel to one address (e.g. a worker that left)."""
        shared = [self._shared.pop(k) for k in [k for k in self._shared if k[0] == address]]
        await asyncio.gather(*(obj.aclose() for obj in shared), return_exceptions=True)
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def _aclose(self) -> None:
        shared, self._shared = list(self._shared.values()), {}
        await asyncio.gather(*(obj.aclose() for obj in shared), return_exceptions=True)
        channels, self._channels = [*self._channels.values(), *self._retired], {}
        self._retired = []
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)
