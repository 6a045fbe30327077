"""What a Generate session costs per message on each carrier: a gRPC GenerateSession call, or frames on TCP.

    .venv/bin/python bench/session_carrier.py                 # writes "## Session carriers" in docs/benchmarks.md
    .venv/bin/python bench/session_carrier.py --no-write --rounds 2

One process, a real server and client on loopback: a `SessionServer` whose streams each yield `--tokens` chunks, one
per ~1 ms handler step, served both as `GenerateSession` on a grpc.aio server and on its TCP session port
(`meshllm.plane.request.tcp_session`, what `meshllm worker --session-port` serves); a `SessionClient` on each carrier reads
the streams. Two loads: `--streams` streams at once (a message per step carries one item per stream) and one stream
alone (a message per step carries one item: the cost per message shows bare). The figure is the process's CPU time
(server and client together) per stream-token, median (range) over `--rounds` rounds, the carriers alternating.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from harness.runinfo import machine, today, versions
from session_relay import StepWorker, run_session_bench

from meshllm.config import ServerConfig
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.request.server import ServiceBinding, start_server
from meshllm.plane.request.session import SessionClient
from meshllm.v1 import worker_pb2_grpc

HEADING = "## Session carriers"
METHOD = "/meshllm.v1.Worker/Generate"
CARRIERS = ("grpc", "tcp")


async def _stream(client: SessionClient, rid: str) -> int:
    n = 0
    async for chunk in client.generate({"request_id": rid, "token_ids": [1]}):
        n += len(chunk.get("token_ids", ()))
    return n


async def measure(streams: int, tokens: int, rounds: int) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(carrier, streams) → [(CPU µs per stream-token, items per message)] per round, the carriers alternating."""
    servicer = StepWorker(tokens)
    binding = ServiceBinding(
        "meshllm.v1.Worker", servicer, worker_pb2_grpc.add_WorkerServicer_to_server, servicer.sessions.close,
        sessions=servicer.sessions,
    )  # fmt: skip
    config = ServerConfig(host="127.0.0.1", port=0, session_port=0)
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    async with await start_server(config, [binding]) as srv, ChannelCache() as grpc_side, ChannelCache() as tcp_side:
        tcp_side.route_sessions(srv.address, f"127.0.0.1:{srv.session_port}")
        open_tcp = tcp_side.session_call(srv.address, "Worker")
        assert open_tcp is not None
        clients = {
            "grpc": SessionClient(worker_pb2_grpc.WorkerStub(grpc_side.get(srv.address)).GenerateSession, "grpc", METHOD),
            "tcp": SessionClient(open_tcp, "tcp", METHOD),
        }
        try:
            for n in (streams, 1):
                for c in CARRIERS:
                    await asyncio.gather(*(_stream(clients[c], f"warm-{c}{n}-{k}") for k in range(n)))
                for r in range(rounds):
                    for c in CARRIERS if r % 2 == 0 else CARRIERS[::-1]:
                        client = clients[c]
                        m0, i0 = client.stats
                        c0 = time.process_time()
                        counts = await asyncio.gather(*(_stream(client, f"{c}{n}-{r}-{k}") for k in range(n)))
                        cpu = time.process_time() - c0
                        assert counts == [tokens] * n, counts
                        messages, items = client.stats[0] - m0, client.stats[1] - i0
                        out.setdefault((c, n), []).append((cpu / (n * tokens) * 1e6, items / max(messages, 1)))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients.values()))
    return out


def report(res: dict[tuple[str, int], list[tuple[float, float]]], *, streams: int, tokens: int, rounds: int) -> str:
    rows = []
    for n in (streams, 1):
        base = statistics.median(v for v, _ in res[("grpc", n)])
        for c in CARRIERS:
            vals = [v for v, _ in res[(c, n)]]
            per_msg = statistics.median(i for _, i in res[(c, n)])
            med = statistics.median(vals)
            label = "gRPC `GenerateSession` call" if c == "grpc" else "TCP frames (`--session-port`)"
            rows.append(f"| {n} | {label} | {med:.1f} ({min(vals):.1f}–{max(vals):.1f}) | {per_msg:.1f} | {med / base:.2f}× |")
    return (
        f"{HEADING}\n\n"
        f"`.venv/bin/python bench/session_carrier.py --rounds {rounds}` on {today()} ({machine()}; "
        f"{versions('grpcio', 'protobuf', 'uvloop')}): one process, one `SessionServer` served both as a grpc.aio "
        f"`GenerateSession` call and on its TCP session port, a `SessionClient` on each; {tokens} chunks per stream, "
        f"one per ~1 ms handler step. CPU time of the whole process (server and client) per stream-token, median "
        f"(range) of {rounds} rounds, the carriers alternating; items per message is what one message carried.\n\n"
        f"| streams at once | carrier | CPU µs per stream-token | items per message | × gRPC |\n"
        f"|---:|---|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        "With one stream every message carries one token, so its row is the cost of a message at both ends; "
        'docs/architecture.md "Sessions on TCP" says where the difference goes.\n'
    )


def main(argv: list[str]) -> int:
    return run_session_bench(argv, __doc__, measure, report, HEADING)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
