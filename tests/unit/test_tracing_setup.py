"""Tracing configuration (issue 16): the console exporter's switches, role names, and which gRPC calls are traced."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from meshllm.run import run_arg_parser
from meshllm.tracing import CONSOLE, _rpc_filter, worker_service_name


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({}, [], ""),
        ({"OTEL_TRACES_EXPORTER": "console"}, [], CONSOLE),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, [], ""),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "jaeger:4317", "OTEL_TRACES_EXPORTER": "console"}, [], "jaeger:4317"),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["--otlp-endpoint", "collector:4317"], "collector:4317"),
        ({}, ["--otlp-endpoint", "console"], CONSOLE),
    ],
)
def test_otlp_endpoint_defaults_to_console_when_otel_traces_exporter_says_so(
    env: dict[str, str], argv: list[str], expected: str
) -> None:
    """Locks: an explicit endpoint (flag, then OTEL_EXPORTER_OTLP_ENDPOINT) wins over OTEL_TRACES_EXPORTER=console."""
    assert run_arg_parser(env=env).parse_args(argv).otlp_endpoint == expected


def test_each_worker_role_has_its_own_service_name() -> None:
    names = [worker_service_name(r) for r in ("agg", "prefill", "decode")]
    assert names == ["meshllm-worker", "meshllm-worker-prefill", "meshllm-worker-decode"]


@dataclass
class Call:
    """What gRPC hands an interceptor (the filters read `.method`)."""

    method: str


@pytest.mark.parametrize(
    ("method", "traced"),
    [
        ("/meshllm.v1.Worker/Generate", True),
        ("/meshllm.v1.Router/Generate", True),
        ("/meshllm.v1.Inference/ChatCompletion", True),
        ("/meshllm.v1.Worker/PullKv", True),
        ("/meshllm.v1.Worker/Drain", True),
        ("/etcdserverpb.KV/Put", False),
        ("/etcdserverpb.Lease/LeaseGrant", False),
        ("/etcdserverpb.Lease/LeaseKeepAlive", False),
        ("/etcdserverpb.Watch/Watch", False),
        ("/grpc.health.v1.Health/Check", False),
        ("/meshllm.v1.Worker/GetInfo", False),
        ("/meshllm.v1.Worker/GetKvSnapshot", False),
        ("/meshllm.v1.Worker/GenerateSession", False),
    ],
)
def test_plane_and_control_calls_are_not_instrumented(method: str, traced: bool) -> None:
    """Locks: discovery (etcd), health and mesh-learning calls never start a trace; requests and operator calls do."""
    assert _rpc_filter()(Call(method)) is traced
