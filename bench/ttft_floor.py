"""Benchmark the least the split mesh can add to a first token here: prompt encoding and two gRPC hops, after idle.

    .venv/bin/python bench/ttft_floor.py              # measure, print, update docs/benchmarks.md
    .venv/bin/python bench/ttft_floor.py --no-write   # measure and print only

Before a request's first token the split mesh must encode the prompt (the
frontend) and cross gRPC twice: the frontend's `StreamOpen` to the worker, and
the worker's first `SessionDown` back, sent when the engine's prefill ends.
This measures those three with nothing else of the mesh, in the order and
idleness of a request at concurrency 1 and --speedup-ratio 1:

1. the client (the frontend's part) sleeps 6 ms (the gap between a response's
   tokens), then encodes a ~630-token chat prompt with `HFTokenizer.encode`
   (the frontend's call; prompts where no piece repeats, bench/mesh.py's load);
2. it writes a `StreamOpen` with those ids on one bidirectional grpc.aio call
   to a server in its own process (uvloop, as the services run): hop 1 is
   the write to the server's read;
3. the server sleeps 25 ms (the prefill: both processes idle), then writes a
   `SessionDown` with a one-token chunk: hop 2 is that write to the client's
   read.

Each side reads `time.perf_counter()` (CLOCK_MONOTONIC, one clock for the
machine's processes); the server sends its two instants back in the reply's
stream ids. A row "back to back" runs the same with no sleeps. The sum leaves
out the HTTP request's parsing, routing, the worker's admission and the SSE
event's write, so the mesh's real overhead can only be larger. Nothing here is
a target; it says what a target below it would need.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from harness.doc import publish
from harness.runinfo import LoadMonitor, load_sentence, machine, today, versions
from harness.stats import triple
from tokenize_cache import smollm2, unique_prompts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "services"))

import grpc  # noqa: E402
import uvloop  # noqa: E402

from meshllm.v1 import session_pb2  # noqa: E402

SECTION = "## First-token floor"
SETTLE = 2  # a block's first requests follow the other kind's pauses: not counted
SERVICE, METHOD = "floor.Session", "GenerateSession"
KINDS: tuple[tuple[str, float, float], ...] = (
    # label, client asleep before encoding, server asleep before replying (seconds)
    ("back to back", 0.0, 0.0),
    ("as at concurrency 1 (asleep 6 ms, then a 25 ms prefill)", 0.006, 0.025),
)
PARTS = ("encode", "hop 1", "hop 2", "sum")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


async def _serve() -> None:
    async def session(requests: AsyncIterator[session_pb2.SessionUp], _: Any) -> AsyncIterator[session_pb2.SessionDown]:
        async for up in requests:
            received = time.perf_counter()
            op = up.open[0]
            if op.timeout_s > 0:  # the client's way of saying "prefill this long"
                await asyncio.sleep(op.timeout_s)
            down = session_pb2.SessionDown()
            down.items.add(stream_id=_ns(received))
            item = down.items.add(stream_id=_ns(time.perf_counter()))
            item.chunk.token_ids.append(42)
            yield down

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            METHOD: grpc.stream_stream_rpc_method_handler(
                session,
                request_deserializer=session_pb2.SessionUp.FromString,
                response_serializer=session_pb2.SessionDown.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)  # the client reads its port from this process's first line
    await server.wait_for_termination()


async def _measure(port: int, n: int, block: int, seed: int) -> tuple[dict[str, dict[str, list[float]]], float]:
    tok, template = smollm2()
    rounds = -(-n // (block - SETTLE))
    texts = iter(unique_prompts(template, rounds * block * len(KINDS) + 20, seed))
    times = {label: {p: [] for p in PARTS} for label, _, _ in KINDS}
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            f"/{SERVICE}/{METHOD}",
            request_serializer=session_pb2.SessionUp.SerializeToString,
            response_deserializer=session_pb2.SessionDown.FromString,
        )()

        async def once(asleep: float, prefill: float) -> tuple[float, float, float, int]:
            text = next(texts)
            if asleep:
                await asyncio.sleep(asleep)  # the loop idle, as a frontend between tokens
            t0 = time.perf_counter()
            ids = tok.encode(text)
            t1 = time.perf_counter()
            up = session_pb2.SessionUp()
            op = up.open.add(stream_id=1, timeout_s=prefill)
            op.request.token_ids.extend(ids)
            sent = time.perf_counter()
            await call.write(up)
            down = await call.read()
            got = time.perf_counter()
            received, replied = (it.stream_id / 1e9 for it in down.items)
            return (t1 - t0) * 1000, (received - sent) * 1000, (got - replied) * 1000, len(ids)

        for _ in range(20):  # warm-up: the call, both sides' code paths, the BPE word cache
            await once(0.0, 0.0)
        for _ in range(rounds):
            for label, asleep, prefill in KINDS:
                for k in range(block):
                    enc, hop1, hop2, n_ids = await once(asleep, prefill)
                    row = times[label]
                    if k >= SETTLE and len(row["sum"]) < n:
                        for part, v in zip(PARTS, (enc, hop1, hop2, enc + hop1 + hop2), strict=True):
                            row[part].append(v)
                        tokens.append(n_ids)
        await call.done_writing()
    return times, statistics.mean(tokens)


def run(n: int, block: int, seed: int) -> tuple[dict[str, dict[str, list[float]]], float]:
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        if not line.isdigit():
            raise SystemExit(f"the gRPC server did not start (it said {line!r})")
        return uvloop.run(_measure(int(line), n, block, seed))
    finally:
        server.terminate()
        server.wait(10)


def render(times: dict[str, dict[str, list[float]]], tokens: float, n: int, block: int, loads: list[float]) -> str:
    rows = "\n".join(f"| {label} | {' | '.join(triple(row[p], '{:.3f}') for p in PARTS)} |" for label, row in times.items())
    idle = times[KINDS[1][0]]["sum"]
    return f"""{SECTION}

