"""Processes a benchmark starts: any OpenAI server by its command line, and meshllm's own commands' ready lines.

    async with server_process([sys.executable, "-m", "llama_cpp.server", ..., "--port", str(port)], port=port) as s:
        ...  # s.url serves a model; s.pid is the process to meter
    async with meshllm_server(MeshllmProcess("run", ..., "--http-port", "0")) as s:
        ...  # the same for a `meshllm run` or `meshllm frontend`, stopped on exit

A server's stderr goes to a file (a chatty server never stalls on a full pipe) and its tail is printed when the
server fails to start. Stopping is SIGTERM, then SIGKILL after 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from harness.probes import READY_S, until_models
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import free_port

__all__ = [
    "Served",
    "free_port",
    "meshllm_server",
    "ready_match",
    "ready_url",
    "rotated",
    "server_process",
    "serving_address",
]

OPENAI_LINE = r"OpenAI HTTP API\s+(?:on\s+)?(\S+)/v1"  # `meshllm run` and `meshllm frontend` print it when up


@dataclass(frozen=True, slots=True)
class Served:
    url: str
    pid: int
    models: tuple[str, ...]


@contextlib.asynccontextmanager
async def server_process(
    argv: Sequence[str], *, port: int, env: Mapping[str, str] | None = None, ready_s: float = READY_S
) -> AsyncIterator[Served]:
    """Start `argv` (an OpenAI server listening on 127.0.0.1:`port`), yield once it lists a model, stop it on exit."""
    with tempfile.TemporaryFile() as log:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=log, stdin=asyncio.subprocess.DEVNULL,
            env=None if env is None else dict(env),
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                models = await until_models(url, ready_s, alive=lambda: proc.returncode is None)
            except BaseException:
                log.seek(0)
                tail = log.read()[-1500:].decode(errors="replace")
                print(f"  {list(argv[:4])!r} did not serve (exit {proc.returncode}): {tail}", flush=True)
                raise
            yield Served(url, proc.pid, tuple(models))
        finally:
            if proc.returncode is None:
                proc.terminate()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 30)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def meshllm_server(proc: MeshllmProcess, ready_s: float = READY_S, models_s: float = READY_S) -> AsyncIterator[Served]:
    """Yield a started `meshllm run` or `meshllm frontend` once it prints its URL (within `ready_s`) and lists a
    model (within `models_s`); stop it on exit, also when it never got ready."""
    try:
        url = await ready_url(proc, ready_s)
        yield Served(url, proc.proc.pid, tuple(await until_models(url, models_s)))
    finally:
        await proc.stop()


async def ready_match(proc: MeshllmProcess, pattern: str, timeout_s: float = READY_S) -> re.Match[str]:
    """The first stdout line of `proc` that matches `pattern` (engines may print their own lines first)."""
    async with asyncio.timeout(timeout_s):
        while True:
            if m := re.search(pattern, await proc.line(timeout_s)):
                return m


async def ready_url(proc: MeshllmProcess, timeout_s: float = READY_S) -> str:
    """The base URL (without /v1) a `meshllm run` or `meshllm frontend` prints when it serves."""
    return (await ready_match(proc, OPENAI_LINE, timeout_s))[1]


async def serving_address(proc: MeshllmProcess, timeout_s: float = READY_S) -> str:
    """HOST:PORT from a `meshllm worker`'s "serving on" line."""
    return (await ready_match(proc, r"serving on (\S+)$", timeout_s))[1]


def rotated(kinds: Sequence[str], k: int) -> list[str]:
    """`kinds` starting at its k-th: when systems take turns, none always goes first (right after another's
    request) or last."""
    k %= len(kinds)
    return [*kinds[k:], *kinds[:k]]
