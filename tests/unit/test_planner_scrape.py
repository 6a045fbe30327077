"""Every frontend process behind a URL, read over real HTTP (meshllm.planner.scrape): a name that resolves to
several addresses (a headless Service, one record per pod) is read at each of them, and the running sum advances
by each one's own increase as frontends come, go and restart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from planner_frontend import Frontend, MetricsServer, Request

from meshllm.errors import CannotConnect
from meshllm.planner.scrape import FrontendScraper, advance, resolve_addresses
from meshllm.served_counts import Counts, delta_buckets

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pods() -> Iterator[list[MetricsServer]]:
    """Frontend 'pods': real HTTP servers on 127.0.0.1, .2 and .3, all on one port, as pods behind one name."""
    first = MetricsServer(Frontend(), host="127.0.0.1")
    made = [first] + [MetricsServer(Frontend(), host=f"127.0.0.{i}", port=first.port) for i in (2, 3)]
    yield made
    for s in made:
        s.close()


class Dns:
    """A resolver whose answer for the pods' name the test changes, as pods become ready or go."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if host != "frontend-pods":
            raise OSError(-2, "Name or service not known")
        return list(self.addresses)


def serve(pod: MetricsServer, n: int, osl: int = 10) -> None:
    for _ in range(n):
        pod.fe.serve(Request(isl=100, osl=osl))


async def test_every_address_of_a_name_is_read_at_every_reading(pods: list[MetricsServer]) -> None:
    one, two, three = pods
    serve(one, 3)
    serve(two, 5)
    dns = Dns("127.0.0.1", "127.0.0.2")
    async with FrontendScraper([f"http://frontend-pods:{one.port}"], resolve=dns) as scraper:
        first = await scraper.counts(0.0)
        assert first.requests == 8  # both pods, not the one a plain Service would pick
        serve(one, 1)
        serve(two, 2)
        dns.addresses.append("127.0.0.3")  # a pod became ready; it served 4 since it started
        serve(three, 4)
        second = await scraper.counts(10.0)
        assert second.requests - first.requests == 1 + 2 + 4
        dns.addresses.remove("127.0.0.1")  # a pod went: what it counted stays counted, no drop
        serve(two, 1)
        third = await scraper.counts(20.0)
        assert third.requests - second.requests == 1
        assert len(dns.asked) == 3  # resolved again at every reading
        tokens = delta_buckets(third, second, "itl")
        assert tokens[float("inf")] == 9  # one request of 10 tokens: 9 gaps


async def test_a_pod_missing_from_one_answer_adds_only_its_increase_when_back(pods: list[MetricsServer]) -> None:
    one, two, _ = pods
    serve(one, 3)
    serve(two, 5)
    dns = Dns("127.0.0.1", "127.0.0.2")
    async with FrontendScraper([f"http://frontend-pods:{one.port}"], resolve=dns) as scraper:
        first = await scraper.counts(0.0)
        dns.addresses.remove("127.0.0.2")  # failed its readiness probe for a moment
        second = await scraper.counts(10.0)
        dns.addresses.append("127.0.0.2")
        serve(two, 2)
        third = await scraper.counts(20.0)
    assert second.requests == first.requests == 8
    assert third.requests - second.requests == 2  # not its 7 since it started


async def test_a_restarted_frontend_counts_from_zero(pods: list[MetricsServer]) -> None:
    one = pods[0]
    serve(one, 6)
    async with FrontendScraper([one.url]) as scraper:
        before = await scraper.counts(0.0)
        one.fe = Frontend()  # the process restarted: its counters start again
        serve(one, 2)
        after = await scraper.counts(10.0)
    assert after.requests - before.requests == 2
    assert all(n >= before.buckets["ttft"].get(le, 0.0) for le, n in after.buckets["ttft"].items())


async def test_a_name_that_does_not_resolve_fails_the_reading_with_the_name() -> None:
    async with FrontendScraper(["http://nowhere:8000"], resolve=Dns()) as scraper:
        with pytest.raises(CannotConnect, match="cannot resolve frontend host 'nowhere'"):
            await scraper.counts(0.0)


async def test_one_pod_not_answering_fails_the_reading_and_names_the_pod(pods: list[MetricsServer]) -> None:
    one, two, _ = pods
    two.fail = True
    dns = Dns("127.0.0.1", "127.0.0.2")
    async with FrontendScraper([f"http://frontend-pods:{one.port}"], resolve=dns) as scraper:
        with pytest.raises(CannotConnect, match=r"http://127\.0\.0\.2:\d+/metrics \(frontend-pods\) answered HTTP 503"):
            await scraper.counts(0.0)


async def test_the_system_resolver_answers_each_address_once() -> None:
    assert await resolve_addresses("127.0.0.1", 80) == ["127.0.0.1"]
    assert "127.0.0.1" in await resolve_addresses("localhost", 80)


def test_advance_adds_increases_and_restarts_from_zero() -> None:
    total = Counts(0.0, requests=10.0, buckets={"ttft": {1.0: 4.0, float("inf"): 10.0}})
    old = Counts(0.0, requests=7.0, buckets={"ttft": {1.0: 3.0, float("inf"): 7.0}})
    advance(total, Counts(1.0, requests=9.0, buckets={"ttft": {1.0: 3.0, float("inf"): 9.0}}), old)
    assert total.requests == 12.0 and total.buckets["ttft"] == {1.0: 4.0, float("inf"): 12.0}
    advance(total, Counts(2.0, requests=1.0, buckets={"ttft": {1.0: 1.0, float("inf"): 1.0}}), old)  # reset
    assert total.requests == 13.0 and total.buckets["ttft"] == {1.0: 5.0, float("inf"): 13.0}
    advance(total, Counts(3.0, requests=2.0, input_tokens=5.0), None)  # first seen: all of it
    assert (total.requests, total.input_tokens) == (15.0, 5.0)
