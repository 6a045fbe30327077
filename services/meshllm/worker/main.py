"""Entry point of `meshllm worker`: `run(EngineClass)` owns signals, planes and lifecycle."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from meshllm.config import ConfigError
from meshllm.engine import load_engine_class
from meshllm.engine.base import LLMEngine
from meshllm.errors import MeshError
from meshllm.lifecycle import install_signal_handlers
from meshllm.tracing import setup_tracing, shutdown_tracing
from meshllm.worker.runtime import Worker

__all__ = ["main", "run"]

log = logging.getLogger("meshllm.worker")


def setup_logging() -> None:
    level = os.environ.get("MESHLLM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


async def serve(engine_cls: type[LLMEngine], argv: Sequence[str]) -> int:
    """Construct, start, serve until SIGTERM/SIGINT, shut down in order."""
    engine, config = await engine_cls.from_args(list(argv))
    setup_tracing(f"meshllm-worker-{config.engine}", otlp_endpoint=config.otlp_endpoint)
    stop = asyncio.Event()
    uninstall = install_signal_handlers(lambda sig: stop.set())
    try:
        try:
            worker = await Worker.start(engine, config)
        except MeshError as exc:
            print(f"meshllm worker: error: {exc.message}", file=sys.stderr)
            return 1
        print(f"meshllm worker {worker.id} ({config.engine}, {config.role.value}) serving on {worker.address}", flush=True)
        # A signal, or a Drain RPC (which starts the worker's own shutdown), ends the process.
        signalled = asyncio.ensure_future(stop.wait())
        drained = asyncio.ensure_future(worker.wait_closing())
        await asyncio.wait([signalled, drained], return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        drained.cancel()
        log.info("shutting down (%s)", "signal" if stop.is_set() else "Drain RPC")
        await worker.aclose()
        return 0
    finally:
        uninstall()
        shutdown_tracing()


def run(engine_cls: type[LLMEngine], argv: Sequence[str] | None = None) -> int:
    """Run a worker for `engine_cls` (for engines packaged outside meshllm)."""
    setup_logging()
    try:
        return asyncio.run(serve(engine_cls, sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"meshllm worker: error: {exc.message}", file=sys.stderr)
        return 2


def main(argv: Sequence[str]) -> int:
    """`meshllm worker --engine NAME|module:Class [flags]`."""
    pre = argparse.ArgumentParser(prog="meshllm worker", add_help=False)
    pre.add_argument("--engine", default=os.environ.get("MESHLLM_ENGINE", "mocker"))
    ns, rest = pre.parse_known_args(argv)
    try:
        engine_cls = load_engine_class(ns.engine)
    except ConfigError as exc:
        print(f"meshllm worker: error: {exc.message}", file=sys.stderr)
        return 2
    return run(engine_cls, rest)
