"""The chat/completion semantics both edges share: admit → model → preprocess → upstream → postprocess.

    completion = await core.begin(text_request)      # 4xx/5xx errors surface here
    try:
        async for delta in completion.deltas(): ...  # text per choice, finish reasons
        completion.usage()                           # OpenAI usage with cached tokens
    finally:
        await completion.aclose()                    # cancels whatever still runs upstream

HTTP (`app.py`) and gRPC (`grpc_api.py`) are thin edges around this. Choice
`i` of a request with n > 1 (or several prompts) is its own upstream request;
their streams are merged as they arrive. Closing a completion, or cancelling
the task iterating it (a client disconnect), closes every upstream stream at
once, which cancels the gRPC calls down to the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from meshllm.errors import MeshError, Overloaded, StreamIncomplete, Unavailable
from meshllm.frontend.http.auth import ANONYMOUS
from meshllm.frontend.metrics import FrontendMetrics, ObservationBatch
from meshllm.frontend.models import ModelRegistry, ServedModel, Tokenization
from meshllm.frontend.openai.capability_checks import check_capabilities
from meshllm.frontend.text.output_parsers import OutputParser, ParserChoice
from meshllm.frontend.text.postprocess import ChoiceStream, Delta
from meshllm.frontend.text.preprocess import Plan, preprocess
from meshllm.frontend.upstream import Upstream
from meshllm.lifecycle import Admission, Admits
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.openai import TextRequest, usage_body
from meshllm.protocol.types import TokenChunk

__all__ = ["Completion", "InferenceCore"]

T = TypeVar("T")


class InferenceCore(Admits):
    """Admission (`max_inflight` → Overloaded), model lookup and request start."""

    def __init__(
        self,
        registry: ModelRegistry,
        upstream: Upstream,
        metrics: FrontendMetrics,
        *,
        max_inflight: int = 0,
        retry_after_s: float = 1.0,
        parsers: ParserChoice | None = None,
    ) -> None:
        self.registry = registry
        self.parsers = parsers if parsers is not None else ParserChoice()  # reasoning / tool-call parsers per model
        self.upstream = upstream
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.admission = Admission(on_change=metrics.inflight.inc)
        self._open: set[Completion] = set()
        # Request ids: a random prefix per core and a counter (unique without a uuid4 syscall per request;
        # nothing is looked up by them, so they need not be unguessable).
        self._id_prefix = secrets.token_hex(8)
        self._id_counter = itertools.count()

    async def begin(
        self,
        req: TextRequest,
        *,
        call: CallInfo | None = None,
        t0: float | None = None,
        tenant: str = ANONYMOUS,
        client_request_id: str | None = None,
    ) -> Completion:
        """Admit and preprocess a request; raises the MeshError a user should see.

        The request's id inside the mesh (load accounting, migration, aborts) is always made here;
        `client_request_id` (the client's own id, default the body's `request_id`) only names the
        response and travels beside it in the `client_request_id` annotation, for logs and traces.
        """
        if not self.admitting:
            raise Unavailable("the frontend is shutting down")
        if self.max_inflight and self.inflight >= self.max_inflight:
            raise Overloaded(f"too many requests in flight ({self.inflight}); retry later", retry_after_s=self.retry_after_s)
        self.admission.enter()
        try:
            model = self.registry.lookup(req.model)
            tk = await self.registry.tokenization(model)
            kind = "chatcmpl" if req.kind == "chat" else "cmpl"
            rid = f"{kind}-{self._id_prefix}{next(self._id_counter):016x}"
            client_id = client_request_id if client_request_id is not None else req.request_id
            await check_capabilities(req, model, self.registry)  # a 400 before any engine work
            outputs = self.parsers.factory(req, model.name, model.card, tk.template)
            annotations = {"tenant": tenant} if client_id is None else {"tenant": tenant, "client_request_id": client_id}
            plan = await preprocess(req, model, tk, rid, alone=self.inflight == 1, annotations=annotations)
        except BaseException:
            self.admission.exit()
            raise
        t0 = time.perf_counter() if t0 is None else t0
        completion = Completion(self, req, model, tk, plan, client_id or rid, call, t0, outputs=outputs)
        completion.internal_id, completion.tenant = rid, tenant
        return completion

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    def cut_all(self, err: MeshError) -> int:
        """End every open stream with `err` (the drain deadline passed); returns how many were open.

        Each stream raises `err` from `deltas()` at once: the HTTP API sends it as
        an OpenAI error event before the stream ends, the gRPC API as the call's status.
        """
        open_now = list(self._open)
        for c in open_now:
            c.cut(err)
        return len(open_now)


class Completion:
    """One admitted request: iterate `deltas()`, then read `usage()`; always `aclose()`."""

    def __init__(
        self,
        core: InferenceCore,
        req: TextRequest,
        model: ServedModel,
        tk: Tokenization,
        plan: Plan,
        request_id: str,
        call: CallInfo | None,
        t0: float,
        *,
        outputs: Callable[[], OutputParser | None] | None = None,
    ) -> None:
        self.core = core
        self.request = req
        self.model = model
        self.tokenization = tk
        self.plan = plan
        self.id = request_id  # the response's id: the client's own when it sent one
        self.internal_id = request_id  # the id inside the mesh: always the frontend's (InferenceCore.begin)
        self.tenant = ANONYMOUS
        self.created = int(time.time())
        self.call = call
        self.t0 = t0
        prompt_logprobs = req.prompt_logprobs_asked() is not None
        self.choices = [
            ChoiceStream(
                i,
                tk,
                plan.prompts[p].token_ids,
                stop=req.stop,
                skip_special_tokens=req.skip_special_tokens,
                logprobs=req.logprobs is not None,
                prompt_logprobs=prompt_logprobs,
                prompt_index=p,
                output=outputs() if outputs is not None else None,
            )
            for i, p in enumerate(plan.prompt_of)
        ]
        self._metrics = core.metrics.for_model(model.name)
        self._itl = ObservationBatch(self._metrics.itl)  # per-chunk ITL, added to the histogram in batches
        self._first_token_at: float | None = None
        self._gen: AsyncIterator[Delta] | None = None
        self._closed = False
        # cut(): the error to raise, and whether the task is waiting on upstream (only there is it cancelled)
        self._cut: MeshError | None = None
        self._task = asyncio.current_task()
        self._upstream_wait = False
        self.direct: Callable[[Delta], bool] | None = None  # an edge's writer of plain deltas (_direct_single)
        core._open.add(self)

    # ------------------------------------------------------------ streaming
    def deltas(self) -> AsyncIterator[Delta]:
        """Deltas of every choice as they come; ends when every choice has finished."""
        if self._gen is None:
            if len(self.choices) > 1:
                self._gen = self._merged()
            else:
                self._gen = self._single() if self.direct is None else self._direct_single(self.direct)
        return self._gen

    def _observe(self, chunk: TokenChunk, last: list[float]) -> None:
        n = len(chunk.get("token_ids") or ())
        if not n:
            return
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.ttft.observe(now - self.t0)
        elif last[0]:
            self._itl.observe((now - last[0]) / n, n)  # once per token, as the metric's help says
        last[0] = now

    def cut(self, err: MeshError) -> None:
        """End this stream with `err`: at once when waiting on upstream, else before its next upstream read."""
        if self._cut is not None or self._closed:
            return
        self._cut = err
        if self._upstream_wait and self._task is not None:
            self._task.cancel()

    async def _next(self, read: Callable[[], Awaitable[T]]) -> T:
        """One upstream read (a chunk, a queue item) that `cut()` can interrupt with its error."""
        if self._cut is not None:
            raise self._cut
        self._upstream_wait = True
        try:
            return await read()
        except BaseException:
            if self._cut is None:
                raise
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()
            raise self._cut from None
        finally:
            self._upstream_wait = False

    async def _single(self) -> AsyncIterator[Delta]:
        choice = self.choices[0]
        last = [0.0]
        stream = self.core.upstream.generate(self.plan.requests[0], call=self.call)
        chunks = aiter(stream)
        try:
            while True:
                try:
                    chunk = await self._next(chunks.__anext__)
                except StopAsyncIteration:
                    break
                self._observe(chunk, last)
                delta = choice.feed(chunk)
                yield delta
                if choice.finished:
                    return
        finally:
            await _aclose(stream)
        raise StreamIncomplete("the upstream stream ended without a terminal chunk")

    # size: the direct stream's chunk handler, pump and consumer share its state: one function whose finally ends all
    async def _direct_single(self, direct: Callable[[Delta], bool]) -> AsyncIterator[Delta]:
        """`_single` where the edge writes plain deltas itself, with no task woken per token.

        Every chunk is handled by `take`, in stream order: non-terminal ones in the session reader (the call's
        relay: they skip the upstream generator chain), the rest (terminal, errors, a disaggregated request's
        first tokens, every chunk of an upstream that does not relay) in a pump task that iterates the chain.
        A delta goes to `direct` while this generator is idle (nothing waiting here, no cut); the rest wait
        here, in order, and are yielded. The chain yields a chunk only after every chunk it relayed before.
        """
        choice = self.choices[0]
        last = [0.0]
        backlog: deque[Delta | BaseException | None] = deque()  # None: the chain ended without a terminal
        filled = asyncio.Event()  # set when the backlog gets something
        idle = [False]  # this generator waits for the backlog (nothing of it in flight): `direct` may write
        broken = [False]

        def wake() -> None:
            filled.set()

        def take(chunk: TokenChunk) -> None:
            if broken[0] or choice.finished:
                return
            try:
                self._observe(chunk, last)
                delta = choice.feed(chunk)
            except Exception as exc:  # raised here, as `_single` would, not in the session reader
                broken[0] = True
                backlog.append(exc)
                wake()
                return
            if backlog or not idle[0] or self._cut is not None or choice.finished or not direct(delta):
                backlog.append(delta)
                wake()

        async def pump() -> None:
            stream = self.core.upstream.generate(self.plan.requests[0], call=(self.call or CallInfo()).relaying(take))
            try:
                async for chunk in stream:
                    take(chunk)
                backlog.append(None)
            except Exception as exc:
                backlog.append(exc)
            finally:
                wake()
                await _aclose(stream)

        task = asyncio.create_task(pump(), name=f"{self.internal_id}-upstream")
        try:
            while True:
                if not backlog:
                    filled.clear()
                    idle[0] = True
                    try:
                        await self._next(filled.wait)
                    finally:
                        idle[0] = False
                    continue
                item = backlog.popleft()
                if item is None:
                    raise StreamIncomplete("the upstream stream ended without a terminal chunk")
                if isinstance(item, BaseException):
                    raise item
                yield item
                if choice.finished:
                    return
        finally:
            broken[0] = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _merged(self) -> AsyncIterator[Delta]:
        queue: asyncio.Queue[tuple[int, TokenChunk | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            stream = self.core.upstream.generate(self.plan.requests[i], call=self.call)
            try:
                async for chunk in stream:
                    queue.put_nowait((i, chunk))
                queue.put_nowait((i, None))
            except Exception as exc:
                queue.put_nowait((i, exc))
            finally:
                await _aclose(stream)

        tasks = [asyncio.create_task(pump(i), name=f"{self.internal_id}-choice-{i}") for i in range(len(self.choices))]
        lasts = [[0.0] for _ in self.choices]
        open_choices = len(self.choices)
        try:
            while open_choices:
                i, item = await self._next(queue.get)
                choice = self.choices[i]
                if choice.finished:
                    continue
                if item is None:
                    raise StreamIncomplete("an upstream stream ended without a terminal chunk")
                if isinstance(item, BaseException):
                    raise item
                self._observe(item, lasts[i])
                delta = choice.feed(item)
                if choice.finished:
                    open_choices -= 1
                    tasks[i].cancel()
                yield delta
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ results
    def usage(self) -> dict[str, Any]:
        """OpenAI usage: each prompt counted once, every choice's completion tokens, cached prompt tokens."""
        prompt = cached = 0
        seen: set[int] = set()
        for c in self.choices:
            if c.prompt_index not in seen:
                seen.add(c.prompt_index)
                prompt += c.prompt_tokens
                cached += c.cached_tokens
        return usage_body(prompt, sum(c.completion_tokens for c in self.choices), cached)

    async def aclose(self) -> None:
        """Cancel what still runs upstream, record metrics, leave admission (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.core._open.discard(self)
        try:
            if self._gen is not None:
                await _aclose(self._gen)
        finally:
            self._itl.flush()
            m = self._metrics
            m.e2e.observe(time.perf_counter() - self.t0)
            u = self.usage()
            m.input_tokens.inc(u["prompt_tokens"])
            m.output_tokens.inc(u["completion_tokens"])
            m.cached_tokens.inc(u["prompt_tokens_details"]["cached_tokens"])
            self.core.admission.exit()


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(MeshError, RuntimeError, StopAsyncIteration):
            await aclose()
