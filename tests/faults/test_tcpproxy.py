"""`meshllm.testing.tcpproxy.TcpProxy` against a real echo server on loopback.

Locks: bytes pass both ways unchanged and in order; latency delays every
chunk by at least `latency_s` per direction; "loss" delivers late but intact;
a blackhole forwards nothing and closes nothing, and `heal()` resets only the
connections that lost bytes; `cut()` resets open connections on both sides;
a refused target resets the client; close is idempotent and stops accepting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from meshllm.testing.tcpproxy import TcpProxy
from meshllm.testing.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class Echo:
    """An echo server that counts its open connections."""

    def __init__(self) -> None:
        self.open = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            self.open -= 1
            writer.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])


@pytest.fixture
async def echo() -> AsyncIterator[Echo]:
    e = Echo()
    e.server = await asyncio.start_server(e._serve, "127.0.0.1", 0)
    async with e.server:
        yield e


async def connect(proxy: TcpProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy.address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), 10)


async def test_forwards_both_ways_in_order_and_closes_idempotently(echo: Echo) -> None:
    proxy = TcpProxy("127.0.0.1", echo.port)
    async with proxy:
        reader, writer = await connect(proxy)
        payload = bytes(range(256)) * 4096  # 1 MiB: many chunks
        assert await roundtrip(reader, writer, payload) == payload
        writer.write_eof()  # a half-close reaches the target, whose close comes back as EOF
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        await wait_until(lambda: proxy.connections == 0 and echo.open == 0, timeout_s=5, what="both sides closed")
        assert proxy.stats.bytes_up == proxy.stats.bytes_down == len(payload) and proxy.stats.cut == 0
    await proxy.aclose()  # a second close is a no-op
    assert proxy.closed
    with pytest.raises(OSError):
        await connect(proxy)


async def test_latency_and_loss_delay_chunks_but_deliver_them_intact(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port, seed=1) as proxy:
        reader, writer = await connect(proxy)
        proxy.latency_s = 0.1
        t0 = time.monotonic()
        assert await roundtrip(reader, writer, b"ping") == b"ping"
        assert time.monotonic() - t0 >= 0.2  # 0.1 s each way
        proxy.latency_s, proxy.loss, proxy.rto_s = 0.0, 1.0, 0.15
        t0 = time.monotonic()
        assert await roundtrip(reader, writer, b"lost once") == b"lost once"
        assert time.monotonic() - t0 >= 0.3 and proxy.stats.delayed_chunks == 2
        proxy.loss = 0.5
        for i in range(20):  # lossy but never reordered or corrupted
            msg = f"message {i:03d}".encode()
            assert await roundtrip(reader, writer, msg) == msg
        writer.close()


async def test_blackhole_holds_connections_open_and_heal_resets_only_damaged_ones(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy:
        quiet_r, quiet_w = await connect(proxy)
        talker_r, talker_w = await connect(proxy)
        assert await roundtrip(quiet_r, quiet_w, b"a") == b"a"
        assert await roundtrip(talker_r, talker_w, b"b") == b"b"
        proxy.blackhole()
        talker_w.write(b"into the void")
        await talker_w.drain()
        await wait_until(lambda: proxy.stats.bytes_dropped == len(b"into the void"), timeout_s=5, what="bytes dropped")
        late_r, late_w = await connect(proxy)  # accepted, never dialled through
        late_w.write(b"x")
        await wait_until(lambda: proxy.stats.bytes_dropped > len(b"into the void"), timeout_s=5, what="late bytes dropped")
        assert proxy.connections == 3 and echo.open == 2 and not talker_r.at_eof()
        proxy.heal()
        for r in (talker_r, late_r):  # their byte streams have a hole: reset
            with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(r.readexactly(1), 10)
        assert await roundtrip(quiet_r, quiet_w, b"still here") == b"still here"
        assert proxy.connections == 1
        for w in (quiet_w, talker_w, late_w):
            w.close()


async def test_cut_resets_both_sides_and_new_connections_still_work(echo: Echo) -> None:
    async with TcpProxy("127.0.0.1", echo.port) as proxy:
        reader, writer = await connect(proxy)
        assert await roundtrip(reader, writer, b"hi") == b"hi"
        assert await proxy.cut() == 1
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 10)
        await wait_until(lambda: echo.open == 0, timeout_s=5, what="the target side to see the cut")
        reader2, writer2 = await connect(proxy)
        assert await roundtrip(reader2, writer2, b"again") == b"again"
        for w in (writer, writer2):
            w.close()


async def test_a_refused_target_resets_the_client() -> None:
    async with TcpProxy("127.0.0.1", 1) as proxy:  # nothing listens on port 1
        reader, writer = await connect(proxy)
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 10)
        writer.close()
