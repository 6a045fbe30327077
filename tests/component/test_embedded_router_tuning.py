"""The routing core a frontend or `meshllm run` embeds: it takes the router's tuning flags, and serves its metrics.

Locks: `meshllm run` and `meshllm frontend` parse the same nine flags as `meshllm router`, from flags and from
`MESHLLM_*` variables; a bad value stops the command with the router's own one-line error; and the core a
started frontend embeds runs with them (its RouterConfig holds them, and its migration limit follows).
"""

from __future__ import annotations

import pytest
from frontend_support import PLANE

from meshllm.config import ConfigError, ServerConfig
from meshllm.frontend.config import FrontendConfig, frontend_arg_parser
from meshllm.frontend.main import Frontend
from meshllm.plane.discovery.base import MemoryStore
from meshllm.plane.events.base import MemoryBroker
from meshllm.router.config import RouterConfig, RoutingTuning, router_arg_parser
from meshllm.run import parse_run_args
from meshllm.testing.mesh import scrape

FLAGS = [
    "--router-temperature", "0.5", "--kv-overlap-weight", "2", "--kv-capacity-weight", "0", "--kv-wait-weight", "0.25",
    "--router-ttl", "30", "--migration-limit", "5", "--disagg-min-prompt-tokens", "64",
    "--disagg-max-local-hit", "0.5", "--kv-pull-gbps", "10",
]  # fmt: skip
TUNED = RoutingTuning(
    temperature=0.5, overlap_weight=2.0, capacity_weight=0.0, wait_weight=0.25, ttl_s=30.0, migration_limit=5,
    disagg_min_prompt_tokens=64, disagg_max_local_hit=0.5, kv_pull_gbps=10.0,
)  # fmt: skip


def test_run_frontend_and_router_parse_the_same_tuning() -> None:
    assert parse_run_args(FLAGS).frontend.routing == TUNED
    assert parse_run_args(FLAGS).frontend_config().routing == TUNED
    assert FrontendConfig.from_namespace(frontend_arg_parser(env={}).parse_args(FLAGS)).routing == TUNED
    assert RouterConfig.from_namespace(router_arg_parser(env={}).parse_args(FLAGS)).tuning == TUNED
    assert parse_run_args([]).frontend.routing == RoutingTuning()


def test_the_variables_set_the_embedded_cores_tuning_too() -> None:
    ns = frontend_arg_parser(env={"MESHLLM_MIGRATION_LIMIT": "7", "MESHLLM_KV_WAIT_WEIGHT": "0"}).parse_args([])
    tuning = FrontendConfig.from_namespace(ns).routing
    assert (tuning.migration_limit, tuning.wait_weight) == (7, 0.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-overlap-weight", "-1"], "--kv-overlap-weight must be a finite number >= 0, got -1.0"),
        (["--migration-limit", "-2"], "--migration-limit must be >= 0, got -2"),
        (["--disagg-max-local-hit", "1.5"], "--disagg-max-local-hit must be a fraction in [0, 1], got 1.5"),
    ],
)
def test_a_bad_tuning_value_is_the_routers_one_line_error_on_run(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_run_args(flags)
    assert str(err.value) == message


async def test_a_started_frontends_embedded_core_runs_with_the_tuning() -> None:
    config = FrontendConfig(plane=PLANE, http_port=0, grpc=ServerConfig(port=0), routing=TUNED)
    fe = await Frontend.start(config, memory_store=MemoryStore(), memory_broker=MemoryBroker())
    try:
        assert fe.router is not None
        assert fe.router.config.tuning == TUNED
        assert fe.router.migration_limit("any-model") == 5  # no card: the flag's limit
    finally:
        await fe.aclose()


async def test_a_started_frontends_metrics_hold_its_embedded_cores_router_metrics() -> None:
    config = FrontendConfig(plane=PLANE, http_port=0, grpc=ServerConfig(port=0))
    fe = await Frontend.start(config, memory_store=MemoryStore(), memory_broker=MemoryBroker())
    try:
        assert fe.router is not None and fe.http is not None
        text = await scrape("127.0.0.1", fe.http.port)
        assert f'meshllm_router_workers{{router_id="{fe.router.id}"}} 0.0' in text, text[:2000]
        assert "# TYPE meshllm_router_decisions_total counter" in text
        assert text.count("# TYPE meshllm_router_workers gauge") == 1
    finally:
        await fe.aclose()
