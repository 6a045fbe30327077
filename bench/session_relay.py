"""What a relay saves per chunk: a Generate session's streams read through generator layers, or handed to a relay.

    .venv/bin/python bench/session_relay.py                 # writes "## Session relay" in docs/benchmarks.md
    .venv/bin/python bench/session_relay.py --no-write --rounds 2

One process, a real grpc.aio server and client on loopback: a `SessionServer` whose streams each yield
`--tokens` chunks, one per ~1 ms step of the handler, and a `SessionClient` that reads `--streams` of them at
once, either as the router did before it relayed (every chunk through the client's iterator and three more
async generator layers: the router's leg, migration and server pump) or as the router relays now
(`SessionClient.generate(relay=...)`: the session's reader hands each chunk to a relay; the iterator yields only
the terminal). The figure is the process's CPU time per stream-token, server included (it is the same on both
sides, so the difference is the client's); the two ways alternate `--rounds` times, medians shown.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from harness.doc import write_section
from harness.runinfo import machine, today, versions

from meshllm.config import ServerConfig
from meshllm.engine.base import terminal
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.server import ServiceBinding, start_server
from meshllm.plane.request.session import SessionClient, SessionServer
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import session_pb2, worker_pb2_grpc

HEADING = "## Session relay"
METHOD = "/meshllm.v1.Worker/Generate"
WAYS = ("iterator", "relay")


class StepWorker(worker_pb2_grpc.WorkerServicer):
    """A Worker whose session streams each yield `tokens` chunks, one per ~1 ms step (shared with session_carrier)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.sessions = SessionServer(self.handler, METHOD, min_interval_s=0.0)

    async def handler(self, request: TokenRequest, call: CallInfo) -> AsyncIterator[TokenChunk]:
        for i in range(self.tokens):
            await asyncio.sleep(0.001)  # a step: the streams' tokens leave together, one message per step
            yield {"token_ids": [i]}
        yield terminal("length", {"prompt_tokens": 1, "completion_tokens": self.tokens, "cached_tokens": 0})

    async def GenerateSession(
        self, request_iterator: AsyncIterator[session_pb2.SessionUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[session_pb2.SessionDown]:
        async for down in self.sessions.serve(request_iterator, context):
            yield down


async def _layer(it: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
    async for chunk in it:
        yield chunk


async def _stream(client: SessionClient, way: str, rid: str) -> int:
    req: TokenRequest = {"request_id": rid, "token_ids": [1]}
    got: list[TokenChunk] = []
    if way == "relay":
        async for chunk in client.generate(req, relay=got.append):
            got.append(chunk)
    else:
        async for chunk in _layer(_layer(_layer(client.generate(req)))):
            got.append(chunk)
    return sum(len(c.get("token_ids", ())) for c in got)


async def measure(streams: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    """CPU µs per stream-token for each way, `rounds` times, the ways alternating."""
    servicer = StepWorker(tokens)
    binding = ServiceBinding("meshllm.v1.Worker", servicer, worker_pb2_grpc.add_WorkerServicer_to_server, servicer.sessions.close)
    out: dict[str, list[float]] = {w: [] for w in WAYS}
    async with await start_server(ServerConfig(host="127.0.0.1", port=0), [binding]) as srv, ChannelCache() as channels:
        client = channels.shared(
            srv.address, "bench", lambda ch: SessionClient(worker_pb2_grpc.WorkerStub(ch).GenerateSession, "bench", METHOD)
        )
        await asyncio.gather(*(_stream(client, "relay", f"warm{k}") for k in range(streams)))
        for r in range(rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                c0 = time.process_time()
                counts = await asyncio.gather(*(_stream(client, way, f"{way}{r}-{k}") for k in range(streams)))
                cpu = time.process_time() - c0
                assert counts == [tokens] * streams, counts
                out[way].append(cpu / (streams * tokens) * 1e6)
    return out


def report(res: dict[str, list[float]], *, streams: int, tokens: int, rounds: int) -> str:
    it, relay = statistics.median(res["iterator"]), statistics.median(res["relay"])
    rng = {w: f"{min(v):.1f}–{max(v):.1f}" for w, v in res.items()}
    return (
        f"{HEADING}\n\n"
        f"`.venv/bin/python bench/session_relay.py --rounds {rounds}` on {today()} ({machine()}; "
        f"{versions('grpcio', 'protobuf', 'uvloop')}): one process, a real grpc.aio server and client on loopback, "
        f"{streams} streams at once on one session, {tokens} chunks each (one per ~1 ms handler step); CPU time of "
        f"the whole process (server included) per stream-token, median (range) of {rounds} rounds, the two ways "
        f"alternating.\n\n"
        f"| way the client takes a chunk | CPU µs per stream-token | × iterator |\n|---|---:|---:|\n"
        f"| iterator, through three more generator layers (the router before it relayed) | {it:.1f} ({rng['iterator']}) "
        f"| 1.00× |\n"
        f"| relay, from the session's reader (as the router relays) | {relay:.1f} ({rng['relay']}) | {relay / it:.2f}× |\n\n"
        f"The difference, {it - relay:.1f} µs per chunk, is what the router process saves per worker chunk it relays "
        f'(docs/architecture.md "The router relays").\n'
    )


def run_session_bench(argv: list[str], doc: str | None, measure: Any, report: Any, heading: str) -> int:
    """The command line of a session bench (this one, session_carrier): --streams, --tokens, --rounds, --no-write."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    if min(args.streams, args.tokens, args.rounds) < 1:
        p.error("--streams, --tokens and --rounds must be >= 1")
    import uvloop

    res = uvloop.run(measure(args.streams, args.tokens, args.rounds))
    text = report(res, streams=args.streams, tokens=args.tokens, rounds=args.rounds)
    print(text)
    if not args.no_write:
        write_section(heading, text)
    return 0


def main(argv: list[str]) -> int:
    return run_session_bench(argv, __doc__, measure, report, HEADING)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
