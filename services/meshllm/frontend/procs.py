"""`meshllm frontend --workers N`: N frontend processes on one HTTP port (and one gRPC port), and their supervisor.

    parent (this module)                       children: `python -m meshllm frontend ... --workers 1`
    ─ validate flags, reserve the ports        ─ each: HTTP + Inference gRPC on the reserved ports (SO_REUSEPORT),
      (bound with SO_REUSEPORT, never listening)  its own embedded routing core, replica sync over the events plane
    ─ start N children, wait until each has    ─ /metrics: every child's metrics summed (prometheus_client
      printed its ready lines, print them once    multiprocess files in one shared directory)
    ─ SIGTERM/SIGINT → SIGTERM to every child, wait for all, exit 0 when every child exited 0, else 1;
      a second Ctrl-C meanwhile SIGKILLs them and exits 130 at once ("meshllm frontend: forced exit")
      (children run in their own session, so a terminal's Ctrl-C reaches the supervisor only; a child
      gets SIGTERM when the supervisor dies, even by SIGKILL: `meshllm.frontend.main.die_with_parent`)
    ─ a child that dies is logged and restarted; more than MAX_RESTARTS deaths within RESTART_WINDOW_S
      stop the group and the parent exits 1 (a crash loop is the orchestrator's to see)

The kernel spreads new connections over the children's listening sockets
(SO_REUSEPORT hashes the connection's 4-tuple); a connection stays with the
child that accepted it, so HTTP keep-alive and gRPC (one HTTP/2 connection per
client channel) balance per connection, not per request. The parent's
reservation sockets keep an ephemeral port (`--http-port 0`) the group's for
its whole life, restarts included; being bound but never listening, they take
no connections.

Routing cores agree through `meshllm.router.sync.ReplicaSync` on the events
plane: with NATS every child sees every other child's charges. With no event
bus (static mode without `--events nats`) each core sees only the load it
routed itself; the supervisor says so in a startup warning.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshllm.config import ConfigError, EventsKind
from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.shared_metrics import forget_process, shared_metrics_dir
from meshllm.lifecycle import command_error, forced_exit, install_signal_handlers
from meshllm.ports import bind_error, check_free

__all__ = [
    "INDEX_ENV",
    "MAX_RESTARTS",
    "METRICS_DIR_ENV",
    "PARENT_ENV",
    "RESTART_WINDOW_S",
    "FrontendGroup",
    "reserve_port",
    "supervise",
]

log = logging.getLogger("meshllm.frontend.procs")

INDEX_ENV = "MESHLLM_FRONTEND_PROCESS_INDEX"  # set by the supervisor in each child; not a flag
PARENT_ENV = "MESHLLM_FRONTEND_PARENT_PID"
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when it is imported
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
READY_TIMEOUT_S = 180.0  # a child's start: planes, routing core, tokenizer (a static worker's GetInfo)
STOP_TIMEOUT_S = 75.0  # above the sum of a frontend's own bounded shutdown steps
READY_MARK = "OpenAI HTTP API on"


def reserve_port(host: str, port: int, *, flag: str) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT and never listening: the children bind the same port.

    Port 0 picks a free port (read it from `getsockname()`). PortInUse (one line naming `flag`) when
    any other process holds the port, even one that set SO_REUSEPORT itself (it is probed without it
    first); ConfigError when the host cannot be bound.
    """
    check_free(host, port, flag)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise bind_error(host, port, flag, exc) from None
    return sock


class ChildFailed(Exception):
    """A child exited (or never became ready) while it should be serving."""

    def __init__(self, index: int, returncode: int | None, why: str) -> None:
        super().__init__(f"frontend process {index} {why}")
        self.index, self.returncode = index, returncode


@dataclass(slots=True)
class Child:
    """One started frontend process and what it printed."""

    index: int
    proc: asyncio.subprocess.Process
    ready_lines: list[str] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


