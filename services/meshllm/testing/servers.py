"""Start real `etcd` and `nats-server` binaries on free loopback ports.

    async with EtcdServer() as etcd:          # etcd.endpoint == "127.0.0.1:PORT"
        ...
        await etcd.restart()                   # same port; data kept unless wipe=True
    async with NatsServer() as nats:           # nats.url == "nats://127.0.0.1:PORT"
        await nats.restart()

Each server gets its own temporary data directory, removed on close. Start
waits until the server answers (etcd `/health`, NATS `INFO` banner), never on
a fixed sleep. `kill()` is `SIGKILL` for fault tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from meshllm.lifecycle import AsyncCloseable

__all__ = ["EtcdServer", "NatsServer", "ServerBinaryMissing", "free_port"]


class ServerBinaryMissing(RuntimeError):
    """The etcd or nats-server binary is not installed."""


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binary(name: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/sbin/{name}", f"/usr/local/bin/{name}") if os.path.exists(p)), None
    )
    if path is None:
        raise ServerBinaryMissing(f"{name} is not installed (make test installs it with apt-get)")
    return path


class _Process(AsyncCloseable):
    name = "server"

    def __init__(self, *, ready_timeout_s: float = 20.0) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix=f"meshllm-{self.name}-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready_timeout_s = ready_timeout_s
        self._log = self._tmp / "server.log"

    def _argv(self) -> list[str]:
        raise NotImplementedError

    async def _probe(self) -> bool:
        raise NotImplementedError

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

    async def start(self) -> None:
        if self.running:
            return
        self._proc = self._spawn()
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode}: {self.log_tail()}")
            if await self._probe():
                return
            await asyncio.sleep(0.05)  # polling a readiness probe, not synchronising on time
        raise RuntimeError(f"{self.name} not ready in {self._ready_timeout_s}s: {self.log_tail()}")

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


class EtcdServer(_Process):
    """A real single-node etcd on 127.0.0.1 with ephemeral client and peer ports."""

    name = "etcd"

    def __init__(self, **kwargs: float) -> None:
        super().__init__(**kwargs)
        self.binary = _binary("etcd")
        self.port = free_port()
        self.peer_port = free_port()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        client = f"http://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name", "meshllm-test",
            "--data-dir", str(self._tmp / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"meshllm-test={peer}",
            "--log-level", "warn",
        ]  # fmt: skip

    async def _probe(self) -> bool:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), 1.0)
        except (OSError, TimeoutError):
            return False
        try:
            writer.write(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            body = await asyncio.wait_for(reader.read(), 2.0)
            return b'"health":"true"' in body
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()

    def _wipe_data(self) -> None:
        shutil.rmtree(self._tmp / "data", ignore_errors=True)


class NatsServer(_Process):
    """A real nats-server (JetStream off) on 127.0.0.1 with an ephemeral port."""

    name = "nats"

    def __init__(self, **kwargs: float) -> None:
        super().__init__(**kwargs)
        self.binary = _binary("nats-server")
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        return [self.binary, "-a", "127.0.0.1", "-p", str(self.port)]

    async def _probe(self) -> bool:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), 1.0)
        except (OSError, TimeoutError):
            return False
        try:
            line = await asyncio.wait_for(reader.readline(), 2.0)
            return line.startswith(b"INFO ")
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
