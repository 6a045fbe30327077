"""What the planner reads of the mesh: an interval's observation from two readings of the frontends' real metrics,
those readings scraped over real HTTP, and the workers from a real in-memory discovery.

The frontend's metrics are the frontend's own, fed the way a request feeds them (tests/unit/planner_frontend.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from planner_frontend import Frontend, MetricsServer, Request

from meshllm.errors import CannotConnect, Unavailable
from meshllm.plane.discovery.base import MemoryDiscovery, MemoryStore
from meshllm.planner.observe import MeshReader, WorkerLoad, observation
from meshllm.served_counts import Counts
from meshllm.testing.servers import free_port
from meshllm.testing.waiting import wait_until
from meshllm.v1 import discovery_pb2, router_pb2

pytestmark = pytest.mark.timeout(60)

NO_WORKERS = WorkerLoad({})


# ------------------------------------------------------------------ observation()


def test_an_interval_counts_streams_started_and_tokens_sent_and_averages_the_ended_requests() -> None:
    fe = Frontend()
    fe.serve(Request(isl=1000, osl=500))  # before the interval: not in it
    old = fe.read(100.0)
    fe.serve(Request(isl=100, osl=10))
    fe.serve(Request(isl=300, osl=30))
    long = fe.start(Request(isl=5000, osl=200))  # streaming at the end of the interval: started, not ended
    new = fe.read(110.0)

    obs = observation(new, old, WorkerLoad({"agg": 3}, waiting=4, kv_usage=0.25))
    assert obs.at == 110.0 and obs.interval_s == 10.0
    assert obs.requests == 3  # first tokens sent in the interval
    assert obs.request_rate == pytest.approx(0.3)
    assert obs.output_tokens == 3 + (10 - 1) + (30 - 1)  # a first token per stream, then one ITL per token
    assert obs.isl == pytest.approx((100 + 300) / 2)  # means over the two that ended
    assert obs.osl == pytest.approx((10 + 30) / 2)
    assert obs.workers == {"agg": 3} and obs.waiting == 4 and obs.kv_usage == 0.25

    fe.finish(long)
    later = observation(fe.read(120.0), new, NO_WORKERS)
    assert later.requests == 0  # its first token was in the interval before
    assert later.output_tokens == 200 - 1
    assert later.isl == 5000 and later.osl == 200


def test_requests_refused_before_any_token_do_not_shorten_the_mean_lengths() -> None:
    """Under overload the frontend answers 429s: counted as requests, with no tokens. Averaging over them would read
    the prompts as shorter (here a third) just when the mesh needs more prefill workers."""
    fe = Frontend()
    old = fe.read(0.0)
    fe.serve(Request(isl=600, osl=60))
    fe.refuse("429")
    fe.refuse("400")
    obs = observation(fe.read(5.0), old, NO_WORKERS)
    assert obs.isl == 600 and obs.osl == 60
    assert obs.requests == 1


def test_p90s_interpolate_within_the_buckets() -> None:
    fe = Frontend()
    old = fe.read(0.0)
    for ttft in (0.03,) * 5 + (0.3,) * 5:  # TTFT buckets ... 0.025, 0.05, 0.1, 0.25, 0.5 ...
        fe.serve(Request(isl=10, osl=2, ttft_s=ttft, itl_s=0.02))  # ITL buckets ... 0.01, 0.025 ...
    obs = observation(fe.read(1.0), old, NO_WORKERS)
    # rank 0.9 x 10 = 9 falls in (0.25, 0.5], which holds observations 6..10: 0.25 + 0.25 x (9 - 5) / 5
    assert obs.ttft_p90_s == pytest.approx(0.25 + 0.25 * 4 / 5)
    # all 10 ITLs in (0.01, 0.025]: 0.01 + 0.015 x 9 / 10
    assert obs.itl_p90_s == pytest.approx(0.01 + 0.015 * 9 / 10)


def test_an_idle_interval_has_no_latency_or_length_and_no_load() -> None:
    fe = Frontend()
    fe.serve(Request(isl=100, osl=10))
    old = fe.read(0.0)
    obs = observation(fe.read(30.0), old, NO_WORKERS)
    assert (obs.ttft_p90_s, obs.itl_p90_s, obs.isl, obs.osl) == (None, None, None, None)
    assert obs.requests == 0 and obs.output_tokens == 0 and obs.output_rate == 0


def test_a_counter_reset_never_reads_as_negative_load() -> None:
    before = Frontend()
    for _ in range(20):
        before.serve(Request(isl=100, osl=10))
    restarted = Frontend()  # the frontend restarted: its counters start again from zero
    restarted.serve(Request(isl=100, osl=10))
    obs = observation(restarted.read(10.0), before.read(0.0), NO_WORKERS)
    assert obs.requests >= 0 and obs.output_tokens is not None and obs.output_tokens >= 0
    assert obs.isl is None or obs.isl >= 0
    assert obs.osl is None or obs.osl >= 0
    assert obs.request_rate >= 0 and (obs.output_rate or 0) >= 0


# ------------------------------------------------------------------ MeshReader.counts over HTTP


@pytest.fixture
def servers() -> Iterator[list[MetricsServer]]:
    made: list[MetricsServer] = []
    yield made
    for s in made:
        s.close()


def serve(servers: list[MetricsServer], fe: Frontend, api_key: str | None = None) -> MetricsServer:
    s = MetricsServer(fe, api_key)
    servers.append(s)
    return s


def busy(requests: int, isl: int) -> Frontend:
    fe = Frontend()
    for i in range(requests):
        fe.serve(Request(isl=isl, osl=5 + i, ttft_s=0.01 * (i + 1)))
    return fe


def _summed(a: Counts, b: Counts) -> dict[str, Any]:
    buckets = {k: {le: a.buckets[k].get(le, 0) + b.buckets[k].get(le, 0) for le in a.buckets[k]} for k in a.buckets}
    fields = ("requests", "failed", "input_tokens", "output_tokens", "inflight")
    return {**{f: getattr(a, f) + getattr(b, f) for f in fields}, "buckets": buckets}


async def test_counts_are_summed_over_the_frontends(servers: list[MetricsServer]) -> None:
    one, two = busy(3, isl=100), busy(5, isl=700)
    two.refuse("503")
    reader = MeshReader([serve(servers, one).url, serve(servers, two).url + "/v1"], MemoryDiscovery(MemoryStore()))
    async with reader:
        counts = await reader.counts(42.0)
    assert counts.at == 42.0
    expected = _summed(one.read(0), two.read(0))
    assert {f: getattr(counts, f) for f in expected} == expected
    assert counts.requests == 9 and counts.failed == 1 and counts.input_tokens == 3 * 100 + 5 * 700


async def test_a_frontend_asking_for_a_key_names_the_flag_and_the_key_opens_it(servers: list[MetricsServer]) -> None:
    fe = busy(2, isl=50)
    url = serve(servers, fe, api_key="sk-test").url
    async with MeshReader([url], MemoryDiscovery(MemoryStore())) as reader:
        with pytest.raises(CannotConnect, match=r"HTTP 401.*--frontend-api-key"):
            await reader.counts(0.0)
    async with MeshReader([url], MemoryDiscovery(MemoryStore()), api_key="sk-test") as reader:
        assert (await reader.counts(0.0)).requests == 2


async def test_an_unreachable_frontend_fails_the_whole_reading(servers: list[MetricsServer]) -> None:
    live = serve(servers, busy(1, isl=10)).url
    async with MeshReader([live, f"http://127.0.0.1:{free_port()}"], MemoryDiscovery(MemoryStore())) as reader:
        with pytest.raises(CannotConnect, match=r"cannot read http://127\.0\.0\.1:\d+/metrics"):
            await reader.counts(0.0)


def _scrapes_running() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if not t.done() and t.get_coro().__qualname__ == "FrontendScraper._scrape"]  # type: ignore[union-attr]


async def test_a_failed_reading_leaves_no_scrape_running_and_the_next_one_works(servers: list[MetricsServer]) -> None:
    """One frontend failing ends the reading at once; the scrape of a slow one must not run on in the background,
    where the next reading's request on the same connection would cross it."""
    failing, slow = serve(servers, busy(1, isl=10)), serve(servers, busy(2, isl=20))
    failing.fail = True
    slow.hold.clear()
    async with MeshReader([failing.url, slow.url], MemoryDiscovery(MemoryStore())) as reader:
        reading = asyncio.create_task(reader.counts(0.0))
        await wait_until(slow.received.is_set, what="the slow frontend to get its request")
        with pytest.raises(CannotConnect, match="HTTP 503"):
            await reading
        assert _scrapes_running() == []
        failing.fail = False
        slow.hold.set()
        counts = await reader.counts(1.0)
        assert counts.requests == 3


