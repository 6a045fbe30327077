"""`Runner`: the engine thread that owns llama.cpp and runs the step loop.

    event loop ──submit(command)──▶ engine thread: commands → scheduler.step() → post
    event loop ◀──call_soon_threadsafe(deliver, events, outputs, load)──┘

Only this thread touches the backend, the slot table and the scheduler. The
event loop talks to it with `submit` (a callable run on the thread between
steps) and hears back through one `call_soon_threadsafe` per step carrying
that step's KV events, outputs and (when it changed) load — so the engine
sink is only ever called on the event loop thread, and the loop never blocks.
While there is no work the thread sleeps on a condition variable.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from meshllm.engine.base import LoadMetrics
from meshllm.engine.llamacpp.config import LlamaCppConfig
from meshllm.engine.llamacpp.scheduler import Scheduler
from meshllm.engine.llamacpp.sequence import Output
from meshllm.engine.llamacpp.slots import KvEvent, SlotTable
from meshllm.engine.llamacpp.tiers import TierStore
from meshllm.errors import EngineShutdown, MeshError, Unknown

R = TypeVar("R")

__all__ = ["Command", "Deliver", "Runner"]

log = logging.getLogger("meshllm.engine.llamacpp")

Command = Callable[[Scheduler], list[Output] | None]
Deliver = Callable[[list[KvEvent], list[Output], LoadMetrics | None], None]


class Runner:
    """Start with `start()` (returns what the backend factory's `info()` says); stop with `stop()`."""

    def __init__(self, config: LlamaCppConfig, backend_factory: Callable[[LlamaCppConfig], Any], deliver: Deliver) -> None:
        self.config = config
        self._factory = backend_factory
        self._deliver = deliver
        self._cv = threading.Condition()
        self._commands: deque[Command] = deque()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="llamacpp-engine", daemon=True)
        self._last_load: LoadMetrics | None = None
        self.failure = ""
        #: The lower tiers, once started with them (engine-thread state: read its counters only).
        self.tiers: TierStore | None = None

    async def start(self) -> Any:
        """Load the model on the engine thread; the backend's `info()` once it is ready."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[Any] = self._loop.create_future()
        self._ready = ready
        self._thread.start()
        return await ready

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, command: Command) -> None:
        """Run `command(scheduler)` on the engine thread before its next step."""
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Fail what is in flight (EngineShutdown), free llama.cpp, and join the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.ident is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                log.error("the llamacpp engine thread did not stop within %.0f s", timeout_s)

    # ------------------------------------------------------------ thread
    async def call(self, fn: Callable[[Scheduler], R]) -> R:
        """`fn(scheduler)` run on the engine thread between steps; its result, or its MeshError re-raised here."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[R] = loop.create_future()

        def command(sched: Scheduler) -> None:
            try:
                loop.call_soon_threadsafe(_settle, done, fn(sched), None)
            except MeshError as exc:
                loop.call_soon_threadsafe(_settle, done, None, exc)

        self.submit(command)
        while not done.done():  # a command submitted as the engine thread stops is never run
            await asyncio.wait({done}, timeout=1.0)
            if not done.done() and not self.alive:
                raise EngineShutdown(self.failure or "the llamacpp engine stopped")
        return done.result()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _main(self) -> None:
        try:
            backend = self._factory(self.config)
            info = backend.info()
        except BaseException as exc:
            self._post(_settle, self._ready, None, exc)
            return
        cfg = self.config
        slots = SlotTable(cfg.n_seq_max, cfg.block_size, caching=cfg.prefix_caching)
        tiers = None
        if cfg.tiers_on:
            tiers = TierStore(
                block_size=cfg.block_size,
                layout=info.kv_layout,
                host_bytes=cfg.kv_host_bytes,
                disk_dir=cfg.kv_disk_dir,
                disk_bytes=cfg.kv_disk_bytes,
            )
            try:
                tiers.scan()  # what a previous run left on disk, advertised before the first request
            except BaseException as exc:
                tiers.close()
                backend.close()
                self._post(_settle, self._ready, None, exc)
                return
        self.tiers = tiers
        sched = Scheduler(backend, slots, n_batch=cfg.n_batch, n_ctx=cfg.n_ctx, min_copy_gain=cfg.block_size, tiers=tiers)
        self._last_load = sched.load()
        self._post(self._deliver, sched.drain_events(), [], self._last_load)
        self._post(_settle, self._ready, info, None)
        error: MeshError = EngineShutdown("the llamacpp engine is shutting down")
        try:
            self._steps(sched)
        except Exception as exc:  # a bug or a llama.cpp failure must fail the streams, not hang them
            log.exception("llamacpp step loop failed")
            self.failure = f"llamacpp step loop failed: {exc!r}"
            error = Unknown(self.failure)
        finally:
            try:
                outputs = sched.fail_all(error)
                self._post(self._deliver, sched.drain_events(), outputs, None)
            finally:
                if tiers is not None:
                    tiers.close()
                backend.close()

    def _steps(self, sched: Scheduler) -> None:
        while True:
            with self._cv:
                while not self._commands and not self._stopping and not sched.has_work():
                    self._cv.wait()
                stopping = self._stopping
                commands = list(self._commands)
                self._commands.clear()
            outputs: list[Output] = []
            for command in commands:
                outputs.extend(command(sched) or ())
            if stopping:  # what the commands added is failed by the caller, with the rest
                if outputs:
                    self._post(self._deliver, sched.drain_events(), outputs, None)
                return
            outputs.extend(sched.step())
            load = sched.load()
            if load == self._last_load:
                load_out = None
            else:
                load_out = self._last_load = load
            events = sched.drain_events()
            if events or outputs or load_out is not None:
                self._post(self._deliver, events, outputs, load_out)


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
