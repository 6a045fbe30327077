"""A userspace TCP proxy that injects network faults, for fault tests (`tc netem` is not available everywhere).

    async with TcpProxy("127.0.0.1", worker_port) as proxy:   # listens on proxy.address
        proxy.latency_s = 0.05          # every chunk arrives 50 ms later, in order, both directions
        proxy.loss = 0.1                # 10% of chunks wait `rto_s` more, like a lost segment TCP resends
        proxy.blackhole()               # forward nothing, close nothing: a partition
        proxy.heal()                    # forward again; connections that lost bytes are reset
        await proxy.cut()               # reset every open connection now

Latency is a pipeline, not a queue: each chunk is held until `latency_s`
(plus jitter) after it was read, so throughput does not drop with latency.
Loss never drops bytes (a TCP stream cannot skip some): a "lost" chunk is
delivered `rto_s` late, which is what the application sees of a lost segment.
A blackhole discards what it reads and opens no upstream connection for new
clients; since such a connection's byte stream now has a hole, `heal()`
resets it (as a real peer would once the retransmissions time out), while
connections that lost nothing resume. Closing cuts every connection; it is
idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from meshllm.lifecycle import AsyncCloseable

__all__ = ["ProxyStats", "TcpProxy"]

_CHUNK = 65536


@dataclass(slots=True)
class ProxyStats:
    """Counters of one proxy since it started."""

    accepted: int = 0
    cut: int = 0
    bytes_up: int = 0  # client → target
    bytes_down: int = 0  # target → client
    bytes_dropped: int = 0
    delayed_chunks: int = 0


@dataclass(eq=False)
class _Link:
    """One proxied connection: the client's streams, the target's once connected, its pump tasks."""

    client_reader: asyncio.StreamReader
    client_writer: asyncio.StreamWriter
    target_writer: asyncio.StreamWriter | None = None
    damaged: bool = False  # lost bytes in a blackhole: reset on heal
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with RST (SO_LINGER 0), as a dropped connection looks to its peer."""
    if writer is None or writer.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpProxy(AsyncCloseable):
    """Listen on `listen_host:listen_port` (0 = ephemeral), forward each connection to `target_host:target_port`."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int | None = None,
    ) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.listen_host, self.listen_port = listen_host, listen_port
        self.latency_s = 0.0
        self.jitter_s = 0.0  # added latency drawn uniformly from [0, jitter_s], never reordering a direction
        self.loss = 0.0  # probability that a chunk is "lost" and delivered rto_s late
        self.rto_s = 0.2
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._blackholed = False
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start listening; `address` is valid afterwards. A second call does nothing."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
            self.listen_port = int(self._server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> TcpProxy:
        await self.start()
        return self

    @property
    def address(self) -> str:
        """`host:port` clients connect to."""
        return f"{self.listen_host}:{self.listen_port}"

    @property
    def connections(self) -> int:
        """Connections open right now."""
        return len(self._links)

    async def _aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.cut()
        if self._server is not None:
            await self._server.wait_closed()

    # ------------------------------------------------------------ faults

    @property
    def blackholed(self) -> bool:
        return self._blackholed

    def blackhole(self) -> None:
        """Stop forwarding in both directions without closing anything; bytes read meanwhile are discarded."""
        self._blackholed = True

    def heal(self) -> None:
        """Forward again; connections that lost bytes in the blackhole are reset (their streams have a hole)."""
        self._blackholed = False
        for link in [link for link in self._links if link.damaged]:
            self._cut(link)

    async def cut(self) -> int:
        """Reset every open connection (RST to both sides); the number cut. New connections are still accepted."""
        links = list(self._links)
        for link in links:
            self._cut(link)
        for link in links:
            await asyncio.gather(*link.tasks, return_exceptions=True)
        return len(links)

    def _cut(self, link: _Link) -> None:
        if link not in self._links:
            return
        self._links.discard(link)
        self.stats.cut += 1
        _reset(link.client_writer)
        _reset(link.target_writer)
        for task in link.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    # ------------------------------------------------------------ forwarding

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link(reader, writer)
        self._links.add(link)
        self.stats.accepted += 1
        link.tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        clean = False
        try:
            while self._blackholed:  # a partitioned target is not dialled; what the client sends is lost
                data = await reader.read(_CHUNK)
                if not data:
                    return
                self._dropped(link, len(data))
            try:
                target_reader, link.target_writer = await asyncio.open_connection(self.target_host, self.target_port)
            except OSError:
                return  # the target refuses: the client's connection is reset
            up = asyncio.create_task(self._pump(link, reader, link.target_writer, up=True))
            down = asyncio.create_task(self._pump(link, target_reader, writer, up=False))
            link.tasks += [up, down]
            clean = all(await asyncio.gather(up, down))
        except (asyncio.CancelledError, OSError):
            pass  # cut(), or a side reset: the connection is reset below
        finally:
            if clean and link in self._links:  # both sides closed in order: close in order too
                self._links.discard(link)
                for w in (writer, link.target_writer):
                    if w is not None:
                        w.close()
            else:
                self._cut(link)

    def _dropped(self, link: _Link, n: int) -> None:
        link.damaged = True
        self.stats.bytes_dropped += n

    async def _pump(self, link: _Link, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, up: bool) -> bool:
        """Deliver `src`'s chunks to `dst` at their due times, then pass EOF on; False if a side was reset."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(link, queue, dst, up=up))
        last_due = 0.0
        try:
            while data := await src.read(_CHUNK):
                if self._blackholed:
                    self._dropped(link, len(data))
                    continue
                due = time.monotonic() + self.latency_s + self._rng.uniform(0.0, self.jitter_s)
                if self.loss and self._rng.random() < self.loss:
                    due += self.rto_s
                    self.stats.delayed_chunks += 1
                last_due = max(last_due, due)  # a direction never reorders
                queue.put_nowait((last_due, data))
            queue.put_nowait((last_due, b""))
            await deliver
            return True
        except OSError:
            self._cut(link)  # a reset on one side is passed on to the other
            return False
        finally:
            deliver.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await deliver

    async def _deliver(
        self, link: _Link, queue: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter, *, up: bool
    ) -> None:
        while True:
            due, data = await queue.get()
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the injected latency itself, not a synchronisation
            if not data:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            if self._blackholed:
                self._dropped(link, len(data))  # in flight when the partition began: never arrives
                continue
            dst.write(data)
            await dst.drain()
            if up:
                self.stats.bytes_up += len(data)
            else:
                self.stats.bytes_down += len(data)
