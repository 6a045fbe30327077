"""Where the frontend sends token-level requests: the `Upstream` seam and its router-replica form.

An upstream is anything with the router's `generate` signature: the embedded
`meshllm.router.RouterCore`, one `RouterClient`, or `RouterReplicas` (several
router processes, `--router-address a,b`). The frontend never talks to
workers directly; the router picks them.

Contract (the router's): the stream ends with exactly one terminal chunk;
an unknown model raises `NotFound`, no live worker `Unavailable`; dropping the
iterator cancels the request all the way to the engine.

`RouterReplicas` keeps a request alive across router processes:

- Before a replica's first chunk, a replica that fails (`Unavailable`,
  `StreamIncomplete`) is skipped for the next one, round-robin.
- When no replica can be reached (connection refused, a replica draining or
  restarting), the request waits for one — at most `wait_s`
  (`--router-wait-s`), waking as soon as a connection is up — then fails with
  `Unavailable` (HTTP 503). A replica that answered with an error of its own
  (e.g. no live worker) is not waited for.
- A router stream that breaks after its first chunk resumes on another replica
  (the one that broke last in line) with the rules of the router's worker
  migration, `meshllm.router.stream.migration.MigrationState`: the original prompt
  plus every token already streamed, `max_tokens`/`min_tokens` lowered by
  that many, at most the model's migration limit times, never for guided
  decoding once a token was streamed. The caller sees one stream: the same
  tokens as an unbroken run and usage with the original prompt length.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Protocol

from meshllm.errors import CannotConnect, Disconnected, EngineShutdown, MeshError, StreamIncomplete, Unavailable, Unknown
from meshllm.plane.discovery.base import Discovery
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.router.stream.migration import MIGRATABLE, MigrationState, migrating

__all__ = ["DEFAULT_MIGRATION_LIMIT", "DEFAULT_ROUTER_WAIT_S", "RouterReplicas", "Upstream", "follow_router_sessions"]

log = logging.getLogger(__name__)

DEFAULT_ROUTER_WAIT_S = 5.0
DEFAULT_MIGRATION_LIMIT = 3  # a model whose card is not known yet: the router's and worker's default
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.05, 0.5  # between rounds while no replica answers (a connection wakes it sooner)
GONE: tuple[type[MeshError], ...] = (CannotConnect, Disconnected, EngineShutdown, StreamIncomplete)
# What a broken connection can surface as (gRPC's bare UNAVAILABLE / UNKNOWN "Internal error from Core"):
# without a meshllm error trailer, or from a replica that is no longer reachable, these mean the
# replica is gone, not that it refused. (A reset connection can fail a call while the channel
# still reports itself connected.)
TRANSPORT: tuple[type[MeshError], ...] = (Unavailable, StreamIncomplete, Unknown)


class Upstream(Protocol):
    """The router's generate signature: token-level request in, chunks out."""

    def generate(self, request: TokenRequest, *, call: CallInfo | None = None) -> AsyncIterator[TokenChunk]: ...


class Replica(Protocol):
    """One router replica as `RouterReplicas` uses it (`meshllm.router.RouterClient`)."""

    address: str

    def generate(self, request: TokenRequest, *, call: CallInfo | None = None) -> AsyncIterator[TokenChunk]: ...

    def reachable(self) -> bool: ...

    async def wait_reachable(self) -> None: ...