`.venv/bin/python bench/ttft_floor.py --requests {n} --block {block}` on {today()} ({machine()};
{versions("tokenizers", "grpcio", "protobuf", "uvloop")}).
What a first token through the split mesh cannot avoid, without the rest of the mesh: the frontend's prompt
encoding (`HFTokenizer.encode` of a SmolLM2 chat prompt of {tokens:,.0f} tokens on average, no piece repeating) and
two gRPC hops on one bidirectional grpc.aio call between two processes on loopback (uvloop): hop 1 carries the
`StreamOpen` with those ids to the server, hop 2 the server's one-token `SessionDown` back. *As at concurrency 1*:
the client's event loop sleeps 6 ms before encoding (the gap between a response's tokens at --speedup-ratio 1) and the
server 25 ms before replying (the prefill, both processes idle); *back to back*: no sleeps. Hops are one-way,
from the sender's write to the receiver's read (CLOCK_MONOTONIC, one clock for both processes). {n} requests per
row, p50 / p90 / p99 in ms; the kinds take turns in blocks of {block}, the first {SETTLE} of a block not counted;
*sum* is per request. {load_sentence(loads)}

| requests | encode | hop 1 | hop 2 | sum |
|---|---:|---:|---:|---:|
{rows}

At concurrency 1 the split mesh's first token pays at least the *as at concurrency 1* sum, {statistics.median(idle):.2f} ms
at p50, on top of the engine's prefill; the HTTP request's parsing, routing, the worker's admission and the first
SSE event's write come on top of it.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per row")
    parser.add_argument("--block", type=int, default=20, help="requests of one kind in a row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the gRPC server's process
    args = parser.parse_args(argv)
    if args.serve:
        uvloop.run(_serve())
        return 0
    if args.requests < 1 or args.block <= SETTLE:
        parser.error(f"--requests must be at least 1 and --block more than {SETTLE}")
    with LoadMonitor() as monitor:
        times, tokens = run(args.requests, args.block, args.seed)
    section = render(times, tokens, args.requests, args.block, monitor.samples)
    publish(SECTION, section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