class FrontendGroup:
    """Starts, watches, restarts and stops the N children. Use `supervise()`."""

    def __init__(
        self, argv: Sequence[str], config: FrontendConfig, metrics_dir: Path, ports: tuple[int, int | None], stop: asyncio.Event
    ) -> None:
        self.argv = list(argv)
        self.stop_requested = stop  # set by SIGTERM/SIGINT: no more starts are waited for
        self.config = config
        self.metrics_dir = metrics_dir
        self.http_port, self.grpc_port = ports
        self.children: list[Child | None] = [None] * config.workers
        self.deaths: collections.deque[float] = collections.deque()
        self.expected_lines = 1 if config.grpc is None else 2
        self.stopped: int | None = None

    # ------------------------------------------------------------ one child
    def child_argv(self) -> list[str]:
        """The user's flags, then the group's: later flags win, so every child serves the reserved ports."""
        argv = [*self.argv, "--workers", "1", "--http-port", str(self.http_port)]
        if self.grpc_port is not None:
            argv += ["--grpc-port", str(self.grpc_port)]
        return argv

    async def spawn(self, index: int) -> Child:
        env = {**os.environ, INDEX_ENV: str(index), PARENT_ENV: str(os.getpid()), METRICS_DIR_ENV: str(self.metrics_dir)}
        env.setdefault("PYTHONUNBUFFERED", "1")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "meshllm", "frontend", *self.child_argv(),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=env,
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only; it stops the children
        )  # fmt: skip
        child = Child(index, proc)
        child.pump = asyncio.create_task(self._pump(child), name=f"frontend-{index}-stdout")
        self.children[index] = child
        return child

    async def _pump(self, child: Child) -> None:
        """Collect the ready lines; anything printed later goes to our stderr, marked with the child's index."""
        assert child.proc.stdout is not None
        async for raw in child.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if not child.ready.is_set() and (child.ready_lines or READY_MARK in line):
                child.ready_lines.append(line)
                if len(child.ready_lines) == self.expected_lines:
                    child.ready.set()
            else:
                print(f"[frontend {child.index}] {line}", file=sys.stderr, flush=True)

    async def start_child(self, index: int) -> Child:
        """Spawn child `index` and wait until it serves; ChildFailed if it exits or stalls first (it is then killed).

        A stop request ends the wait: the child is returned as it is, for `stop()` to terminate."""
        child = await self.spawn(index)
        ready = asyncio.ensure_future(child.ready.wait())
        exited = asyncio.ensure_future(child.proc.wait())
        stopping = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait([ready, exited, stopping], timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            stopping.cancel()
        if child.ready.is_set() or self.stop_requested.is_set():
            exited.cancel()
            return child
        if not exited.done():
            exited.cancel()
            await self._kill(child)
            raise ChildFailed(index, None, f"did not become ready within {READY_TIMEOUT_S:.0f}s")
        raise ChildFailed(index, child.proc.returncode, describe_exit(child.proc.returncode) + " before serving")

    # ------------------------------------------------------------ the group
    async def start(self) -> None:
        """Start every child at once; on any failure the others are stopped and ChildFailed raised."""
        results = await asyncio.gather(*(self.start_child(i) for i in range(self.config.workers)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]

    def ready_lines(self) -> list[str]:
        first = self.children[0]
        assert first is not None
        pids = " ".join(str(c.pid) for c in self.children if c is not None)
        return [*first.ready_lines, f"meshllm frontend: {len(self.children)} processes, pids {pids}"]

    async def watch(self) -> int:
        """Until a stop is requested: restart children that die. Returns 0, or 1 after a crash loop."""
        stop = self.stop_requested
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                exits = {asyncio.ensure_future(c.proc.wait()): c for c in self.children if c is not None}
                done, _ = await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
                for f in exits:
                    f.cancel()
                if stop.is_set():
                    return 0
                for f in done:
                    if f in exits and not await self._replace(exits[f]):
                        return 1
            return 0
        finally:
            stopping.cancel()

    async def _replace(self, dead: Child) -> bool:
        """Report a dead child and start another in its place; False when the restart budget is spent."""
        log.error("frontend process %d (pid %d) %s; its in-flight requests failed", dead.index, dead.pid,
                  describe_exit(dead.proc.returncode))  # fmt: skip
        forget_process(self.metrics_dir, dead.pid)
        while True:
            now = time.monotonic()
            self.deaths.append(now)
            while self.deaths and now - self.deaths[0] > RESTART_WINDOW_S:
                self.deaths.popleft()
            if len(self.deaths) > MAX_RESTARTS:
                log.error("more than %d frontend process deaths within %.0fs: stopping the group", MAX_RESTARTS, RESTART_WINDOW_S)
                return False
            try:
                child = await self.start_child(dead.index)
            except ChildFailed as exc:
                log.error("restarting frontend process %d failed: %s", dead.index, exc)
                continue
            log.warning("frontend process %d restarted as pid %d", dead.index, child.pid)
            return True

    async def stop(self) -> int:
        """SIGTERM to every child, wait (SIGKILL after STOP_TIMEOUT_S); 0 when every child exited 0, else 1.

        Idempotent: a second call returns the first one's result."""
        if self.stopped is not None:
            return self.stopped
        self.stopped = 1  # a stop cut short by cancellation reads as a failure
        live = [c for c in self.children if c is not None]
        for c in live:
            if c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.terminate()
        codes = await asyncio.gather(*(self._wait_or_kill(c) for c in live))
        for c in live:
            if c.pump is not None:
                await asyncio.gather(c.pump, return_exceptions=True)
        bad = [(c, code) for c, code in zip(live, codes, strict=True) if code != 0]
        for c, code in bad:
            log.error("frontend process %d (pid %d) %s at shutdown", c.index, c.pid, describe_exit(code))
        self.stopped = 1 if bad else 0
        return self.stopped

    async def _wait_or_kill(self, child: Child) -> int:
        try:
            return await asyncio.wait_for(child.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            log.error("frontend process %d (pid %d) did not stop within %.0fs: killing it", child.index, child.pid,
                      STOP_TIMEOUT_S)  # fmt: skip
            return await self._kill(child)

    def kill_all(self) -> None:
        """SIGKILL every child now (a forced exit of the supervisor)."""
        for c in self.children:
            if c is not None and c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()

    @staticmethod
    async def _kill(child: Child) -> int:
        with contextlib.suppress(ProcessLookupError):
            child.proc.kill()
        return await child.proc.wait()


def sync_note(config: FrontendConfig) -> tuple[int, str] | None:
    """The startup log line on how the N routing cores agree (None when routing is not embedded)."""
    if config.router_addresses:
        return None
    if config.plane.events == EventsKind.NATS:
        return logging.INFO, f"{config.workers} routing cores keep their load views in agreement over NATS (replica sync)"
    return logging.WARNING, (
        f"{config.workers} frontend processes without an event bus (--events {config.plane.events.value}): their routing "
        "cores cannot sync, each sees only the load it routed itself; use --events nats --nats-url URL for replica sync"
    )


async def supervise(argv: Sequence[str], config: FrontendConfig) -> int:
    """The parent of `meshllm frontend --workers N`: reserve ports, run the group until a signal, stop it."""
    held: list[socket.socket] = []
    own_dir: Path | None = None
    try:
        held.append(reserve_port(config.http_host, config.http_port, flag="--http-port"))
        grpc_port: int | None = None
        if config.grpc is not None:
            held.append(reserve_port(config.grpc.host, config.grpc.port, flag="--grpc-port"))
            grpc_port = held[-1].getsockname()[1]
    except ConfigError as exc:
        for s in held:
            s.close()
        return command_error("frontend", exc.message)
    metrics_dir, own_dir = shared_metrics_dir(os.environ.get(METRICS_DIR_ENV))
    stop = asyncio.Event()
    group = FrontendGroup(argv, config, metrics_dir, (held[0].getsockname()[1], grpc_port), stop)

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set() and sig == signal.SIGINT:  # a second Ctrl-C: no draining, no waiting
            group.kill_all()
            forced_exit("frontend")
        stop.set()

    uninstall = install_signal_handlers(on_signal)
    try:
        if (note := sync_note(config)) is not None:
            log.log(note[0], note[1])
        try:
            await group.start()
        except ChildFailed as exc:
            log.error("%s: stopping", exc)
            return 2 if exc.returncode == 2 else 1
        if not stop.is_set():
            for line in group.ready_lines():
                print(line, flush=True)
        crashed = await group.watch()
        log.info("meshllm frontend shutting down %d processes (%s)", config.workers, "crash loop" if crashed else "signal")
        stopped = await group.stop()
        return crashed or stopped
    finally:
        await group.stop()
        uninstall()
        for s in held:
            s.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
