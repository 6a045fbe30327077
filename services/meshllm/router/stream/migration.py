"""Migration bookkeeping of one request: what was streamed, what to resend, how usage reads.

A worker stream that breaks before its terminal chunk (`Unavailable` and its
subclasses — connection refused, peer gone, worker draining — or
`StreamIncomplete`) is resent to another worker with the original prompt
plus every token already streamed to the caller, `max_tokens` and
`min_tokens` lowered by that many, the failed workers excluded, at most
`limit` times. The caller sees one stream: usage reports the *original*
prompt length and the cumulative completion tokens.

Guided decoding is never migrated once a token was streamed (the constraint's
state cannot be rebuilt from tokens); resending a request that produced
nothing yet is always safe and allowed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from meshllm.errors import MeshError, StreamIncomplete, Unavailable
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.types import StopSettings, TokenChunk, TokenRequest, TokenUsage

__all__ = ["MIGRATABLE", "MigrationState", "migrating"]

log = logging.getLogger(__name__)

MIGRATABLE: tuple[type[MeshError], ...] = (Unavailable, StreamIncomplete)


class MigrationState:
    """Tokens streamed so far, attempts made, workers excluded — for one request."""

    def __init__(self, request: TokenRequest, *, limit: int) -> None:
        self.request = request
        self.prompt_tokens = len(request["token_ids"])
        self.limit = limit
        self.generated: list[int] = []
        self.attempt = 0
        self.excluded: set[str] = set()
        self.current_worker: str | None = None  # worker of the leg now running (None while routing)
        self.cached_tokens: int | None = None  # prompt tokens the prefill leg found cached (disaggregated)
        self.chunks = 0

    @property
    def guided(self) -> bool:
        return bool(self.request.get("sampling", {}).get("guided"))

    @property
    def max_tokens(self) -> int | None:
        return self.request.get("stop", {}).get("max_tokens")

    def remaining(self) -> int | None:
        """Completion tokens still allowed (None = no limit)."""
        m = self.max_tokens
        return None if m is None else max(0, m - len(self.generated))

    def can_migrate(self) -> bool:
        """Whether the failed attempt may be resent: always when nothing reached the caller yet (each
        resend excludes the failed worker, so the workers bound it), else within the limit and not guided."""
        if not self.chunks and not self.generated:
            return True
        if self.attempt >= self.limit:
            return False
        return not (self.guided and self.generated)

    def migrate(self, failed_worker: str | None) -> None:
        """Record a failed attempt; the next `next_request` goes elsewhere."""
        if failed_worker is not None:
            self.excluded.add(failed_worker)
        self.attempt += 1
        self.current_worker = None
        self.cached_tokens = None

    def next_request(self) -> TokenRequest | None:
        """The request of the next attempt, or None when max_tokens were all streamed already."""
        if self.attempt == 0:
            return self.request
        remaining = self.remaining()
        if remaining == 0:
            return None
        req: TokenRequest = dict(self.request)  # type: ignore[assignment]
        req["request_id"] = f"{self.request['request_id']}:m{self.attempt}"
        req["token_ids"] = [*self.request["token_ids"], *self.generated]
        stop: StopSettings = dict(self.request.get("stop", {}))  # type: ignore[assignment]
        if remaining is not None:
            stop["max_tokens"] = remaining
        if stop.get("min_tokens"):
            stop["min_tokens"] = max(0, stop["min_tokens"] - len(self.generated))
        req["stop"] = stop
        req.pop("disagg", None)
        return req

    def usage(self, leg: TokenUsage | None = None) -> TokenUsage:
        """Usage as the caller must see it."""
        cached = self.cached_tokens if self.cached_tokens is not None else (leg["cached_tokens"] if leg else 0)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.generated),
            "cached_tokens": min(cached, self.prompt_tokens),
        }

    def observe(self, chunk: TokenChunk) -> TokenChunk:
        """Record a chunk about to reach the caller; returns it with usage rewritten."""
        self.chunks += 1
        self.generated.extend(chunk.get("token_ids", ()))
        if "usage" in chunk:
            chunk = {**chunk, "usage": self.usage(chunk["usage"])}
        return chunk

    def relaying(self, call: CallInfo | None) -> CallInfo:
        """`call` (a blank one for None) whose relay, if it has one, gets each chunk after this state has seen it:
        relayed chunks skip `migrating`, which observes the chunks it yields."""
        outer = call or CallInfo()
        outbox = outer.relay
        if outbox is None:
            return outer

        def relay(chunk: TokenChunk) -> None:
            outbox(self.observe(chunk))

        return outer.relaying(relay)

    def length_terminal(self) -> TokenChunk:
        """The terminal for a stream that broke after its last allowed token."""
        return {"token_ids": [], "finish_reason": "length", "usage": self.usage()}

    def error_terminal(self, err: MeshError) -> TokenChunk:
        """The terminal for a stream that fails after tokens reached the caller."""
        return {
            "token_ids": [],
            "finish_reason": "error",
            "usage": self.usage(),
            "error": {"code": err.code, "message": err.message},
        }


# size: the migration driver's per-chunk loop and its retries in one generator whose finally must see every exit
async def migrating(
    state: MigrationState,
    attempt: Callable[[TokenRequest], AsyncGenerator[TokenChunk, None]],
    *,
    peer: str,
    on_failure: Callable[[str | None, MeshError, bool], None] | None = None,
    errors_as_terminal: bool = True,
) -> AsyncGenerator[TokenChunk, None]:
    """Run `attempt`s until one ends with a terminal chunk, re-sending broken ones by the rules above.

    `peer` names what failed in the log ("worker", "router replica"). `on_failure(failed, exc, resent)`
    is told of every failure: a MIGRATABLE one with `failed` = `state.current_worker` (None while
    routing) and whether it is re-sent; any other MeshError with (None, exc, False). A failure that is
    not re-sent is raised when nothing reached the caller yet; after chunks it ends the stream with an
    error terminal (a non-MIGRATABLE one only when `errors_as_terminal`, else it is raised).
    """
    while True:
        req = state.next_request()
        if req is None:
            yield state.length_terminal()
            return
        try:
            async with aclosing(attempt(req)) as stream:
                async for chunk in stream:
                    chunk = state.observe(chunk)
                    yield chunk
                    if "finish_reason" in chunk:
                        return
            raise StreamIncomplete(f"the {peer} stream ended without a terminal chunk")
        except MIGRATABLE as exc:
            failed = state.current_worker
            resend = failed is not None and state.can_migrate()
            if on_failure is not None:
                on_failure(failed, exc, resend)
            if not resend:
                if not state.chunks:
                    raise
                yield state.error_terminal(exc)
                return
            log.warning(
                "request %s: %s %s failed after %d tokens (%s: %s); re-sending (attempt %d of %d)",
                state.request["request_id"], peer, failed, len(state.generated), exc.code, exc.message,
                state.attempt + 1, state.limit,
            )  # fmt: skip
            state.migrate(failed)
        except MeshError as exc:
            if on_failure is not None:
                on_failure(None, exc, False)
            if not errors_as_terminal or not state.chunks:
                raise
            yield state.error_terminal(exc)
            return
