"""Readiness and metrics probes of a started system: a one-shot HTTP GET, a Prometheus sum, a bounded poll.

Readiness is observed, never slept for: a probe is polled until it holds or its deadline passes
(`meshllm.testing.waiting.wait_until`; its AssertionError names what was awaited).
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from collections.abc import Awaitable, Callable

import orjson

from meshllm.bench.http import Endpoint
from meshllm.testing.mesh import metric
from meshllm.testing.waiting import wait_until

__all__ = ["READY_S", "healthy", "http_get", "metric_sum", "until", "until_models"]

READY_S = 120.0


async def http_get(port: int, path: str, timeout_s: float = 5.0, *, tls: bool = False) -> tuple[int, bytes]:
    """A one-shot HTTP/1.0 GET on 127.0.0.1 (HTTPS when `tls`, trusting $SSL_CERT_FILE); (0, b'') when nothing answers."""
    ctx = ssl.create_default_context() if tls else None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), timeout_s)
    except (OSError, TimeoutError, ssl.SSLError):
        return 0, b""
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    except (OSError, TimeoutError):
        return 0, b""
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        return 0, b""


def metric_sum(text: bytes, name: str) -> float:
    """Sum of every sample of metric `name` (any labels) in a Prometheus text exposition."""
    return metric(text.decode(errors="replace"), name)


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = READY_S, poll_s: float = 0.05) -> float:
    """Poll `check` until it holds (meshllm.testing's one polling loop); the seconds it took."""
    return await wait_until(check, timeout_s=timeout_s, interval_s=poll_s, what=what)


async def healthy(url: str, timeout_s: float = READY_S) -> None:
    """Until `url`/health answers 200."""
    ep = Endpoint.parse(url)

    async def check() -> bool:
        status, _ = await http_get(ep.port, "/health", tls=ep.scheme == "https")
        return status == 200

    await until(f"{url}/health answers 200", check, timeout_s)


def _models(url: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as resp:
            return [str(m["id"]) for m in orjson.loads(resp.read()).get("data", [])]
    except (OSError, ValueError, KeyError):
        return []


async def until_models(url: str, timeout_s: float = READY_S, *, alive: Callable[[], bool] = lambda: True) -> list[str]:
    """Until `url`/v1/models lists a model (any OpenAI server, ours or not); the model ids. RuntimeError as soon as
    `alive()` is false (the server's process ended)."""
    models: list[str] = []

    async def check() -> bool:
        if not alive():
            raise RuntimeError(f"{url} stopped before it served a model")
        models[:] = await asyncio.to_thread(_models, url)
        return bool(models)

    await until(f"{url} serves a model", check, timeout_s, poll_s=0.2)
    return models
