"""The frames of a Generate session on TCP: a 5-byte header (kind, little-endian payload length) and the payload.

`encode_frame` and `FrameReader` are the codec; `FrameConnection` is one
connection's framing and flow control (an asyncio protocol): complete frames
of each read go to a callback at once, and writers wait only while the
kernel's buffer is full. The frame kinds and what they carry are in
`meshllm.plane.request.tcp_session` and docs/protocol.md ("Sessions on TCP").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import cast

from meshllm.errors import InvalidArgument, MeshError

__all__ = ["DOWN", "END", "HEADER", "HELLO", "UP", "FrameConnection", "FrameReader", "encode_frame"]

log = logging.getLogger(__name__)

HEADER = struct.Struct("<BI")
HELLO, UP, DOWN, END = 1, 2, 3, 4


def encode_frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


class FrameReader:
    """Splits a byte stream into (kind, payload) frames; a frame over `max_bytes` is a protocol error."""

    __slots__ = ("_buf", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self._buf = bytearray()
        self.max_bytes = max_bytes

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        frames: list[tuple[int, bytes]] = []
        at, size, head = 0, len(buf), HEADER.size
        while size - at >= head:
            kind, length = HEADER.unpack_from(buf, at)
            if length > self.max_bytes or kind not in (HELLO, UP, DOWN, END):
                raise InvalidArgument(f"bad session frame (kind {kind}, {length} bytes; at most {self.max_bytes})")
            end = at + head + length
            if end > size:
                break
            frames.append((kind, bytes(buf[at + head : end])))
            at = end
        if at:
            del buf[:at]
        return frames


class FrameConnection(asyncio.Protocol):
    """One connection's framing and flow control; frames go to `on_frame`, the end to `on_lost`."""

    def __init__(
        self, max_bytes: int, on_frame: Callable[[int, bytes], None], on_lost: Callable[[Exception | None], None]
    ) -> None:
        self.reader = FrameReader(max_bytes)
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._paused: asyncio.Future[None] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        with contextlib.suppress(OSError, AttributeError):
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except MeshError as exc:
            self.abort(exc)
            return
        for kind, payload in frames:
            self.on_frame(kind, payload)
            if self.lost:
                return

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        self.on_lost(exc)

    def pause_writing(self) -> None:
        self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)
        self._paused = None

    def write(self, kind: int, payload: bytes) -> None:
        if self.transport is not None and not self.lost:
            self.transport.write(encode_frame(kind, payload))

    async def drain(self) -> None:
        """Wait while the kernel's buffer is full (the peer reads slowly)."""
        if self._paused is not None:
            await self._paused

    def abort(self, exc: MeshError | None = None) -> None:
        if exc is not None:
            log.debug("session connection closed: %s", exc.message)
        if self.transport is not None:
            self.transport.abort()
