"""Typed configuration shared by every service (the flag parser that builds it is meshllm.flags).

Each service owns one frozen config dataclass built once, at startup, from its
CLI flags and `MESHLLM_*` environment variables (a flag `--etcd-endpoints`
reads `MESHLLM_ETCD_ENDPOINTS` as its default), validated when built. Nothing
below the entry points reads `os.environ`.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshllm.credentials import EtcdCredentials, NatsCredentials, add_etcd_args, add_nats_args
from meshllm.errors import ConfigError
from meshllm.flags import (
    DefaultsHelpFormatter,
    EnvArgumentParser,
    doc_default,
    env_name,
    flag_value,
    from_flags,
    parse_byte_size,
    terminal_help,
)
from meshllm.logs import redact_url

__all__ = [
    "ConfigError",
    "DefaultsHelpFormatter",
    "DiscoveryKind",
    "EnvArgumentParser",
    "EventsKind",
    "PlaneConfig",
    "ServerConfig",
    "add_coalesce_arg",
    "add_plane_args",
    "add_tracing_args",
    "doc_default",
    "env_name",
    "flag_value",
    "from_flags",
    "parse_byte_size",
    "parse_host_port",
    "scoped_environ",
    "terminal_help",
]


class DiscoveryKind(enum.StrEnum):
    """Where instances and model cards are registered and watched."""

    ETCD = "etcd"
    MEMORY = "memory"
    STATIC = "static"


class EventsKind(enum.StrEnum):
    """Where KV events and load snapshots travel."""

    NATS = "nats"
    MEMORY = "memory"
    NONE = "none"


def parse_host_port(value: str, *, what: str = "address") -> tuple[str, int]:
    """'host:port' -> (host, port), with a one-line error when malformed."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigError(f"{what} {value!r} is not host:port")
    return host.strip("[]"), int(port_s)


