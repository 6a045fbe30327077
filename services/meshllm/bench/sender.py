"""Sending one benchmark request over HTTP and timing it; `HttpSender` for the replayer.

`one_request` posts a streaming request on a keep-alive connection and
records TTFT, the gaps between events with text, the end, and the usage the
server reported. It never raises for a failed request: the record's `error`
says what went wrong (`connection_error` tells a server that went away from
a request the server refused).
"""

from __future__ import annotations

import asyncio
import time

import orjson

from meshllm.bench.http import Connection, Endpoint, HttpError
from meshllm.bench.report import RequestRecord
from meshllm.bench.trace import TraceRequest
from meshllm.bench.workload import BenchRequest

__all__ = ["CONNECTION_ERROR_PREFIX", "HttpSender", "is_connection_error", "one_request"]

CONNECTION_ERROR_PREFIX = "HttpError: "  # how a transport failure's record error starts (see is_connection_error)


def is_connection_error(error: str | None) -> bool:
    """Whether a record's error says the server could not be reached or dropped the connection."""
    return error is not None and error.startswith(CONNECTION_ERROR_PREFIX) and "bad status line" not in error


async def one_request(conn: Connection, req: BenchRequest, timeout_s: float = 600.0) -> RequestRecord:
    """Send one streaming request and time its events."""
    rec = RequestRecord(intended_prompt_tokens=req.isl)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            await _exchange(conn, req, rec, t0)
    except TimeoutError:
        rec.error = f"timed out after {timeout_s:g}s"
        await conn.close()
    except HttpError as exc:
        rec.error = f"{CONNECTION_ERROR_PREFIX}{exc}" if exc.connection else f"HttpError (protocol): {exc}"
    except (ValueError, orjson.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.e2e = time.perf_counter() - t0
    return rec


async def _exchange(conn: Connection, req: BenchRequest, rec: RequestRecord, t0: float) -> None:
    last = 0.0
    loads = orjson.loads
    resp = await conn.post(req.path, req.body)
    if resp.status != 200:
        body = await resp.read()
        rec.error = f"HTTP {resp.status}: {body[:300].decode(errors='replace')}"
        return
    events = 0
    async for data in resp.events():
        if data == b"[DONE]":
            continue
        obj = loads(data)
        if "error" in obj:
            rec.error = f"stream error: {obj['error'].get('message', obj['error'])}"
            continue
        choices = obj.get("choices")
        if choices:
            c = choices[0]
            delta = c.get("delta")
            text = delta.get("content") if delta is not None else c.get("text")
            if text:
                now = time.perf_counter()
                if rec.ttft is None:
                    rec.ttft = now - t0
                else:
                    rec.gaps.append(now - last)
                last = now
                events += 1
        usage = obj.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens", 0)
            rec.completion_tokens = usage.get("completion_tokens", 0)
            if (details := usage.get("prompt_tokens_details")) and "cached_tokens" in details:
                rec.cached_tokens = details["cached_tokens"]
    rec.events = events
    if not rec.completion_tokens:
        rec.completion_tokens = events


class HttpSender:
    """Sends requests to an OpenAI endpoint; a replay `Send`, `aclose()` closes its connection pool.

    A `BenchRequest` goes as built. A `TraceRequest` goes to /v1/completions
    with `prompt` = its token ids, streaming, `max_tokens` = its output length,
    with `ignore_eos` (as for the synthetic workload) unless
    `ignore_eos=False`; the record carries the usage's
    `prompt_tokens_details.cached_tokens` when the endpoint sends it.
    Keep-alive connections are pooled, so overlapping requests each get one.
    """

    def __init__(
        self, endpoint: Endpoint, model: str, *, ignore_eos: bool = True, temperature: float | None = None,
        timeout_s: float = 600.0,
    ) -> None:  # fmt: skip
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self._fields: dict[str, object] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            self._fields["ignore_eos"] = True
        if temperature is not None:
            self._fields["temperature"] = temperature
        self._idle: list[Connection] = []

    def request(self, req: TraceRequest) -> BenchRequest:
        body = orjson.dumps({**self._fields, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens})
        return BenchRequest("/completions", body, req.max_tokens, len(req.prompt_token_ids), req.arrival_s)

    async def __call__(self, req: TraceRequest | BenchRequest) -> RequestRecord:
        conn = self._idle.pop() if self._idle else Connection(self.endpoint)
        bench_req = req if isinstance(req, BenchRequest) else self.request(req)
        try:
            rec = await one_request(conn, bench_req, self.timeout_s)
        except BaseException:  # cancelled mid-stream: the connection is in an unknown state
            await conn.close()
            raise
        self._idle.append(conn)
        return rec

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()
