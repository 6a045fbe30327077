"""`DirectSse`: a chat stream's plain content events written from where its tokens arrive, not by its task.

A streamed chat answer is, after its first event, one content event per
engine step until the last: `data: {...,"delta":{"content":"…"},...}`. Each
used to wake the request's task and climb its generator chain (session pipe,
router leg, migration, choice, SSE encoder, `write_ready`) to reach the ASGI
`send`. With `DirectSse.take` as the completion's `direct`
(`Completion._direct_single`), the session reader that receives a token
detokenizes it and writes its event at once: the same bytes `sse_events`
makes, through the same `send`, and no task wakes.

A delta is taken only when that keeps the stream's order and framing:

- the response has started and its first event is out (`live`), and the
  request's own writes (`write`: its first event, the last ones, anything
  `take` declined) are not in flight;
- it is a plain content delta of choice 0: no finish reason, logprobs,
  reasoning or tool calls (those go to `sse_events`, after every delta
  before them). A delta without text (held back by the detokenizer or a stop
  string) is taken and writes nothing, as `sse_events` skips it.

`send` is driven by hand (`send(None)`): an ASGI server's `send` returns at
once unless the client is not reading and the transport is paused. Then its
coroutine goes on in a task of its own, and `take` declines until `write`
or `settle` has awaited it, so no event overtakes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import orjson

from meshllm.frontend.http.ready_writes import resumed
from meshllm.frontend.openai.bodies import content_event_frame
from meshllm.frontend.openai.inference import Completion
from meshllm.frontend.text.postprocess import Delta
from meshllm.protocol.openai import TextRequest

__all__ = ["DirectSse", "direct_eligible"]

Send = Any  # the ASGI send callable


def direct_eligible(req: TextRequest, c: Completion) -> bool:
    """Whether a streamed request's content events can be written directly (one chat choice, no per-token extras)."""
    return req.stream and req.kind == "chat" and len(c.choices) == 1 and not req.continuous_usage and req.logprobs is None


async def _finish(step: Coroutine[Any, Any, Any], waiting: Any) -> None:
    await resumed(step, waiting)


class DirectSse:
    """Writes a single-choice chat stream's plain content events straight through `send` (module docstring)."""

    __slots__ = ("_buffer", "_dumps", "_inflight", "_prefix", "_suffix", "error", "live", "send", "writing")

    def __init__(self, send: Send, c: Completion) -> None:
        self.send = send
        req = c.request
        self._prefix, self._suffix = content_event_frame(c.id, c.created, req.model, 0, req.include_usage)
        self._dumps = orjson.dumps
        self.live = False  # between the stream's first event and its last ones
        self.writing = False  # the request's task is in `write`
        self._inflight: asyncio.Future[None] | None = None  # a direct write waiting for a paused transport
        self.error: BaseException | None = None  # a direct write's failure, raised by the next `write`
        self._buffer: list[bytes] = []  # events taken this turn of the loop, written together at its end

    def take(self, d: Delta) -> bool:
        """Write `d`'s event now and return True, or return False: the request's task writes it, in order."""
        if not self.live or self.writing or self._inflight is not None:
            return False
        # sse_events' own test for its plain content event (and for a delta it skips), field for field
        if d.index or d.finish_reason is not None or d.logprobs is not None or d.prompt_logprobs is not None:
            return False
        if d.reasoning or d.tool_calls:
            return False
        if not d.text:
            return True
        if not self._buffer:
            asyncio.get_running_loop().call_soon(self._flush)
        self._buffer.append(self._prefix + self._dumps(d.text) + self._suffix)
        return True

    def _flush(self) -> None:
        if not self._buffer:
            return
        data, self._buffer = b"".join(self._buffer), []
        if self.error is not None:
            return
        step = self.send({"type": "http.response.body", "body": data, "more_body": True})
        try:
            waiting = step.send(None)
        except StopIteration:
            return
        except BaseException as exc:  # surfaces in the request's task, at its next write
            self.error = exc
            self.live = False
            return
        self._inflight = asyncio.ensure_future(_finish(step, waiting))

    async def settle(self) -> None:
        """Write what was taken; wait for a direct write still in flight; raise a direct write's failure."""
        self._flush()
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            await inflight
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    async def write(self, data: bytes) -> None:
        """The request's own write of `data` (more body to come), after every direct one."""
        self.writing = True
        try:
            await self.settle()
            await self.send({"type": "http.response.body", "body": data, "more_body": True})
        finally:
            self.writing = False

    def close(self) -> None:
        """No more direct writes; one in flight is dropped (the response is ending or failed)."""
        self.live = False
        self._buffer = []
        if self._inflight is not None and not self._inflight.done():
            self._inflight.cancel()
        self._inflight = None
