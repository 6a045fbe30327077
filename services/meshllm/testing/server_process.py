"""The process behind each of meshllm.testing's real servers: spawn, wait until it answers, stop, restart.

Ports are chosen free (`free_port`), then bound by the server; a first start that loses its port to another
process in between tries again on new ones (`ServerProcess.start`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from meshllm.lifecycle import AsyncCloseable
from meshllm.ports import free_port

__all__ = ["PORT_ATTEMPTS", "PORT_TAKEN", "ServerBinaryMissing", "ServerProcess", "find_binary", "free_port"]


class ServerBinaryMissing(RuntimeError):
    """The etcd or nats-server binary is not installed."""


def find_binary(name: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}", f"/usr/local/bin/{name}") if os.path.exists(p)), None
    )
    if path is None:
        raise ServerBinaryMissing(f"{name} is not installed (make test installs it with apt-get)")
    return path


PORT_TAKEN = "address already in use"  # etcd's and nats-server's words when their port is bound already
PORT_ATTEMPTS = 3


class ServerProcess(AsyncCloseable):
    name = "server"

    def __init__(self, *, ready_timeout_s: float = 20.0) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix=f"meshllm-{self.name}-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready_timeout_s = ready_timeout_s
        self._log = self._tmp / "server.log"
        self._set_up = False

    def _argv(self) -> list[str]:
        raise NotImplementedError

    async def _probe(self) -> bool:
        raise NotImplementedError

    async def _started(self) -> None:
        """Runs once after the first start (e.g. to enable auth)."""

    def _spawn(self) -> subprocess.Popen[bytes]:
        # A short synchronous fork/exec: acceptable in a test helper.
        with open(self._log, "ab") as logf:
            return subprocess.Popen(
                self._argv(), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    @property
    def pid(self) -> int | None:
        """Process id of the running server (None when stopped)."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _new_ports(self) -> bool:
        """Choose other free ports for a first start whose port was taken; False when the server has none to change."""
        return False

    async def start(self) -> None:
        """Spawn the server and wait until it answers.

        Ports are chosen free, then bound by the server, and another process may take one in between. A first
        start that exits with "address already in use" tries again on new ports (`PORT_ATTEMPTS` in all); a
        restart keeps its ports, as the tests that restart a server expect.
        """
        if self.running:
            return
        for attempt in range(1, PORT_ATTEMPTS + 1):
            offset = self._log.stat().st_size if self._log.exists() else 0
            self._proc = self._spawn()
            if await self._until_ready(offset, retry=not self._set_up and attempt < PORT_ATTEMPTS):
                break
        if not self._set_up:
            self._set_up = True
            await self._started()

    async def _until_ready(self, offset: int, *, retry: bool) -> bool:
        """True once the server answers; False when it lost its port and new ports were chosen (`retry`)."""
        assert self._proc is not None
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if retry and PORT_TAKEN in self._log_since(offset).lower() and self._new_ports():
                    return False
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode}: {self.log_tail()}")
            if await self._probe():
                return True
            await asyncio.sleep(0.05)  # polling a readiness probe, not synchronising on time
        raise RuntimeError(f"{self.name} not ready in {self._ready_timeout_s}s: {self.log_tail()}")

    def _log_since(self, offset: int) -> str:
        try:
            with open(self._log, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self._log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; waits for exit."""
        await self._signal(signal.SIGTERM, 5.0)

    async def kill(self) -> None:
        """SIGKILL and wait for exit."""
        await self._signal(signal.SIGKILL, 5.0)

    async def _signal(self, sig: signal.Signals, wait_s: float) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            await asyncio.to_thread(proc.wait, wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    async def restart(self, *, wipe: bool = False) -> None:
        """Stop and start again on the same ports; `wipe` drops the data dir."""
        await self.stop()
        if wipe:
            self._wipe_data()
        await self.start()

    def _wipe_data(self) -> None:
        pass

    async def _aclose(self) -> None:
        await self.kill()
        shutil.rmtree(self._tmp, ignore_errors=True)
