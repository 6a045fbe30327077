"""The local connector: `meshllm worker` processes on this host, started and drained by the planner.

Each worker is the template's flags plus `--role ROLE --instance-id ID`; its
output goes to `LOG_DIR/ID.log`. Scaling down sends SIGTERM to the workers
of the role with the fewest requests in flight (the router's view, when the
planner has `--router-address`), the youngest among equals: each drains (it
leaves discovery, waits for its in-flight streams up to its
`--drain-timeout`, then stops the rest, which routers migrate to another
worker), so no stream breaks. A worker that has not exited `kill_after_s`
after SIGTERM gets SIGKILL.

Workers run in their own session, so they outlive a planner that restarts:
the planner's state lists them (`workers()`, draining ones marked), and the
next planner adopts those still running with the same instance id
(`adopt()`; a draining one stays draining, its SIGKILL clock restarted).
`stop_on_close` stops (drains) them when the planner stops for good, as
tests and benches want; by default they keep serving.

A worker that exits with status 2 (`meshllm worker` refusing its flags at
start) before it was ever seen running `EARLY_EXIT_S` after its start means
the template is refused: ConfigError with the last line of its output.
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
EARLY_EXIT_S = 15.0  # a worker that exits with status 2 not seen running this long after its start refused its flags


@dataclass(slots=True)
class LocalWorker:
    role: str
    instance_id: str
    pid: int
    started_at: float  # wall clock
    log_path: str
    proc: subprocess.Popen[bytes] | None = None  # None once adopted from a previous planner
    stop_sent_at: float | None = None  # monotonic
    seen_running_at: float = 0.0  # wall clock: the last time it was found running (at least started_at)

    def exit_status(self) -> int | None:
        """The exit status once the process ended (adopted ones read 0), None while it runs."""
        if self.proc is not None:
            return self.proc.poll()
        return None if _running(self.pid, self.instance_id) else 0

    def record(self) -> dict[str, Any]:
        return {"role": self.role, "instance_id": self.instance_id, "pid": self.pid, "started_at": self.started_at,
                "log_path": self.log_path, "draining": self.stop_sent_at is not None}  # fmt: skip

    def send_signal(self, sig: int) -> None:
        """Send `sig` while it still runs: never to a pid already reaped or no longer this worker's (reused)."""
        if self.proc is not None:
            self.proc.send_signal(sig)  # nothing once reaped (Popen knows its exit status)
        elif _running(self.pid, self.instance_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


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
        self._spawning: set[asyncio.Future[LocalWorker]] = set()

    def workers(self) -> list[dict[str, Any]]:
        """The workers this connector runs (draining ones included), for the planner's saved state."""
        return [w.record() for w in self._workers]

    def adopt(self, records: Sequence[Mapping[str, Any]]) -> int:
        """Take over the workers a previous planner started that still run; returns how many were adopted."""
        known = {w.instance_id for w in self._workers}
        adopted = 0
        for r in records:
            try:
                w = LocalWorker(str(r["role"]), str(r["instance_id"]), int(r["pid"]), float(r["started_at"]),
                                str(r.get("log_path", "")), seen_running_at=time.time())  # fmt: skip
            except (KeyError, TypeError, ValueError):
                log.warning("planner state: skipping a worker record that does not parse: %r", r)
                continue
            if w.instance_id in known or not _running(w.pid, w.instance_id):
                continue
            if r.get("draining"):
                w.stop_sent_at = time.monotonic()  # told to stop before: still leaving, not a replica
            known.add(w.instance_id)
            self._workers.append(w)
            adopted += 1
        log.info("local connector: adopted %d running worker(s)", adopted)
        return adopted

    async def replicas(self) -> dict[str, int]:
        self._reap()
        counts = dict.fromkeys(ROLES, 0)
        for w in self._workers:
            if w.stop_sent_at is None:
                counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def draining(self) -> int:
        """Workers told to stop that have not exited yet."""
        return sum(1 for w in self._workers if w.stop_sent_at is not None and w.exit_status() is None)

    async def scale(self, role: str, replicas: int, *, busy: Mapping[str, int] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose from {', '.join(ROLES)}")
        self._reap()
        live = [w for w in self._workers if w.role == role and w.stop_sent_at is None]
        for _ in range(replicas - len(live)):
            await self._start(role)
        # the least busy go first (fewest streams to drain or migrate), then the youngest (the coldest cache)
        busy = busy or {}
        live.sort(key=lambda w: (busy.get(w.instance_id, 0), -w.started_at))
        for w in live[: max(len(live) - max(replicas, 0), 0)]:
            self._stop(w)

    async def _start(self, role: str) -> None:
        """Spawn one worker (in a thread: fork and exec block). Once spawned it is tracked even when the caller
        is cancelled meanwhile (the planner stopping mid scale-up), or it would run on, unlisted and undrained."""
        spawn = asyncio.ensure_future(asyncio.to_thread(self._spawn, role))
        self._spawning.add(spawn)
        spawn.add_done_callback(self._spawned)
        await asyncio.shield(spawn)

    def _spawned(self, spawn: asyncio.Future[LocalWorker]) -> None:
        self._spawning.discard(spawn)
        if not spawn.cancelled() and spawn.exception() is None:
            self._workers.append(spawn.result())

    def _spawn(self, role: str) -> LocalWorker:
        instance_id = f"planner-{role}-{uuid.uuid4().hex[:8]}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{instance_id}.log"
        argv = [*self.command, *self.worker_flags, "--role", role, "--instance-id", instance_id]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env, start_new_session=True)  # fmt: skip
        log.info("local connector: started %s worker %s (pid %d, log %s)", role, instance_id, proc.pid, log_path)
        started_at = time.time()
        return LocalWorker(role, instance_id, proc.pid, started_at, str(log_path), proc, seen_running_at=started_at)

    def _stop(self, w: LocalWorker) -> None:
        log.info("local connector: draining %s worker %s (pid %d)", w.role, w.instance_id, w.pid)
        w.stop_sent_at = time.monotonic()
        w.send_signal(signal.SIGTERM)

    def _reap(self) -> None:
        """Drop workers that exited; SIGKILL one that outlived its drain; a template refused at start is fatal."""
        kept, refused = [], None
        now, now_wall = time.monotonic(), time.time()
        for w in self._workers:
            status = w.exit_status()
            if status is None:
                w.seen_running_at = now_wall
                if w.stop_sent_at is not None and now - w.stop_sent_at > self.kill_after_s:
                    log.warning("local connector: worker %s still runs %gs after SIGTERM; killing it", w.instance_id,
                                self.kill_after_s)  # fmt: skip
                    w.send_signal(signal.SIGKILL)
                kept.append(w)
            elif w.stop_sent_at is None:
                # Exit status 2 is `meshllm worker` refusing its flags, which it does only at start; when it exits is
                # not known (it was last seen running at seen_running_at), so the start is judged by that.
                if status == 2 and w.seen_running_at - w.started_at < EARLY_EXIT_S:
                    refused = refused or w
                else:
                    log.warning("local connector: %s worker %s exited by itself (status %s; log %s)", w.role,
                                w.instance_id, status, w.log_path)  # fmt: skip
        self._workers = kept
        if refused is not None:
            raise ConfigError(f"the worker template was refused: {_last_line(refused.log_path)}")

    async def _aclose(self) -> None:
        if self._spawning:  # workers being spawned are listed once they are: wait for them
            await asyncio.gather(*self._spawning, return_exceptions=True)
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
            w.send_signal(signal.SIGKILL)
            if w.proc is not None:
                await asyncio.to_thread(w.proc.wait)
        self._workers = []


def _last_line(path: str) -> str:
    try:
        lines = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {path})"
    return lines[-1] if lines else f"(empty log {path})"