class RouterReplicas:
    """Router replicas (`--router-address a,b`): round-robin, failover, bounded wait, resume (module docstring)."""

    def __init__(
        self,
        clients: Sequence[Replica],
        *,
        wait_s: float = DEFAULT_ROUTER_WAIT_S,
        migration_limit: Callable[[str], int] | None = None,
    ) -> None:
        if not clients:
            raise ValueError("RouterReplicas needs at least one client")
        self._clients = list(clients)
        self._next = itertools.count()
        self.wait_s = wait_s
        self._limit = migration_limit or (lambda _model: DEFAULT_MIGRATION_LIMIT)
        self.resumed = 0  # router streams resumed on another replica (tests, logs)

    @classmethod
    def connect(
        cls,
        channels: ChannelCache,
        addresses: Sequence[str],
        client: Callable[[ChannelCache, str], Replica],
        *,
        wait_s: float = DEFAULT_ROUTER_WAIT_S,
        migration_limit: Callable[[str], int] | None = None,
    ) -> RouterReplicas:
        return cls([client(channels, a) for a in addresses], wait_s=wait_s, migration_limit=migration_limit)

    def generate(self, request: TokenRequest, *, call: CallInfo | None = None) -> AsyncIterator[TokenChunk]:
        """Attempts until one ends with its terminal chunk; `state.current_worker` is the replica streaming now."""
        state = MigrationState(request, limit=self._limit(request.get("model", "")))
        if call is not None:
            call = state.relaying(call)  # relayed chunks are seen by the migration state too

        def failure(failed: str | None, exc: MeshError, resent: bool) -> None:
            self.resumed += resent

        return migrating(
            state, lambda req: self._open(req, call, state), peer="router replica", on_failure=failure, errors_as_terminal=False
        )

    def _order(self, excluded: set[str]) -> list[Replica]:
        start = next(self._next) % len(self._clients)
        order = self._clients[start:] + self._clients[:start]
        return [c for c in order if c.address not in excluded] + [c for c in order if c.address in excluded]

    async def _open(self, req: TokenRequest, call: CallInfo | None, state: MigrationState) -> AsyncGenerator[TokenChunk, None]:
        """The stream of the first replica that answers with a chunk; waits (bounded) while none can be reached."""
        state.current_worker = None
        deadline: float | None = None
        pause = FIRST_PAUSE_S
        while True:
            last: MeshError | None = None
            gone: list[Replica] = []
            for target in self._order(state.excluded):
                stream = target.generate(req, call=call)
                relayed = state.chunks  # chunks the caller's relay got from this replica before the first yielded
                try:
                    first = await anext(stream)
                except StopAsyncIteration:
                    if state.chunks > relayed:
                        state.current_worker = target.address
                        raise StreamIncomplete(f"router {target.address} ended the stream without a terminal") from None
                    last = StreamIncomplete(f"router {target.address} ended the stream without a chunk")
                    gone.append(target)
                    continue
                except MeshError as exc:
                    await _aclose(stream)
                    if state.chunks > relayed:  # tokens reached the caller: a break mid-stream, for `migrating`
                        state.current_worker = target.address
                        raise _midstream(exc, target) from None
                    if _gone(exc, target):
                        gone.append(target)
                    elif not isinstance(exc, MIGRATABLE):
                        raise  # the replica's own answer (bad request, unknown model, ...)
                    log.debug("router %s did not take request %s: %s", target.address, req["request_id"], exc.message)
                    last = exc
                    continue
                state.current_worker = target.address
                try:
                    yield first
                    async for chunk in stream:
                        yield chunk
                except MeshError as exc:
                    raise _midstream(exc, target) from None
                finally:
                    await _aclose(stream)
                return
            assert last is not None
            if not gone:
                raise last  # every replica answered with an error of its own: waiting would not help
            now = time.monotonic()
            deadline = self._wait_deadline(deadline, now, call, last)
            await _any_reachable(gone, min(pause, deadline - now))
            pause = min(2 * pause, LONGEST_PAUSE_S)

    def _wait_deadline(self, deadline: float | None, now: float, call: CallInfo | None, last: MeshError) -> float:
        """Until when a request waits for a reachable replica (`--router-wait-s`, or its own deadline); Unavailable past it."""
        if deadline is None:
            deadline = now + self.wait_s
            if call is not None and call.deadline is not None:
                deadline = min(deadline, call.deadline)
        if now >= deadline:
            where = ", ".join(c.address for c in self._clients)
            raise Unavailable(f"no router replica could be reached within {self.wait_s:g} s ({where}): {last.message}") from None
        return deadline


def _midstream(exc: MeshError, target: Replica) -> MeshError:
    """A replica's stream that broke after chunks reached the caller, as `migrating` takes it."""
    if not isinstance(exc, MIGRATABLE) and _gone(exc, target):
        return Disconnected(f"router {target.address} went away: {exc.message}")
    return exc


def _gone(exc: MeshError, target: Replica) -> bool:
    """Whether `exc` says the replica cannot be reached (down, restarting, draining) rather than that it refused."""
    return isinstance(exc, GONE) or (isinstance(exc, TRANSPORT) and (exc.from_transport or not target.reachable()))


async def _any_reachable(replicas: Sequence[Replica], timeout_s: float) -> None:
    """Return when one of `replicas` has a connection up (connecting as needed), or after `timeout_s`."""
    waiting = [asyncio.ensure_future(r.wait_reachable()) for r in replicas if not r.reachable()]
    try:
        if waiting:
            await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        else:  # connected but refusing (draining): nothing announces when it is gone or back
            await asyncio.sleep(timeout_s)
    finally:
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


async def _aclose(stream: AsyncIterator[TokenChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def follow_router_sessions(discovery: Discovery, channels: ChannelCache, addresses: Sequence[str]) -> None:
    """Keep `channels`' session routes to the routers at `addresses` (`--router-address`) as their discovery records
    say: a router registered under one of those addresses with a `session_address` (`meshllm router --session-port`)
    gets its sessions on TCP (plane/request/tcp_session.py), any other keeps them on gRPC — e.g. one named by a Service in
    front of it, whose record holds its own address. Runs until cancelled."""
    wanted = set(addresses)
    async for snapshot in discovery.watch_instances():  # any component: a router's --component may be its own
        registered = {i.address: i.session_address for i in snapshot.values() if i.address in wanted}
        for address in wanted:
            channels.route_sessions(address, registered.get(address, ""))
