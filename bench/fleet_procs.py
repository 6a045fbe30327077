"""bench/fleet.py's processes: nats-server with its monitoring port, the router replicas, and the probes that
wait on them (readiness is observed, never slept for)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshllm.plane.request.channels import ChannelCache
from meshllm.router.client import RouterClient
from meshllm.testing.mesh import metric, scrape
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer, free_port
from meshllm.testing.waiting import wait_until

MODEL = "fleet"
LAG_WINDOW = 500_000  # block-events a replica may lag before the publisher waits


class MonitoredNats(NatsServer):
    """nats-server with its monitoring port on: `subscriptions()` tells when the routers have subscribed again."""

    def __init__(self) -> None:
        super().__init__()
        self.monitor_port = free_port()

    def _config(self) -> str:
        path = Path(super()._config())
        conf = json.loads(path.read_text())
        conf["http_port"] = self.monitor_port
        path.write_text(json.dumps(conf))
        return str(path)

    async def subscriptions(self) -> int:
        body = await scrape("127.0.0.1", self.monitor_port, "/subsz")
        try:
            return int(json.loads(body)["num_subscriptions"])
        except (ValueError, KeyError):
            return -1


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Replica:
    proc: MeshllmProcess
    address: str
    metrics_port: int

    async def value(self, name: str) -> float:
        return metric(await scrape("127.0.0.1", self.metrics_port), name)


async def start_router(etcd: EtcdServer, nats: NatsServer, rid: str) -> Replica:
    mport = free_port()
    proc = MeshllmProcess(
        "router", "--port", "0", "--metrics-port", str(mport), "--router-mode", "kv", "--router-id", rid,
        "--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--nats-url", nats.url,
        "--worker-health-interval", "0",
    )  # fmt: skip
    return Replica(proc, await proc.address(60), mport)


async def until(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.02) -> float:
    """Poll an async predicate until it holds (meshllm.testing's one polling loop); the seconds it took."""
    return await wait_until(predicate, timeout_s=timeout_s, interval_s=poll_s, what=what)


async def _workers_seen(client: RouterClient, n: int) -> bool:
    try:
        return len((await client.list_workers(MODEL)).workers) >= n
    except Exception:
        return False


async def _loads_seen(channels: ChannelCache, rep: Replica, want: dict[str, int]) -> bool:
    workers = (await RouterClient(channels, rep.address).list_workers(MODEL)).workers
    return {w.worker_id: w.active_blocks for w in workers} == want


async def _subscribed(nats: MonitoredNats, n: int) -> bool:
    return await nats.subscriptions() >= n


async def _at_least(rep: Replica, name: str, n: float) -> bool:
    return await rep.value(name) >= n


async def _lag_ok(replicas: Sequence[Replica], offsets: Sequence[float], sent: int) -> bool:
    for rep, off in zip(replicas, offsets, strict=True):
        if sent - (await rep.value("meshllm_router_kv_events_applied_total") - off) > LAG_WINDOW:
            return False
    return True


def _connected(nc: Any) -> Any:
    async def check() -> bool:
        return bool(nc.is_connected)

    return check


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
