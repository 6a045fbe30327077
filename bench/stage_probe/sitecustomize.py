"""Stage timestamps for bench/mesh_stages.py: loaded by every Python process started with this folder on PYTHONPATH.

Does nothing unless MESHLLM_BENCH_STAGES names a folder. Then it wraps a few
functions of the request path (frontend, session client and server, mocker
engine) so that each appends `<perf_counter> <pid> <stage>` to
`<folder>/stages.log` when a request passes it. `time.perf_counter` is
CLOCK_MONOTONIC on Linux, one clock for every process of the machine, so the
lines of the frontend and of the workers can be merged. Only the benchmark
loads this; the services never import it.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

ENV = "MESHLLM_BENCH_STAGES"
TARGETS = (
    # (module, class, method): what a request passes, in order (see bench/mesh_stages.py STAGES)
    ("meshllm.frontend.http.app", "OpenAIApp", "_generate_traced"),
    ("meshllm.frontend.openai.inference", "InferenceCore", "begin"),
    ("meshllm.plane.request.session_client", "_ClientSession", "open"),
    ("meshllm.plane.request.session", "_ServerSession", "_start"),
    ("meshllm.engine.mocker.engine", "MockerEngine", "generate"),
    ("meshllm.plane.request.session", "_ServerSession", "push"),
    ("meshllm.plane.request.session_client", "_Pipe", "put"),
    ("meshllm.frontend.http.app", "OpenAIApp", "_stream"),
)
WRAPPED: list[str] = []  # "module.Class.method" of each target install() wrapped


def install(folder: str) -> int:
    """Wrap every target; returns how many were wrapped."""
    import importlib

    fd = os.open(os.path.join(folder, "stages.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    clock, pid = time.perf_counter, os.getpid()

    def mark(stage: str) -> None:
        os.write(fd, f"{clock():.7f} {pid} {stage}\n".encode())

    # What already had its first token marked: (session, stream id) keys, and the session pipes themselves (kept
    # alive here, so that a later pipe cannot reuse a collected one's id); a benchmark's few hundred requests.
    firsts: dict[Any, Any] = {}

    def first_token(stage: str, key: Any, owner: Any, chunk: Any) -> None:
        if isinstance(chunk, dict) and chunk.get("token_ids") and key not in firsts:
            firsts[key] = owner
            mark(stage)

    def around(stage_in: str, stage_out: str) -> Callable[[Any], Any]:
        def wrap(fn: Any) -> Any:
            @functools.wraps(fn)
            async def inner(*a: Any, **k: Any) -> Any:
                mark(stage_in)
                try:
                    return await fn(*a, **k)
                finally:
                    mark(stage_out)

            return inner

        return wrap

    def before(stage: str) -> Callable[[Any], Any]:
        def wrap(fn: Any) -> Any:  # marks when called (for a coroutine function: when its request arrives)
            @functools.wraps(fn)
            def inner(*a: Any, **k: Any) -> Any:
                mark(stage)
                return fn(*a, **k)

            return inner

        return wrap

    def engine(fn: Any) -> Any:
        @functools.wraps(fn)
        async def inner(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            mark("engine.start")
            first = True
            relay = getattr(context, "relay", None)
            if relay is not None:  # a session stream's relay: the step loop hands it the chunks, not the iterator

                def marked(chunk: Any) -> None:
                    nonlocal first
                    if first and chunk.get("token_ids"):
                        first = False
                        mark("engine.first_token")
                    relay(chunk)

                context.relay = marked
            async for chunk in fn(self, request, context):
                if first and chunk.get("token_ids"):
                    first = False
                    mark("engine.first_token")
                yield chunk

        return inner

    def server_push(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(self: Any, sid: int, item: Any) -> Any:
            first_token("worker.first_token_queued", (id(self), sid), self, item)
            return fn(self, sid, item)

        return inner

    def pipe_put(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(self: Any, chunk: Any) -> Any:
            first_token("frontend.first_token_received", id(self), self, chunk)
            return fn(self, chunk)

        return inner

    def stream(fn: Any) -> Any:
        @functools.wraps(fn)
        async def inner(self: Any, send: Any, *a: Any, **k: Any) -> Any:
            sent = False

            async def send_marked(message: Any) -> Any:
                nonlocal sent
                if not sent and message.get("type") == "http.response.body":
                    sent = True
                    mark("frontend.first_event_sent")
                return await send(message)

            return await fn(self, send_marked, *a, **k)

        return inner

    wrappers = {
        "_generate_traced": before("frontend.http_request"),
        "begin": around("frontend.preprocess", "frontend.preprocessed"),
        "open": before("frontend.stream_opened"),
        "_start": before("worker.stream_received"),
        "generate": engine,
        "push": server_push,
        "put": pipe_put,
        "_stream": stream,
    }
    for module, cls, name in TARGETS:
        try:
            owner = getattr(importlib.import_module(module), cls)
            original = getattr(owner, name)
        except (ImportError, AttributeError):
            continue
        setattr(owner, name, wrappers[name](original))
        WRAPPED.append(f"{module}.{cls}.{name}")
    return len(WRAPPED)


if os.environ.get(ENV):
    install(os.environ[ENV])
