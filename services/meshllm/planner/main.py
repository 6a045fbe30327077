"""`meshllm planner`: wiring (etcd, the frontends' metrics, the connector, the profile) and the ordered shutdown.

    meshllm planner --ttft-ms 500 --itl-ms 50 --profile profile.json --frontend-url http://127.0.0.1:8000 \\
        --connector local --worker-flags "--engine mocker --etcd-endpoints 127.0.0.1:2379"
    meshllm planner profile --engine mocker --out profile.json        # measure the profile first

Start: flags → profile → etcd → metrics server → connector → campaign (standby until it leads) → one step per
interval. Stop (SIGTERM/SIGINT): resign (a standby takes over within one poll) → the connector (local: its
workers keep serving for the next planner unless --stop-workers-on-exit) → the readers → etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from meshllm import logs
from meshllm.config import ConfigError
from meshllm.errors import MeshError
from meshllm.lifecycle import AsyncCloseable, command_error, install_signal_handlers, run_command
from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.plane.request.channels import ChannelCache
from meshllm.planner.config import ConnectorKind, PlannerConfig, planner_arg_parser
from meshllm.planner.leader import EtcdLeadership
from meshllm.planner.local import LocalConnector
from meshllm.planner.metrics import PlannerMetrics
from meshllm.planner.model import Connector
from meshllm.planner.observe import MeshReader
from meshllm.planner.profile import Profile
from meshllm.planner.service import Planner
from meshllm.ports import check_free_all
from meshllm.router.client import RouterClient

__all__ = ["PlannerProcess", "main"]

log = logging.getLogger(__name__)


def make_connector(config: PlannerConfig) -> Connector:
    if config.connector is ConnectorKind.LOCAL:
        return LocalConnector(config.worker_flags, log_dir=config.worker_log_dir, stop_on_close=config.stop_workers_on_exit)
    from meshllm.planner.kubernetes import KubernetesConnector

    return KubernetesConnector(
        namespace=config.kube_namespace,
        deployments={r: config.kube_deployments[r] for r in config.mode.roles},
        kube_config=config.kube_config,
    )


class PlannerProcess(AsyncCloseable):
    """The planner and what it holds open, closed in order."""

    def __init__(self, planner: Planner, etcd: EtcdDiscovery, channels: ChannelCache, metrics_server: Any) -> None:
        self.planner = planner
        self._etcd = etcd
        self._channels = channels
        self._metrics_server = metrics_server
        self.task: asyncio.Task[None] = asyncio.create_task(planner.run(), name="planner")

    @classmethod
    async def start(cls, config: PlannerConfig) -> PlannerProcess:
        profile = Profile.load(config.profile)
        check_free_all([(config.host, config.metrics_port, "--metrics-port")])
        etcd = await EtcdDiscovery.connect(config.etcd_endpoints, config.namespace, credentials=config.etcd_credentials)
        channels = ChannelCache(security=config.security)
        server = None
        try:
            router = RouterClient(channels, config.router_address) if config.router_address else None
            reader = MeshReader(config.frontend_url, etcd, api_key=config.frontend_api_key, router=router)
            metrics = PlannerMetrics(config.planner_id)
            if config.metrics_port is not None:
                from prometheus_client import start_http_server

                server, _ = start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
            leadership = EtcdLeadership(etcd, config.planner_id, ttl_s=config.leader_ttl_s)
            planner = Planner(config, reader=reader, connector=make_connector(config), profile=profile,
                              leadership=leadership, metrics=metrics)  # fmt: skip
        except BaseException:
            await channels.aclose()
            await etcd.aclose()
            if server is not None:
                server.shutdown()
            raise
        return cls(planner, etcd, channels, server)

    async def _aclose(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task
        await self.planner.aclose()
        await self._channels.aclose()
        await self._etcd.aclose()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()


async def serve(config: PlannerConfig) -> int:
    stop = asyncio.Event()
    uninstall = install_signal_handlers(lambda _sig: stop.set())
    try:
        try:
            process = await PlannerProcess.start(config)
        except MeshError as exc:
            return command_error("planner", exc.message, 2 if isinstance(exc, ConfigError) else 1)
        async with process:
            print(f"meshllm planner {config.planner_id}: {config.connector.value} connector, roles "
                  f"{', '.join(config.mode.roles)}, every {config.interval_s:g} s", flush=True)  # fmt: skip
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([stopping, process.task], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if process.task.done() and not process.task.cancelled() and process.task.exception() is not None:
                failed = process.task.exception()
                message = failed.message if isinstance(failed, MeshError) else f"{type(failed).__name__}: {failed}"
                return command_error("planner", message, 2 if isinstance(failed, ConfigError) else 1)
        return 0
    finally:
        uninstall()


def main(argv: Sequence[str]) -> int:
    """`meshllm planner [flags]`, or `meshllm planner profile [flags] [-- engine flags]`."""
    args = list(argv)
    if args[:1] == ["profile"]:
        from meshllm.planner.profiler import main as profile_main

        return profile_main(args[1:])
    logs.setup_logging()
    ns = planner_arg_parser().parse_args(args)
    return run_command("planner", lambda: PlannerConfig.from_namespace(ns), serve)
