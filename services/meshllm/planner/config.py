"""`meshllm planner`'s flags and its typed configuration (`PlannerConfig`), validated when built."""

from __future__ import annotations

import argparse
import enum
import os
import shlex
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshllm.config import ConfigError, EnvArgumentParser, doc_default, from_flags, parse_host_port
from meshllm.credentials import EtcdCredentials, add_etcd_args
from meshllm.plane.auth import MeshSecurity, add_security_args

__all__ = ["ConnectorKind", "PlannerConfig", "RoleBounds", "planner_arg_parser"]

PREDICTOR_CHOICES = ("constant", "moving-average", "holt-winters")


class ConnectorKind(enum.StrEnum):
    LOCAL = "local"
    KUBERNETES = "kubernetes"


class PlanMode(enum.StrEnum):
    DISAGGREGATED = "disagg"  # prefill and decode pools
    AGGREGATED = "agg"  # one pool of aggregated workers

    @property
    def roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self is PlanMode.DISAGGREGATED else ("agg",)


@dataclass(frozen=True, slots=True)
class RoleBounds:
    low: int
    high: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannerConfig:
    """Everything `meshllm planner` needs."""

    ttft_s: float = 0.5  # p90 targets
    itl_s: float = 0.05
    mode: PlanMode = PlanMode.DISAGGREGATED
    bounds: Mapping[str, RoleBounds] = field(default_factory=dict)
    interval_s: float = 30.0
    predictor: str = "moving-average"
    predictor_window: int = 4
    season: int = 0
    profile: Path = Path("planner-profile.json")
    frontend_url: tuple[str, ...] = ("http://127.0.0.1:8000",)
    frontend_api_key: str | None = None
    router_address: str | None = None
    down_intervals: int = 2
    up_cooldown_s: float = 0.0
    down_cooldown_s: float = 60.0
    max_step_down: int = 0  # 0: down to what the need asks for at once
    dry_run: bool = False
    connector: ConnectorKind = ConnectorKind.LOCAL
    worker_flags: tuple[str, ...] = ()
    worker_log_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "meshllm-planner")
    stop_workers_on_exit: bool = False
    kube_config: str = "auto"
    kube_namespace: str = "meshllm"
    kube_deployments: Mapping[str, str] = field(default_factory=dict)
    namespace: str = "meshllm"
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    etcd_credentials: EtcdCredentials = field(default_factory=EtcdCredentials)
    leader_ttl_s: float = 10.0
    planner_id: str = field(default_factory=lambda: f"planner-{uuid.uuid4().hex[:12]}")
    host: str = "127.0.0.1"
    metrics_port: int | None = None
    security: MeshSecurity = field(default_factory=MeshSecurity)  # the calls to --router-address

    def __post_init__(self) -> None:
        if not (0 < self.ttft_s <= 600 and 0 < self.itl_s <= 60):
            raise ConfigError(f"--ttft-ms and --itl-ms must be positive (got {self.ttft_s * 1e3:g} and {self.itl_s * 1e3:g})")
        if not 1 <= self.interval_s <= 3600:
            raise ConfigError(f"--interval-s must be between 1 and 3600 seconds, got {self.interval_s:g}")
        if self.predictor not in PREDICTOR_CHOICES:
            raise ConfigError(f"--predictor {self.predictor!r}: choose from {', '.join(PREDICTOR_CHOICES)}")
        if self.predictor_window < 1 or self.season < 0 or self.down_intervals < 1 or self.max_step_down < 0:
            raise ConfigError(
                "--predictor-window and --down-intervals must be at least 1, --season and --max-step-down at least 0"
            )
        if self.up_cooldown_s < 0 or self.down_cooldown_s < 0:
            raise ConfigError("--up-cooldown-s and --down-cooldown-s must not be negative")
        for role in self.mode.roles:
            b = self.bounds.get(role)
            if b is None or not 0 <= b.low <= b.high:
                raise ConfigError(f"--min-{role} and --max-{role} must satisfy 0 <= min <= max")
        if self.router_address:
            parse_host_port(self.router_address, what="--router-address")
        if not self.frontend_url:
            raise ConfigError("--frontend-url: the planner reads load and latency from at least one frontend")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port {self.metrics_port} is out of range 0..65535")
        if not self.namespace or not all(c.isalnum() or c in "-_" for c in self.namespace):
            raise ConfigError(f"--namespace {self.namespace!r} must be letters, digits, '-' or '_'")
        if self.leader_ttl_s < 2:
            raise ConfigError(f"--leader-ttl must be at least 2 seconds, got {self.leader_ttl_s:g}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> PlannerConfig:
        mode = PlanMode(ns.mode)
        bounds = {r: RoleBounds(getattr(ns, f"min_{r}"), getattr(ns, f"max_{r}")) for r in ("prefill", "decode", "agg")}
        try:
            worker_flags = tuple(shlex.split(ns.worker_flags or ""))
        except ValueError as exc:
            raise ConfigError(f"--worker-flags does not parse as shell words: {exc}") from None
        deployments = {"prefill": ns.kube_deployment_prefill, "decode": ns.kube_deployment_decode,
                       "agg": ns.kube_deployment_agg}  # fmt: skip
        return from_flags(
            cls, ns, ttft_s=ns.ttft_ms / 1e3, itl_s=ns.itl_ms / 1e3, mode=mode, bounds=bounds,
            profile=Path(ns.profile), frontend_url=_split(ns.frontend_url), frontend_api_key=ns.frontend_api_key or None,
            router_address=ns.router_address or None, connector=ConnectorKind(ns.connector), worker_flags=worker_flags,
            worker_log_dir=Path(ns.worker_log_dir or Path(tempfile.gettempdir()) / "meshllm-planner"),
            kube_deployments=deployments, etcd_endpoints=_split(ns.etcd_endpoints),
            etcd_credentials=EtcdCredentials.from_namespace(ns),
            planner_id=ns.planner_id or f"planner-{uuid.uuid4().hex[:12]}", security=MeshSecurity.from_namespace(ns),
        )  # fmt: skip


def _split(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def planner_arg_parser(*, env: Mapping[str, str] | None = None) -> EnvArgumentParser:
    """Every `meshllm planner` flag (defaults from `MESHLLM_*`, `os.environ` unless `env` is given)."""
    parser = EnvArgumentParser(
        prog="meshllm planner",
        env=os.environ if env is None else env,
        description="SLA planner: scales prefill and decode workers to TTFT and ITL targets (docs/planner.md)",
    )
    _target_args(parser.add_argument_group("targets"))
    _planning_args(parser.add_argument_group("planning"))
    _connector_args(parser)
    g = parser.add_argument_group("leader election and state")
    g.add_argument("--namespace", default="meshllm", help="deployment namespace in etcd (letters, digits, `-`, `_`)")
    g.add_argument("--etcd-endpoints", default="127.0.0.1:2379", help="comma-separated etcd `host:port` list")
    g.add_argument("--leader-ttl", type=float, default=10.0, help="leader lease TTL, seconds: a standby takes over within it")
    doc_default(g.add_argument("--planner-id", default="", help="this planner's identity in the election"), "random")
    g.add_argument("--host", default="127.0.0.1", help="metrics listen host")
    doc_default(g.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics HTTP port"), "off")
    add_etcd_args(parser.add_argument_group("etcd TLS and authentication"))
    add_security_args(
        parser, tls="TLS on the calls to --router-address", tls_ca="the router is verified against it",
        mesh_token="shared secret of the mesh, sent to the router",
    )  # fmt: skip
    return parser


def _target_args(g: Any) -> None:
    g.add_argument("--ttft-ms", type=float, default=500.0, help="time-to-first-token target, p90, milliseconds")
    g.add_argument("--itl-ms", type=float, default=50.0, help="inter-token latency target, p90, milliseconds")
    g.add_argument("--mode", choices=[m.value for m in PlanMode], default="disagg",
                   help="`disagg`: scale prefill and decode workers; `agg`: one pool of aggregated workers")  # fmt: skip
    for role, high in (("prefill", 4), ("decode", 8), ("agg", 8)):
        g.add_argument(f"--min-{role}", type=int, default=1, help=f"fewest {role} workers")
        g.add_argument(f"--max-{role}", type=int, default=high, help=f"most {role} workers")


def _planning_args(g: Any) -> None:
    g.add_argument("--interval-s", type=float, default=30.0, help="seconds between two decisions (one observed interval)")
    g.add_argument("--predictor", choices=PREDICTOR_CHOICES, default="moving-average",
                   help="next interval's load: `constant`, `moving-average`, `holt-winters` (statsmodels)")  # fmt: skip
    g.add_argument("--predictor-window", type=int, default=4, help="intervals the moving average spans")
    g.add_argument("--season", type=int, default=0, help="holt-winters: intervals per season (0 = trend only)")
    g.add_argument("--profile", default="planner-profile.json", help="the engine's profile (`meshllm planner profile`)")
    g.add_argument("--down-intervals", type=int, default=2, help="intervals a role must need fewer workers before one goes")
    g.add_argument("--up-cooldown-s", type=float, default=0.0, help="seconds after a change of a role before it grows again")
    g.add_argument("--down-cooldown-s", type=float, default=60.0, help="seconds after a change of a role before it shrinks")
    g.add_argument("--max-step-down", type=int, default=0, help="most workers of a role drained at once (0 = no limit)")
    g.add_argument("--dry-run", action="store_true", help="observe and decide, but change nothing")


def _connector_args(parser: EnvArgumentParser) -> None:
    g = parser.add_argument_group("observing")
    g.add_argument("--frontend-url", default="http://127.0.0.1:8000", help="frontend URLs (comma-separated) to read")
    g.add_argument("--frontend-api-key", default="", help="API key for the frontends' /metrics (unless --open-metrics)")
    g.add_argument("--router-address", default="", help="a router's `host:port`: queue depth and KV use (ListWorkers)")
    g = parser.add_argument_group("connector")
    g.add_argument("--connector", choices=[k.value for k in ConnectorKind], default="local",
                   help="`local`: `meshllm worker` processes here; `kubernetes`: the worker Deployments' replicas")  # fmt: skip
    g.add_argument("--worker-flags", default="", help="local: the template worker's flags, e.g. `--engine mocker`")
    log_dir = g.add_argument("--worker-log-dir", default="", help="local: where each worker's output goes")
    doc_default(log_dir, "$TMPDIR/meshllm-planner")
    g.add_argument("--stop-workers-on-exit", action="store_true", help="local: drain the workers when the planner stops")
    g.add_argument("--kube-config", choices=("auto", "incluster", "kubeconfig"), default="auto",
                   help="kubernetes: in-cluster service account, a kubeconfig, or whichever is present")  # fmt: skip
    g.add_argument("--kube-namespace", default="meshllm", help="kubernetes: the namespace of the worker Deployments")
    for role, name in (("prefill", "meshllm-prefill"), ("decode", "meshllm-decode"), ("agg", "meshllm-worker")):
        g.add_argument(f"--kube-deployment-{role}", default=name, help=f"kubernetes: the {role} workers' Deployment")
