"""bench/fleet.py's whole run, small: 256 simulated workers, real etcd and nats-server, two real `meshllm router`s.

Asserts what does not depend on the machine's speed: both replicas index
exactly the blocks the workers published (no gap during the fill), choose
the same worker for every prompt, and choose what the in-process RouterCore
on the same events chooses, which itself chooses what the exhaustive scorer
does; after a NATS outage with lost events, every worker is resynced to its
exact cache. The timings it prints are not asserted (bench/fleet.py's job).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from bench_support import load_bench

fleet = load_bench("fleet")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not Path(fleet.TRACE).exists(), reason=f"the Mooncake trace is not at {fleet.TRACE}"),
]


async def test_fleet_of_256_through_nats_two_router_processes_agree() -> None:
    args = argparse.Namespace(
        workers=256,
        blocks=64,
        decisions=80,
        exhaustive=40,
        trace=str(fleet.TRACE),
        seed=1,
        dynamo=False,
        exact_lag=True,
        reuse=True,
        in_process_only=False,
    )
    r = await fleet.run(args)
    print({k: r[k] for k in ("decision_ms", "route_rpc_ms", "events_per_s", "resync_all_s")})
    assert r["pairs"] == 256 * 64 and r["resyncs_during_fill"] == [0.0, 0.0]
    assert r["exhaustive_agreement"] == 1.0 and r["reused"]["exhaustive_agreement"] == 1.0
    assert r["router_matches_in_process"] == 1.0
    assert r["replica_agreement"] == 1.0 and r["replica_same_index"]
    assert r["resynced_exact"]
