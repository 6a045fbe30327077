"""A frontend in front of two router replicas (real in-process gRPC RouterServers) keeps its streams when one dies.

Each replica is reached through a TCP proxy; closing the proxy is the
replica's death as the frontend sees it (every connection reset, the port
refusing). Locks: streams that replica carried resume on the other one
after some tokens and the client gets exactly the text, finish reason and
usage of an undisturbed run — a stop string after the break still stops
the stream where it did; a guided-decoding stream, or one of a model whose
migration limit is 0, is not resumed (the client sees an error event); with
no replica reachable a request waits for one to come back (bounded by
`--router-wait-s`), and past the bound gets an OpenAI-shaped 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from frontend_support import PLANE, request

from meshllm.engine.mocker import MockerConfig, MockerEngine
from meshllm.engine.worker_config import WorkerConfig
from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.main import Frontend
from meshllm.frontend.upstream import RouterReplicas
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.router import RouterConfig, RouterMode
from meshllm.router.main import RouterServer
from meshllm.testing.mesh import Completion, StreamSet, stream_completion
from meshllm.testing.tcpproxy import TcpProxy
from meshllm.testing.waiting import wait_until
from meshllm.worker.runtime import Worker

pytestmark = pytest.mark.timeout(60)

MAX_TOKENS = 48


@dataclass
class Replica:
    server: RouterServer
    proxy: TcpProxy

    def streams(self) -> int:
        """Worker streams this replica routed and still runs (the load charges of its own origin)."""
        core = self.server.core
        assert core is not None
        return sum(1 for origin, _ in core.load._charges if origin == core.id)


@dataclass
class Stack:
    frontend: Frontend
    replicas: list[Replica]
    worker: Worker
    closers: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.frontend.url

    @property
    def upstream(self) -> RouterReplicas:
        assert isinstance(self.frontend.upstream, RouterReplicas)
        return self.frontend.upstream

    def carrying(self) -> Replica:
        """The replica that streams requests now (exactly one must)."""
        busy = [r for r in self.replicas if r.streams()]
        assert len(busy) == 1, [r.streams() for r in self.replicas]
        return busy[0]


@asynccontextmanager
async def stack(
    replicas: int = 2, *, router_wait_s: float = 5.0, speedup: float = 4.0, migration_limit: int = 3
) -> AsyncIterator[Stack]:
    """A mocker worker, `replicas` RouterServers behind TCP proxies and a frontend, on memory planes."""
    store, broker = MemoryStore(), MemoryBroker()
    engine = MockerEngine(MockerConfig(block_size=16, num_gpu_blocks=2048, speedup_ratio=speedup, context_length=4096))
    wcfg = WorkerConfig(
        engine="mocker", plane=PLANE, grace_period_s=0.0, health_check_interval_s=3600, migration_limit=migration_limit
    )
    worker = await Worker.start(engine, wcfg, memory_store=store, memory_broker=broker)
    closers: list[Any] = [worker]
    reps: list[Replica] = []
    try:
        for i in range(replicas):
            rcfg = RouterConfig(plane=PLANE, mode=RouterMode.ROUND_ROBIN, router_id=f"r{i}")
            server = await RouterServer.start(rcfg, memory_store=store, memory_broker=broker)
            closers.append(server)
            host, port = server.address.rsplit(":", 1)
            proxy = TcpProxy("127.0.0.1" if host in ("0.0.0.0", "") else host, int(port))
            await proxy.start()
            closers.append(proxy)
            reps.append(Replica(server, proxy))
        config = FrontendConfig(
            plane=PLANE, http_port=0, grpc=None, router_addresses=tuple(r.proxy.address for r in reps),
            router_wait_s=router_wait_s,
        )  # fmt: skip
        fe = await Frontend.start(config, memory_store=store, memory_broker=broker)
        closers.append(fe)
        assert fe.registry is not None
        await fe.registry.wait_for("mocker", timeout_s=30)
        yield Stack(fe, reps, worker, closers)
    finally:
        for thing in reversed(closers):
            await thing.aclose()


def body(i: int, *, chat: bool = False, **extra: Any) -> dict[str, Any]:
    if chat:  # a chat: its content events are written from the session reader (frontend/http/sse_direct.py)
        words = " ".join(f"w{(i * 7919 + k * 104729) % 3000}" for k in range(20 + i))
        question: dict[str, Any] = {"messages": [{"role": "user", "content": words}]}
    else:
        question = {"prompt": [(i * 7919 + k * 104729) % 30000 + 3 for k in range(40 + i)]}
    return {"model": "mocker", **question, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int, int]:
    """Usage without the cached tokens (a repeated prompt finds its prefix cached; that is not the point here)."""
    assert usage is not None
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def late_word(text: str) -> str:
    """A word whose first occurrence is in the second half of `text`."""
    for word in text[len(text) * 3 // 5 :].split()[1:]:
        if text.index(word) >= len(text) // 2:
            return word
    raise AssertionError(f"no late word in {text!r}")


async def run_all(url: str, payloads: list[dict[str, Any]], *, chat: bool = False) -> list[Completion]:
    return list(await asyncio.wait_for(asyncio.gather(*(stream_completion(url, p, chat=chat) for p in payloads)), 30))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_streams_of_a_dying_replica_resume_on_the_other_with_the_exact_output(chat: bool) -> None:
    async with stack() as s:
        n = 8
        undisturbed = await run_all(s.url, [body(i, chat=chat) for i in range(n)], chat=chat)
        for r in undisturbed:
            assert r.ok and r.finish_reason == "length" and r.usage is not None
            assert r.usage["completion_tokens"] == MAX_TOKENS
        # Even requests stop at a word that first comes late in their output: after the break.
        stops = {i: late_word(undisturbed[i].text) for i in range(0, n, 2)}
        payloads = [body(i, chat=chat, stop=[stops[i]]) if i in stops else body(i, chat=chat) for i in range(n)]
        streams = StreamSet.completions(s.url, payloads, timeout_s=30, chat=chat)
        await wait_until(lambda: streams.under_way(3), timeout_s=20, what="every stream under way")
        assert max(len(a) for a in streams.arrivals) < MAX_TOKENS // 2  # the break comes mid-stream
        dying = s.replicas[0]
        carried = dying.streams()
        assert carried == n // 2  # round-robin
        await dying.proxy.aclose()  # replica 0 dies: its connections reset, its port refuses
        results = await streams.results(30)
        assert s.upstream.resumed == carried
        for i, (got, want) in enumerate(zip(results, undisturbed, strict=True)):
            assert got.ok, (i, got.error)
            if i in stops:
                cut = want.text.index(stops[i])
                assert (got.text, got.finish_reason) == (want.text[:cut], "stop"), i
                assert got.usage is not None and 0 < got.usage["completion_tokens"] <= MAX_TOKENS
            else:
                assert (got.text, got.finish_reason, usage_counts(got.usage)) == (
                    want.text, want.finish_reason, usage_counts(want.usage),
                ), i  # fmt: skip
            assert got.usage is not None and got.usage["prompt_tokens_details"]["cached_tokens"] <= got.usage["prompt_tokens"]


@pytest.mark.parametrize(
    ("extra", "migration_limit"), [({"guided_regex": "[a-z ]+"}, 3), ({}, 0)], ids=["guided", "migration-limit-0"]
)
async def test_a_stream_that_may_not_migrate_ends_with_an_error_event(extra: dict[str, Any], migration_limit: int) -> None:
    async with stack(speedup=2.0, migration_limit=migration_limit) as s:
        streams = StreamSet.completions(s.url, [body(1, **extra)], timeout_s=30)
        await wait_until(lambda: streams.under_way(3), timeout_s=20, what="the stream under way")
        await s.carrying().proxy.aclose()
        [result] = await streams.results(30)
        assert s.upstream.resumed == 0
        assert isinstance(result.error, dict) and result.finish_reason is None, result
        assert result.error["code"] in ("Unavailable", "Disconnected", "StreamIncomplete"), result.error


async def test_requests_wait_for_a_restarting_router_and_fail_with_503_past_the_bound() -> None:
    async with stack(replicas=1, router_wait_s=10.0) as s:
        only = s.replicas[0]
        port = only.proxy.listen_port
        target = (only.proxy.target_host, only.proxy.target_port)
        await only.proxy.aclose()  # the router is "restarting": its port refuses connections
        streams = StreamSet.completions(s.url, [body(i) for i in range(4)], timeout_s=30)
        core = s.frontend.core
        assert core is not None
        await wait_until(lambda: core.inflight == 4, timeout_s=10, what="four requests admitted and waiting")
        assert not any(t.done() for t in streams.tasks)
        back = TcpProxy(*target, listen_port=port)  # the router is back on its address
        s.closers.append(back)
        await back.start()
        for r in await streams.results(30):
            assert r.ok and r.finish_reason == "length" and r.usage is not None, r
            assert r.usage["completion_tokens"] == MAX_TOKENS

        s.upstream.wait_s = 0.5  # past the bound: a clear 503
        await back.aclose()
        t0 = time.monotonic()
        reply = await asyncio.wait_for(request(s.url, "/v1/completions", body(0)), 10)
        assert reply.status == 503, reply.body
        err = reply.json()["error"]
        assert err["type"] == "service_unavailable_error" and "no router replica could be reached" in err["message"], err
        assert 0.4 <= time.monotonic() - t0 < 5
