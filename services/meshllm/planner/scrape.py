"""The frontends' counters, from every frontend process behind each `--frontend-url`.

A URL's host is resolved again at every reading, and every address it
resolves to is read: in Kubernetes the planner reads a headless Service,
one DNS record per ready frontend pod, because the plain Service would send
each scrape to one pod of its choosing and the planner would see a share
of the load. Pods come and go between readings, so the running sum the
planner takes rates from advances by each address's own increase
(`advance`): a new pod adds what it counted since it started, a pod that
went takes nothing away, one that comes back after missing from the answer
adds only what it counted meanwhile, and a restarted one counts from zero,
as PromQL's `rate` treats a counter reset.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client.parser import text_string_to_metric_families

from meshllm.bench.http import Connection, Endpoint, HttpError
from meshllm.errors import CannotConnect
from meshllm.lifecycle import AsyncCloseable
from meshllm.served_counts import Counts, read_counts

__all__ = ["SCRAPE_TIMEOUT_S", "FrontendScraper", "Resolver", "advance", "resolve_addresses"]

SCRAPE_TIMEOUT_S = 5.0
Resolver = Callable[[str, int], Awaitable[list[str]]]  # host, port -> addresses, in the resolver's order
_COUNTERS = ("requests", "failed", "input_tokens", "output_tokens")


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (an address resolves to itself), each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _grown(new: float, old: float | None) -> float:
    return new if old is None or new < old else new - old


def advance(total: Counts, new: Counts, old: Counts | None) -> None:
    """Add to `total` what one frontend counted between its readings `old` and `new` (`old` None: a frontend
    first seen, all of whose counts are new). A counter below its last reading was reset and counts from zero.
    The in-flight gauge is not a counter: the caller sets `total.inflight`."""
    for name in _COUNTERS:
        setattr(total, name, getattr(total, name) + _grown(getattr(new, name), None if old is None else getattr(old, name)))
    for key, buckets in new.buckets.items():
        into = total.buckets.setdefault(key, {})
        before = None if old is None else old.buckets.get(key)
        reset = before is not None and any(n < before.get(le, 0.0) for le, n in buckets.items())
        for le, n in buckets.items():
            into[le] = into.get(le, 0.0) + _grown(n, None if before is None or reset else before.get(le, 0.0))


class FrontendScraper(AsyncCloseable):
    """Reads `/metrics` of every address of every URL at each `counts` call; one keep-alive connection each."""

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, resolve: Resolver = resolve_addresses) -> None:
        if not urls:
            raise ValueError("the planner needs at least one frontend URL (--frontend-url) to read load and latency")
        self._endpoints = [Endpoint.parse(url, api_key) for url in urls]
        self._resolve = resolve
        self._connections: dict[tuple[int, str], Connection] = {}
        self._last: dict[tuple[int, str], Counts] = {}
        self._total: Counts | None = None

    async def counts(self, at: float) -> Counts:
        """The running sum of the frontends' counters now. A frontend that does not answer (or a name that does
        not resolve) fails the reading (CannotConnect): a partial sum would read as a drop in load."""
        targets = await self._targets()
        scrapes = [asyncio.ensure_future(self._scrape(self._connections[t])) for t in targets]
        try:
            texts = await asyncio.gather(*scrapes)
        finally:  # one failed: stop the others now, not in the background while the next reading uses the connections
            for scrape in scrapes:
                scrape.cancel()
            await asyncio.gather(*scrapes, return_exceptions=True)
        readings = {t: read_counts(text_string_to_metric_families(text), at) for t, text in zip(targets, texts, strict=True)}
        total = self._total if self._total is not None else Counts(at)
        for target, new in readings.items():
            advance(total, new, self._last.get(target))
        total.at, total.inflight = at, sum(c.inflight for c in readings.values())
        self._total = total
        self._last.update(readings)  # a frontend missing from one answer (a readiness blip) is not new when back
        return dataclasses.replace(total, buckets={k: dict(v) for k, v in total.buckets.items()})

    async def _targets(self) -> list[tuple[int, str]]:
        targets: list[tuple[int, str]] = []
        for i, ep in enumerate(self._endpoints):
            try:
                addresses = await self._resolve(ep.host, ep.port)
            except OSError as exc:
                raise CannotConnect(f"cannot resolve frontend host {ep.host!r}: {exc.strerror or exc}") from None
            for address in addresses:
                if (i, address) not in self._connections:
                    at = ep if address == ep.host else dataclasses.replace(ep, host=address, server_hostname=ep.host)
                    self._connections[(i, address)] = Connection(at)
                targets.append((i, address))
        for gone in self._connections.keys() - set(targets):
            await self._connections.pop(gone).close()
        return targets

    async def _scrape(self, conn: Connection) -> str:
        ep = conn.endpoint
        where = f"{ep.scheme}://{_hostport(ep.host, ep.port)}/metrics"
        if ep.server_hostname:
            where += f" ({ep.server_hostname})"
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                resp = await conn.get("/metrics")
                body = await resp.read()
        except (HttpError, TimeoutError) as exc:
            await conn.close()
            raise CannotConnect(f"cannot read {where}: {exc or 'timed out'}") from None
        if resp.status != 200:
            hint = " (set --frontend-api-key, or run the frontend with --open-metrics)" if resp.status == 401 else ""
            raise CannotConnect(f"{where} answered HTTP {resp.status}{hint}")
        return body.decode("utf-8", errors="replace")

    async def _aclose(self) -> None:
        await asyncio.gather(*(c.close() for c in self._connections.values()))


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
