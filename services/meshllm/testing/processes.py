"""A `meshllm` command run as a real subprocess, for integration tests.

    proc = MeshllmProcess("worker", "--engine", "sample", "--static")
    address = await proc.address()      # reads "... serving on HOST:PORT"
    ...
    await proc.stop()                   # SIGTERM, then SIGKILL after 30 s

stdout lines are read in a thread (never blocking the loop); stderr goes to a
file, so a chatty process never stalls on a full pipe.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

__all__ = ["MeshllmProcess"]


class MeshllmProcess:
    """`python -m meshllm ARGS` with extra environment variables, run by `prefix` if given (e.g. `ip netns exec NS`)."""

    def __init__(self, *args: str, env: Mapping[str, str] | None = None, prefix: Sequence[str] = ()) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "meshllm", *args],
            stdout=subprocess.PIPE, stderr=self.stderr, stdin=subprocess.DEVNULL, env=full_env, text=True,
        )  # fmt: skip

    async def line(self, timeout_s: float = 60.0) -> str:
        """The next stdout line; AssertionError (with stderr) if the process ended."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        if not line:
            raise AssertionError(f"process ended ({self.proc.poll()}): {self.stderr_tail()}")
        return line.rstrip("\n")

    async def address(self, timeout_s: float = 60.0) -> str:
        """The address of a `meshllm worker` from its "serving on HOST:PORT" line."""
        line = await self.line(timeout_s)
        assert "serving on" in line, line
        return line.rsplit(" ", 1)[-1]

    def stderr_tail(self, n: int = 3000) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-n:]

    async def wait(self, timeout_s: float = 30.0) -> int:
        return await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)

    def send_signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill9(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        """SIGTERM, SIGKILL after 30 s; closes the pipes. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                await self.wait(30)
            except TimeoutError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
        if not self.stderr.closed:
            self.stderr.close()
