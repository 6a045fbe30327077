"""Lifecycle helpers: idempotent async close, ordered shutdown, signal wiring.

Only entry points (`main.py`, `cli.py`) and this module start tasks, servers
or signal handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

import uvloop

from meshllm.heap import settle_heap

__all__ = [
    "FORCED_EXIT_STATUS",
    "Admission",
    "Admits",
    "AsyncCloseable",
    "Shutdown",
    "ShutdownStep",
    "command_error",
    "forced_exit",
    "install_signal_handlers",
    "run_command",
    "run_loop",
    "serve_until_signal",
]

log = logging.getLogger(__name__)
C = TypeVar("C", bound="AsyncCloseable")
T = TypeVar("T")


class AsyncCloseable:
    """Base for long-lived objects: `async with` closes; `aclose()` is idempotent.

    Subclasses implement `_aclose()`. Concurrent and repeated `aclose()` calls
    run it exactly once and all wait for it.
    """

    _close_task: asyncio.Future[None] | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._close_task is not None

    def close_soon(self) -> asyncio.Future[None]:
        """Start closing without waiting (a synchronous callback's way in): the object keeps the task, `aclose()` awaits it."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._aclose())
        return self._close_task

    async def aclose(self) -> None:
        await asyncio.shield(self.close_soon())

    async def started(self, start: Awaitable[object]) -> Self:
        """Await `start` (the object's start-up); if it fails, close what it opened and re-raise.

        The one way every service's `start()` classmethod ends: `return await self.started(self._start(...))`.
        """
        try:
            await start
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _aclose(self) -> None:
        raise NotImplementedError


class Admission:
    """A service's admission and drain state: admitting or not, requests in flight, a wait for none.

    The caller decides whether to admit (`admitting`, its own limits, its own
    error), then counts the request in with `enter()` and out with `exit()`,
    exactly once each (`admitted()` pairs them). `wait_idle()` returns once
    nothing is in flight. `on_change(+1 | -1)` mirrors the count, e.g. into
    an in-flight gauge.
    """

    def __init__(self, on_change: Callable[[int], object] | None = None) -> None:
        self.admitting = True
        self.inflight = 0
        self._on_change = on_change
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()
        if self._on_change is not None:
            self._on_change(1)

    def exit(self) -> None:
        self.inflight -= 1
        if self._on_change is not None:
            self._on_change(-1)
        if not self.inflight:
            self._idle.set()

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """`enter()` now, `exit()` when the block ends however it ends."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    async def wait_idle(self) -> None:
        """Return once nothing is in flight (at once when nothing is)."""
        await self._idle.wait()


class Admits:
    """Mixin for a service gated by its `admission`: `admitting` (read and set) and `wait_idle()`."""

    admission: Admission

    @property
    def admitting(self) -> bool:
        return self.admission.admitting

    @admitting.setter
    def admitting(self, value: bool) -> None:
        self.admission.admitting = value

    async def wait_idle(self) -> None:
        """Return once nothing is in flight."""
        await self.admission.wait_idle()


@dataclass(frozen=True, slots=True)
class ShutdownStep:
    """One named step of a shutdown, with an optional time bound."""

    name: str
    action: Callable[[], Awaitable[object]]
    timeout_s: float | None = None


class Shutdown:
    """An ordered, idempotent shutdown routine.

    Steps run in the order added. A step that fails or times out is logged
    and the next one still runs: shutdown always reaches the end. `run()` may
    be called any number of times, concurrently; the steps run once.
    `durations` records each step's seconds (for the lifecycle gauges).
    """

    def __init__(self) -> None:
        self._steps: list[ShutdownStep] = []
        self._task: asyncio.Future[None] | None = None
        self.durations: dict[str, float] = {}
        self.completed: list[str] = []

    def add(self, name: str, action: Callable[[], Awaitable[object]], *, timeout_s: float | None = None) -> None:
        if self._task is not None:
            raise RuntimeError("shutdown already started")
        self._steps.append(ShutdownStep(name, action, timeout_s))

    @property
    def started(self) -> bool:
        return self._task is not None

    async def run(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        await asyncio.shield(self._task)

    async def _run(self) -> None:
        for step in self._steps:
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(step.action(), step.timeout_s)
            except TimeoutError:
                log.warning("shutdown step %s timed out after %.1fs", step.name, step.timeout_s)
            except Exception:
                log.exception("shutdown step %s failed", step.name)
            self.durations[step.name] = time.monotonic() - t0
            self.completed.append(step.name)
            log.debug("shutdown step %s done in %.3fs", step.name, self.durations[step.name])


def install_signal_handlers(callback: Callable[[signal.Signals], None]) -> Callable[[], None]:
    """Call `callback(sig)` on SIGTERM / SIGINT in the running loop; return an uninstaller."""
    loop = asyncio.get_running_loop()
    sigs = (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
        loop.add_signal_handler(sig, callback, sig)

    def uninstall() -> None:
        for sig in sigs:
            loop.remove_signal_handler(sig)

    return uninstall


FORCED_EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C


def command_error(command: str, message: str, status: int = 2) -> int:
    """Print the one line a failed `meshllm COMMAND` leaves on stderr (`meshllm COMMAND: error: MESSAGE`); return `status`."""
    print(f"meshllm {command}: error: {message}", file=sys.stderr)
    return status


def forced_exit(command: str) -> None:
    """A second Ctrl-C during a graceful shutdown: one line, exit at once (no further cleanup)."""
    print(f"meshllm {command}: forced exit", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(FORCED_EXIT_STATUS)


async def serve_until_signal(
    command: str,
    start: Callable[[], Awaitable[C]],
    ready_lines: Callable[[C], Iterable[str]],
    *,
    service_name: str,
    otlp_endpoint: str | None,
    closing: Callable[[C], Awaitable[object]] | None = None,
) -> int:
    """The body of every long-running `meshllm` command.

    Enable tracing, install SIGTERM/SIGINT handlers, `start()` the service (a MeshError becomes one line on
    stderr: exit 2 for a ConfigError, else 1; any other startup failure is one line too, exit 1, its traceback
    logged at DEBUG only), print its ready lines, wait for a signal (or for `closing(service)` to return, e.g. a
    worker drained by RPC), then close it in its own order. A SIGINT after the first signal (a second Ctrl-C
    while draining) exits at once with FORCED_EXIT_STATUS and one line."""
    from meshllm.config import ConfigError
    from meshllm.errors import MeshError
    from meshllm.tracing import setup_tracing, shutdown_tracing

    setup_tracing(service_name, otlp_endpoint=otlp_endpoint)
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set() and sig == signal.SIGINT:
            forced_exit(command)
        stop.set()

    uninstall = install_signal_handlers(on_signal)
    try:
        try:
            service = await start()
        except MeshError as exc:
            return command_error(command, exc.message, 2 if isinstance(exc, ConfigError) else 1)
        except Exception as exc:
            log.debug("meshllm %s failed to start", command, exc_info=True)
            return command_error(command, f"{type(exc).__name__}: {exc}", 1)
        async with service:
            settle_heap()
            for line in ready_lines(service):
                print(line, flush=True)
            await _until_stopped(stop, closing(service) if closing is not None else None)
            log.info("meshllm %s shutting down (%s)", command, "signal" if stop.is_set() else "requested")
            stop.set()  # from here on a SIGINT forces the exit
        return 0
    finally:
        uninstall()
        shutdown_tracing()


async def _until_stopped(stop: asyncio.Event, closing: Awaitable[object] | None) -> None:
    """Wait for a signal (`stop`) or for the service's own `closing` to return, whichever comes first."""
    waits: list[asyncio.Future[object]] = [asyncio.ensure_future(stop.wait())]
    if closing is not None:
        waits.append(asyncio.ensure_future(closing))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on uvloop (every service's loop: grpc.aio and the HTTP server cost less on it).

    A Ctrl-C before the service installed its own handlers (while importing or
    loading) exits with FORCED_EXIT_STATUS and no traceback.
    """
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except KeyboardInterrupt:
        raise SystemExit(FORCED_EXIT_STATUS) from None


def run_command(command: str, configure: Callable[[], T], serve: Callable[[T], Coroutine[Any, Any, int]]) -> int:
    """The rest of a long-running command's `main` once its flags are parsed: `configure()` (a ConfigError is one
    line on stderr and exit 2, before anything starts), then `serve(config)` on `run_loop`."""
    from meshllm.errors import ConfigError

    try:
        config = configure()
    except ConfigError as exc:
        return command_error(command, exc.message)
    return run_loop(serve(config))
