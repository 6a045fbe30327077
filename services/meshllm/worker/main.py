"""Entry point of `meshllm worker`: `run(EngineClass)` owns signals, planes and lifecycle."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from meshllm import logs
from meshllm.config import ConfigError
from meshllm.engine import load_engine_class
from meshllm.engine.base import LLMEngine
from meshllm.lifecycle import command_error, run_loop, serve_until_signal
from meshllm.ports import check_free_all
from meshllm.protocol.chunks import set_coalescing
from meshllm.tracing import worker_service_name
from meshllm.worker.runtime import Worker

__all__ = ["main", "run"]

log = logging.getLogger("meshllm.worker")


def setup_logging() -> None:
    logs.setup_logging()


async def serve(engine_cls: type[LLMEngine], argv: Sequence[str]) -> int:
    """Construct, start, serve until SIGTERM/SIGINT or a Drain RPC, shut down in order."""
    engine, config = await engine_cls.from_args(list(argv))

    async def start() -> Worker:
        host = config.server.host
        check_free_all([(host, config.server.port, "--port"), (host, config.metrics_port, "--metrics-port")])
        return await Worker.start(engine, config)

    set_coalescing(config.coalesce)  # --no-coalesce: a property of the whole process
    return await serve_until_signal(
        "worker",
        start,
        lambda w: [f"meshllm worker {w.id} ({config.engine}, {config.role.value}) serving on {w.address}"],
        service_name=worker_service_name(config.role.value),
        otlp_endpoint=config.otlp_endpoint,
        closing=Worker.wait_closing,
    )


def run(engine_cls: type[LLMEngine], argv: Sequence[str] | None = None) -> int:
    """Run a worker for `engine_cls` (for engines packaged outside meshllm)."""
    setup_logging()
    try:
        return run_loop(serve(engine_cls, sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        return command_error("worker", exc.message)


def main(argv: Sequence[str]) -> int:
    """`meshllm worker --engine NAME|module:Class [flags]`."""
    pre = argparse.ArgumentParser(prog="meshllm worker", add_help=False)
    pre.add_argument("--engine", default=os.environ.get("MESHLLM_ENGINE", "mocker"))
    ns, rest = pre.parse_known_args(argv)
    try:
        engine_cls = load_engine_class(ns.engine)
    except ConfigError as exc:
        return command_error("worker", exc.message)
    return run(engine_cls, rest)