# ------------------------------------------------------------------ MeshReader.workers


def _worker(role: int, i: int, component: str = "worker") -> discovery_pb2.Instance:
    return discovery_pb2.Instance(id=f"w{i}", component=component, endpoint="generate", address=f"127.0.0.1:{9000 + i}",
                                  role=role, model="m")  # fmt: skip


async def test_workers_are_counted_per_role_from_discovery() -> None:
    store = MemoryStore()
    roles = [discovery_pb2.WORKER_ROLE_AGGREGATED] * 2 + [discovery_pb2.WORKER_ROLE_PREFILL]
    roles += [discovery_pb2.WORKER_ROLE_DECODE] * 3
    handles = [MemoryDiscovery(store) for _ in roles]
    for i, (handle, role) in enumerate(zip(handles, roles, strict=True)):
        await handle.register_instance(_worker(role, i, "prefill" if role == discovery_pb2.WORKER_ROLE_PREFILL else "worker"))
    router = MemoryDiscovery(store)
    await router.register_instance(discovery_pb2.Instance(id="r0", component="router", endpoint="generate", address="h:1"))
    reader = MeshReader(["http://127.0.0.1:1"], MemoryDiscovery(store))

    assert await reader.workers() == WorkerLoad({"agg": 2, "prefill": 1, "decode": 3})
    await handles[-1].aclose()  # a decode worker left (drained or died)
    assert await reader.workers() == WorkerLoad({"agg": 2, "prefill": 1, "decode": 2})
    await reader.aclose()


