"""Where the frontend sends token-level requests: the `Upstream` seam and its router-replica form.

An upstream is anything with the router's `generate` signature: the embedded
`meshllm.router.RouterCore`, one `RouterClient`, or `RouterReplicas` (several
router processes, `--router-address a,b`). The frontend never talks to
workers directly; the router picks them.

Contract (the router's): the stream ends with exactly one terminal chunk;
an unknown model raises `NotFound`, no live worker `Unavailable`; dropping the
iterator cancels the request all the way to the engine.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from meshllm.errors import CannotConnect, Unavailable
from meshllm.plane.transport import CallInfo, ChannelCache
from meshllm.protocol.types import GenerateChunk, GenerateRequest

__all__ = ["RouterReplicas", "Upstream"]

log = logging.getLogger(__name__)


class Upstream(Protocol):
    """The router's generate signature: token-level request in, chunks out."""

    def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]: ...


class _Generating(Protocol):
    address: str

    def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]: ...


async def _first_of(
    candidates: Sequence[_Generating], request: GenerateRequest, call: CallInfo | None
) -> AsyncIterator[GenerateChunk]:
    """Stream from the first candidate that answers; fail over on connection errors before the first chunk."""
    last: Unavailable | None = None
    for target in candidates:
        stream = target.generate(request, call=call)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return
        except (CannotConnect, Unavailable) as exc:  # includes EngineShutdown: a draining peer
            log.debug("upstream %s unavailable: %s", target.address, exc.message)
            last = exc
            await _aclose(stream)
            continue
        try:
            yield first
            async for chunk in stream:
                yield chunk
        finally:
            await _aclose(stream)
        return
    raise last if last is not None else Unavailable("no upstream is configured")


async def _aclose(stream: AsyncIterator[GenerateChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class RouterReplicas:
    """Round-robin over router replicas (`--router-address a,b`), failing over before the first chunk."""

    def __init__(self, clients: Sequence[_Generating]) -> None:
        if not clients:
            raise ValueError("RouterReplicas needs at least one client")
        self._clients = list(clients)
        self._next = itertools.count()

    @classmethod
    def connect(
        cls, channels: ChannelCache, addresses: Sequence[str], client: Callable[[ChannelCache, str], _Generating]
    ) -> RouterReplicas:
        return cls([client(channels, a) for a in addresses])

    def generate(self, request: GenerateRequest, *, call: CallInfo | None = None) -> AsyncIterator[GenerateChunk]:
        start = next(self._next) % len(self._clients)
        order = self._clients[start:] + self._clients[:start]
        return _first_of(order, request, call)
