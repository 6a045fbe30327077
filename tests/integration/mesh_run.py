"""`meshllm run` as a subprocess on ephemeral ports, for tests that talk to a live mesh from outside.

    with MeshRun.start("--workers", "2") as mesh:
        mesh.http_url, mesh.inference_address, mesh.router_address, mesh.workers

Ready means `meshllm run` printed its address lines (it prints them only once
every worker's model is served); the addresses are parsed from those lines.
Close = SIGTERM, then SIGKILL after a bound.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ROOT", "MeshRun", "RunWorker", "clean_env"]

ROOT = Path(__file__).resolve().parents[2]

_WORKER = re.compile(r"^worker (\w+)\s+(\S+)\s+\(([^,]+), engine (\S+)\)")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without MESHLLM_* / OTEL_* settings (they would change flag defaults), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHLLM_", "OTEL_"))}
    env.setdefault("MESHLLM_LOG_LEVEL", "WARNING")
    return {**env, **extra}


@dataclass(frozen=True, slots=True)
class RunWorker:
    """One worker line of `meshllm run`."""

    role: str
    address: str
    worker_id: str


@dataclass(slots=True)
class MeshRun:
    """A running `meshllm run` process and the addresses it printed."""

    proc: subprocess.Popen[str]
    log_path: Path
    http_url: str = ""
    inference_address: str = ""
    router_address: str = ""
    workers: list[RunWorker] = field(default_factory=list)
    _pump: threading.Thread | None = None

    @classmethod
    @contextlib.contextmanager
    def start(cls, *args: str, ready_timeout_s: float = 120.0) -> Iterator[MeshRun]:
        """Start `meshllm run --http-port 0 --grpc-port 0 --router-port 0 ARGS`, yield once ready, stop on exit."""
        log = Path(tempfile.mkstemp(prefix="meshllm-run-", suffix=".log")[1])
        with open(log, "w") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "meshllm", "run", "--http-port", "0", "--grpc-port", "0", "--router-port", "0", *args],
                stdout=subprocess.PIPE,
                stderr=logf,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=clean_env(),
                text=True,
            )
        mesh = cls(proc=proc, log_path=log)
        try:
            mesh._wait_ready(ready_timeout_s)
            yield mesh
        finally:
            mesh.stop()
            log.unlink(missing_ok=True)

    def _wait_ready(self, timeout_s: float) -> None:
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:  # reads stdout to its end so the pipe never fills
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"meshllm run not ready in {timeout_s}s: {self.log_tail()}") from None
            if line is None:
                raise AssertionError(f"meshllm run exited with {self.proc.wait()}: {self.log_tail()}")
            if self._parse(line.strip()):
                return

    def _parse(self, line: str) -> bool:
        """Record an address line; True on the last line ("try: curl ...")."""
        if line.startswith("OpenAI HTTP API"):
            self.http_url = line.split()[3].removesuffix("/v1")
        elif line.startswith("Inference gRPC"):
            self.inference_address = line.split()[2]
        elif line.startswith("Router gRPC"):
            self.router_address = line.split()[2]
        elif m := _WORKER.match(line):
            self.workers.append(RunWorker(role=m[1], address=m[2], worker_id=m[3]))
        return line.startswith("try:")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (the ordered shutdown), SIGKILL if it outlives `timeout_s`; the exit status."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait()
        if self._pump is not None:
            self._pump.join(5.0)  # the pipe reaches EOF once the process is gone
        if self.proc.stdout is not None and (self._pump is None or not self._pump.is_alive()):
            self.proc.stdout.close()
        return code