class FakeRouter:
    """A router's ListWorkers (the one call MeshReader makes), answering `workers` or failing."""

    address = "127.0.0.1:7000"

    def __init__(self, workers: list[router_pb2.WorkerStatus] | None) -> None:
        self.workers = workers

    async def list_workers(self, model: str | None = None) -> router_pb2.ListWorkersResponse:
        if self.workers is None:
            raise Unavailable("router is restarting")
        return router_pb2.ListWorkersResponse(workers=self.workers)


async def test_queues_kv_use_and_busy_workers_come_from_the_router_and_a_silent_router_costs_only_those() -> None:
    store = MemoryStore()
    worker = MemoryDiscovery(store)
    await worker.register_instance(_worker(discovery_pb2.WORKER_ROLE_AGGREGATED, 1))
    statuses = [router_pb2.WorkerStatus(worker_id="w1", active_blocks=30, total_blocks=100, waiting=2, in_flight=4),
                router_pb2.WorkerStatus(worker_id="w2", active_blocks=10, total_blocks=60, waiting=5)]  # fmt: skip
    reader = MeshReader(["http://127.0.0.1:1"], MemoryDiscovery(store), router=FakeRouter(statuses))  # type: ignore[arg-type]
    assert await reader.workers() == WorkerLoad({"agg": 1}, waiting=7, kv_usage=pytest.approx(40 / 160), busy={"w1": 4, "w2": 0})
    silent = MeshReader(["http://127.0.0.1:1"], MemoryDiscovery(store), router=FakeRouter(None))  # type: ignore[arg-type]
    assert await silent.workers() == WorkerLoad({"agg": 1})
    empty = MeshReader(["http://127.0.0.1:1"], MemoryDiscovery(store), router=FakeRouter([]))  # type: ignore[arg-type]
    assert await empty.workers() == WorkerLoad({"agg": 1}, waiting=0, kv_usage=None)  # no blocks known: no KV use