# Default least time between two stream messages to one peer (--stream-interval-ms): none. A session's
# writer sends as soon as its previous write has completed, and whatever engines made while that write
# was in flight (or while the reader lagged) goes together in the next message: coalescing by
# backpressure, not by a clock. A cap > 0 also holds later messages of a session for the rest of the
# interval after the previous one (a stream's first chunk never waits).
DEFAULT_STREAM_INTERVAL_MS = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    """Where and how a gRPC server listens."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = ephemeral
    max_message_bytes: int = 64 * 1024 * 1024
    # Optional least time between two messages of one Generate session (plane/request/session.py); 0 = none:
    # messages leave as the previous write completes.
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS
    # Where Generate sessions are also served as frames on TCP (plane/request/tcp_session.py): None = not, 0 = ephemeral.
    session_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port {self.port} is out of range 0..65535")
        if self.session_port is not None and not 0 <= self.session_port < 65536:
            raise ConfigError(f"--session-port {self.session_port} is out of range 0..65535 (-1 = off)")
        if self.max_message_bytes <= 0:
            raise ConfigError("max message size must be positive")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise ConfigError(f"--stream-interval-ms must be in 0..1000, got {self.stream_interval_ms:g}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlaneConfig:
    """Which discovery and event planes a process uses."""

    namespace: str = "meshllm"
    discovery: DiscoveryKind = DiscoveryKind.MEMORY
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    lease_ttl_s: float = 10.0
    events: EventsKind = EventsKind.MEMORY
    nats_url: str = field(default="nats://127.0.0.1:4222", repr=False)  # may hold user:password@
    etcd_credentials: EtcdCredentials = field(default_factory=EtcdCredentials)
    nats_credentials: NatsCredentials = field(default_factory=NatsCredentials)

    def __post_init__(self) -> None:
        if not self.namespace or not all(c.isalnum() or c in "-_" for c in self.namespace):
            raise ConfigError(f"namespace {self.namespace!r} must be letters, digits, '-' or '_'")
        if self.discovery is DiscoveryKind.ETCD:
            if not self.etcd_endpoints:
                raise ConfigError("--etcd-endpoints is empty")
            for ep in self.etcd_endpoints:
                scheme, _, rest = ep.rpartition("://")
                if scheme not in ("", "http", "https"):
                    raise ConfigError(f"etcd endpoint {ep!r}: scheme must be http:// or https://")
                if scheme == "http" and self.etcd_credentials.tls:
                    raise ConfigError(f"etcd endpoint {ep!r} is http:// but --etcd-ca/--etcd-cert ask for TLS")
                parse_host_port(rest, what="etcd endpoint")
        if self.lease_ttl_s < 2:
            raise ConfigError(f"lease TTL {self.lease_ttl_s}s is too short (minimum 2s)")
        if self.events is EventsKind.NATS and not self.nats_url.startswith(("nats://", "tls://")):
            raise ConfigError(f"--nats-url {redact_url(self.nats_url)!r} must start with nats:// or tls://")

    def static(self, *, namespace: str | None = None, events_flag: str | None = None) -> PlaneConfig:
        """This plane in static mode: no etcd, and no NATS unless `--events` (`events_flag`) asked for it."""
        return PlaneConfig(
            namespace=namespace or self.namespace,
            discovery=DiscoveryKind.STATIC,
            events=self.events if events_flag else EventsKind.NONE,
            nats_url=self.nats_url,
            nats_credentials=self.nats_credentials,
        )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> PlaneConfig:
        """Build from the flags added by `add_plane_args`."""
        discovery = DiscoveryKind(ns.discovery)
        events = (
            EventsKind(ns.events)
            if ns.events
            else (
                EventsKind.NATS
                if discovery is DiscoveryKind.ETCD
                else EventsKind.MEMORY
                if discovery is DiscoveryKind.MEMORY
                else EventsKind.NONE
            )
        )
        return from_flags(
            cls, ns, discovery=discovery, etcd_endpoints=_split(ns.etcd_endpoints), events=events,
            etcd_credentials=EtcdCredentials.from_namespace(ns), nats_credentials=NatsCredentials.from_namespace(ns),
        )  # fmt: skip


def _split(value: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(value)


def add_plane_args(parser: EnvArgumentParser, *, default_discovery: DiscoveryKind) -> None:
    """The discovery and event flags every service shares."""
    g = parser.add_argument_group("planes")
    g.add_argument(
        "--namespace",
        default="meshllm",
        help="deployment namespace: isolates meshes sharing one etcd / NATS (letters, digits, `-`, `_`)",
    )
    g.add_argument(
        "--discovery",
        choices=[k.value for k in DiscoveryKind],
        default=default_discovery.value,
        help="`etcd`, `memory` (one process only) or `static` (no discovery; see [Static mode](#static-mode))",
    )
    g.add_argument(
        "--etcd-endpoints",
        default="127.0.0.1:2379",
        help="comma-separated etcd `host:port` list (`https://host:port` turns TLS on)",
    )
    g.add_argument(
        "--lease-ttl",
        type=float,
        default=10.0,
        help="discovery lease TTL, seconds (≥ 2): a process that dies vanishes from discovery within it",
    )
    events = g.add_argument(
        "--events",
        choices=[k.value for k in EventsKind],
        default=None,
        help="`nats`, `memory` or `none`; default `nats` with etcd, `memory` with memory, `none` with static",
    )
    doc_default(events, "by discovery")
    g.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server URL (`nats://` or `tls://`)")
    add_etcd_args(parser.add_argument_group("etcd TLS and authentication"))
    add_nats_args(parser.add_argument_group("NATS TLS and authentication"))


def add_stream_args(group: Any) -> None:
    """The flags of a server of Generate streams (worker, router): pacing, merging and the TCP session port."""
    group.add_argument(
        "--stream-interval-ms",
        type=float,
        default=DEFAULT_STREAM_INTERVAL_MS,
        help=(
            "optional least time between two stream messages to one client. 0 (default): no clock; a message leaves as soon as "
            "the previous write to that client has completed, and what engines made meanwhile goes together in it (coalescing "
            "by backpressure). A cap > 0 holds a session's later messages for the rest of the interval (a stream's first chunk "
            "never waits)"
        ),
    )
    group.add_argument(
        "--session-port",
        type=int,
        default=0,
        help="also serve Generate sessions as length-prefixed frames on this TCP port, registered in discovery as the "
        "process's `session_address`; the routers and frontends that route to it open their sessions there "
        "([sessions on TCP](architecture.md#generate-sessions)): a fraction of gRPC's CPU per message. Same TLS and "
        "mesh token as the gRPC port; 0 = an ephemeral port, -1 = off (sessions on gRPC only). Open the port between "
        "mesh processes as you do the gRPC one (give a fixed port where a firewall lists ports)",
    )
    add_coalesce_arg(group)


def server_config(ns: Any) -> ServerConfig:
    """The ServerConfig of `--host`, `--port` and `add_stream_args`' flags."""
    return ServerConfig(
        host=ns.host,
        port=ns.port,
        stream_interval_ms=ns.stream_interval_ms,
        session_port=None if ns.session_port == -1 else ns.session_port,
    )


def add_coalesce_arg(group: Any) -> None:
    """`--no-coalesce` (env MESHLLM_NO_COALESCE=1), the same on every command (`meshllm.protocol.chunks`)."""
    group.add_argument(
        "--no-coalesce", action="store_true",
        help=(
            "never merge a stream's chunks: every engine step of every stream is its own message and SSE event (for comparisons"
            " at one event per token; costs CPU per token). Set it on every process of a mesh (the variable does that)"
        ),
    )  # fmt: skip


def add_tracing_args(parser: EnvArgumentParser) -> None:
    """`--otlp-endpoint`, defaulting to OpenTelemetry's own `OTEL_EXPORTER_OTLP_ENDPOINT`."""
    endpoint = parser.add_argument(
        "--otlp-endpoint",
        default=parser.env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        or ("console" if parser.env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console" else ""),
        help="OTLP gRPC endpoint for traces, or `console` for one JSON line per span on stderr; empty = tracing off "
        "(default: `$OTEL_EXPORTER_OTLP_ENDPOINT`, else `console` when `$OTEL_TRACES_EXPORTER` is `console`; "
        "[Tracing](#tracing))",
    )
    doc_default(endpoint, "`$OTEL_EXPORTER_OTLP_ENDPOINT`")


@contextlib.contextmanager
def scoped_environ(env: Mapping[str, str]) -> Iterator[None]:
    """`env` in os.environ for the block (for processes started inside it), each variable restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
