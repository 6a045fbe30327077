"""The local connector: `meshllm worker` processes on this host, started and drained by the planner.

Each worker is the template's flags plus `--role ROLE --instance-id ID`; its
output goes to `LOG_DIR/ID.log`. Scaling down sends SIGTERM to the youngest
worker of the role: the worker drains (it leaves discovery, waits for its
in-flight streams up to its `--drain-timeout`, then stops the rest, which
routers migrate to another worker), so no stream breaks. A worker that has
not exited `kill_after_s` after SIGTERM gets SIGKILL.

Workers run in their own session, so they outlive a planner that restarts:
the planner's state lists them (`workers()`), and the next planner adopts
those still running with the same instance id (`adopt()`). `stop_on_close`
stops (drains) them when the planner stops for good, as tests and benches
want; by default they keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshllm.errors import ConfigError
from meshllm.planner.model import ROLES, Connector

__all__ = ["LocalConnector", "LocalWorker"]

log = logging.getLogger(__name__)

RESERVED_FLAGS = ("--role", "--instance-id")
EARLY_EXIT_S = 15.0  # a worker that exits with status 2 this soon after its start refused its flags


@dataclass(slots=True)
class LocalWorker:
    role: str
    instance_id: str
    pid: int
    started_at: float  # wall clock
    log_path: str
    proc: subprocess.Popen[bytes] | None = None  # None once adopted from a previous planner
    stop_sent_at: float | None = None

    def exit_status(self) -> int | None:
        """The exit status once the process ended (adopted ones read 0), None while it runs."""
        if self.proc is not None:
            return self.proc.poll()
        return None if _running(self.pid, self.instance_id) else 0

    def record(self) -> dict[str, Any]:
        return {"role": self.role, "instance_id": self.instance_id, "pid": self.pid,
                "started_at": self.started_at, "log_path": self.log_path}  # fmt: skip


def _running(pid: int, instance_id: str) -> bool:
    """Whether `pid` is still the worker started with `instance_id` (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return instance_id.encode() in cmdline.split(b"\0")


class LocalConnector(Connector):
    kind = "local"

    def __init__(
        self,
        worker_flags: Sequence[str],
        *,
        log_dir: Path,
        command: Sequence[str] = (sys.executable, "-m", "meshllm", "worker"),
        env: Mapping[str, str] | None = None,
        kill_after_s: float = 300.0,
        stop_on_close: bool = False,
    ) -> None:
        for flag in worker_flags:
            if flag.split("=", 1)[0] in RESERVED_FLAGS:
                raise ConfigError(f"the worker template must not set {flag.split('=', 1)[0]}: the planner sets it")
        self.worker_flags = list(worker_flags)
        self.log_dir = log_dir
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.kill_after_s = kill_after_s
        self.stop_on_close = stop_on_close
        self._workers: list[LocalWorker] = []

    def workers(self) -> list[dict[str, Any]]:
        """The workers this connector runs (draining ones included), for the planner's saved state."""
        return [w.record() for w in self._workers]

    def adopt(self, records: Sequence[Mapping[str, Any]]) -> int:
        """Take over the workers a previous planner started that still run; returns how many."""
        known = {w.instance_id for w in self._workers}
        for r in records:
            try:
                w = LocalWorker(str(r["role"]), str(r["instance_id"]), int(r["pid"]), float(r["started_at"]),
                                str(r.get("log_path", "")))  # fmt: skip
            except (KeyError, TypeError, ValueError):
                log.warning("planner state: skipping a worker record that does not parse: %r", r)
                continue
            if w.instance_id not in known and _running(w.pid, w.instance_id):
                self._workers.append(w)
        log.info("local connector: adopted %d running worker(s)", len(self._workers))
        return len(self._workers)

    async def replicas(self) -> dict[str, int]:
        self._reap()
        counts = dict.fromkeys(ROLES, 0)
        for w in self._workers:
            if w.stop_sent_at is None:
                counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def draining(self) -> int:
        """Workers told to stop that have not exited yet."""
        return sum(1 for w in self._workers if w.stop_sent_at is not None)

    async def scale(self, role: str, replicas: int) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose from {', '.join(ROLES)}")
        self._reap()
        live = sorted((w for w in self._workers if w.role == role and w.stop_sent_at is None), key=lambda w: w.started_at)
        for _ in range(replicas - len(live)):
            self._workers.append(await asyncio.to_thread(self._spawn, role))
        for w in live[max(replicas, 0) :][::-1]:
            self._stop(w)

    def _spawn(self, role: str) -> LocalWorker:
        instance_id = f"planner-{role}-{uuid.uuid4().hex[:8]}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{instance_id}.log"
        argv = [*self.command, *self.worker_flags, "--role", role, "--instance-id", instance_id]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env, start_new_session=True)  # fmt: skip
        log.info("local connector: started %s worker %s (pid %d, log %s)", role, instance_id, proc.pid, log_path)
        return LocalWorker(role, instance_id, proc.pid, time.time(), str(log_path), proc)

    def _stop(self, w: LocalWorker) -> None:
        log.info("local connector: draining %s worker %s (pid %d)", w.role, w.instance_id, w.pid)
        w.stop_sent_at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGTERM)

    def _reap(self) -> None:
        """Drop workers that exited; SIGKILL one that outlived its drain; a template refused at start is fatal."""
        kept = []
        for w in self._workers:
            status = w.exit_status()
            if status is None:
                if w.stop_sent_at is not None and time.monotonic() - w.stop_sent_at > self.kill_after_s:
                    log.warning("local connector: worker %s still runs %gs after SIGTERM; killing it", w.instance_id,
                                self.kill_after_s)  # fmt: skip
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.pid, signal.SIGKILL)
                kept.append(w)
                continue
            if w.stop_sent_at is None:
                if status == 2 and time.time() - w.started_at < EARLY_EXIT_S:
                    raise ConfigError(f"the worker template was refused: {_last_line(w.log_path)}")
                log.warning("local connector: %s worker %s exited by itself (status %s; log %s)", w.role,
                            w.instance_id, status, w.log_path)  # fmt: skip
        self._workers = kept

    async def _aclose(self) -> None:
        if not self.stop_on_close:
            if self._workers:
                log.info("local connector: leaving %d worker(s) running for the next planner", len(self._workers))
            return
        for w in self._workers:
            if w.stop_sent_at is None:
                self._stop(w)
        deadline = time.monotonic() + self.kill_after_s
        while self._workers and time.monotonic() < deadline:
            self._reap()
            await asyncio.sleep(0.1)  # a child's exit has no awaitable here (Popen); poll it
        for w in self._workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
            if w.proc is not None:
                await asyncio.to_thread(w.proc.wait)
        self._workers = []


def _last_line(path: str) -> str:
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {path})"
    return lines[-1] if lines else f"(empty log {path})"
