"""The planner scales a real mesh up and down under load through the local connector, and breaks no stream.

Real etcd and NATS, a real `meshllm frontend` (embedded KV router), and `meshllm worker` mocker processes that
the planner itself starts and drains. The profile is written for the test (one worker takes 600 output tok/s at
the ITL target), so the load below needs more than one worker and the idle mesh needs one. Workers drain with
`--drain-timeout 1`, shorter than the long streams in flight when they go: those streams are stopped at the
deadline and migrated by the router, and must still finish whole.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from meshllm.planner.config import ConnectorKind, PlanMode, PlannerConfig, RoleBounds
from meshllm.planner.local import LocalConnector
from meshllm.planner.main import PlannerProcess
from meshllm.planner.profile import DecodePoint, PrefillPoint, Profile
from meshllm.testing.mesh import MOCKER, Completion, ProcessMesh, metric, scrape, stream_completion
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


def _profile(path: Path) -> Path:
    Profile(
        "mocker",
        prefill=(PrefillPoint(16, 0.01, 1600.0), PrefillPoint(1024, 0.2, 5120.0)),
        decode=(DecodePoint(256, 1, 0.006, 150.0), DecodePoint(256, 4, 0.007, 600.0), DecodePoint(256, 16, 0.2, 700.0)),
    ).save(path)
    return path


async def _users(url: str, n: int, max_tokens: int, results: list[Completion], stop: asyncio.Event) -> None:
    """`n` users, each sending one streamed completion after another until `stop`."""

    async def user(i: int) -> None:
        k = 0
        while not stop.is_set():
            body = {"model": "mocker", "prompt": f"user {i} request {k} " * 8, "max_tokens": max_tokens, "ignore_eos": True}
            results.append(await stream_completion(url, body, timeout_s=120))
            k += 1

    await asyncio.gather(*(user(i) for i in range(n)))


async def test_local_connector_scales_a_mesh_up_and_down_under_load_without_breaking_a_stream(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path: Path
) -> None:
    async with ProcessMesh(etcd_server.endpoint, nats_server.url) as mesh:
        _, url = await mesh.frontend()
        host_port = url.split("//", 1)[1]
        host, port = host_port.rsplit(":", 1)
        worker_flags = (*MOCKER, "--port", "0", "--grace-period", "0", "--drain-timeout", "1",
                        "--max-num-seqs", "4", *mesh.plane_flags())  # fmt: skip
        config = PlannerConfig(
            ttft_s=2.0, itl_s=0.05, mode=PlanMode.AGGREGATED, bounds={"agg": RoleBounds(1, 3)}, interval_s=1.0,
            predictor="constant", profile=_profile(tmp_path / "profile.json"), frontend_url=(url,),
            down_intervals=2, up_cooldown_s=0.0, down_cooldown_s=2.0, connector=ConnectorKind.LOCAL,
            worker_flags=worker_flags, worker_log_dir=tmp_path / "workers", stop_workers_on_exit=True,
            etcd_endpoints=(etcd_server.endpoint,), leader_ttl_s=2.0, planner_id="planner-test",
        )  # fmt: skip
        results: list[Completion] = []
        async with await PlannerProcess.start(config) as planner:
            connector = planner.planner.connector
            assert isinstance(connector, LocalConnector)

            async def agg() -> int:
                return (await connector.replicas())["agg"]

            await wait_until(lambda: _at(agg, 1), timeout_s=60, what="the planner to start its minimum of one worker")
            await wait_until(lambda: _serving(host, int(port), 1), timeout_s=60, what="the first worker to serve")
            await wait_until(lambda: _listed(host, int(port)), timeout_s=60, what="the frontend to serve the model")

            busy, quiet = asyncio.Event(), asyncio.Event()
            heavy = asyncio.create_task(_users(url, 8, 48, results, busy))
            light = asyncio.create_task(_users(url, 2, 400, results, quiet))  # long streams through the scale-down
            try:
                await wait_until(lambda: _at_least(agg, 2), timeout_s=90, what="a scale-up under load")
                peak = await agg()
                busy.set()
                await heavy
                await wait_until(lambda: _at(agg, 1), timeout_s=90, what="a scale-down once the load fell")
                await wait_until(lambda: connector.draining() == 0, timeout_s=60, what="the drained workers to exit")
            finally:
                busy.set()
                quiet.set()
                for task in (heavy, light):
                    with contextlib.suppress(Exception):
                        await task
            decisions = list(planner.planner.metrics.recent)

        broken = [r for r in results if not r.ok]
        assert not broken, f"{len(broken)} of {len(results)} streams broke: {[(r.status, r.error) for r in broken[:3]]}"
        assert peak >= 2
        assert any(d["direction"] == "up" for d in decisions) and any(d["direction"] == "down" for d in decisions)
        migrated = metric(await scrape(host, int(port)), "meshllm_router_migrations_total")
        assert sum(1 for r in results if (r.usage or {}).get("completion_tokens") == 400) >= 2  # the long ones ran on
        print(f"\nplanner test: peak {peak} workers, {len(results)} streams, {migrated:g} migrated, 0 broken")


async def _at(count: object, n: int) -> bool:
    return await count() == n  # type: ignore[operator]


async def _at_least(count: object, n: int) -> bool:
    return await count() >= n  # type: ignore[operator]


async def _listed(host: str, port: int) -> bool:
    return b'"mocker"' in (await scrape(host, port, "/v1/models")).encode()


async def _serving(host: str, port: int, n: int) -> bool:
    return metric(await scrape(host, port), "meshllm_router_workers") >= n
