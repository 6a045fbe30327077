"""Fleet decisions on the routing matrix's workloads: the same worker as the exhaustive scorer, decision by decision.

The matrix runs 4 workers, below `fleet.FLEET_MIN_SLOTS`; here the router
takes the fleet path at any size (`fleet_min_slots = 0`) and every decision
is made twice on the same state — exhaustively, then through the fleet
tables — while real mocker workers fill, evict and report (events, load
snapshots, measured step and prefill times). The two run back to back with
no await between, so the state is the same and the choice must be too.
"""

from __future__ import annotations

from typing import Any

from test_router_quality import bench

from meshllm.router.core import Decision, RouterCore


def shadowed(agree: list[bool]) -> Any:
    def on_core(core: RouterCore) -> None:
        core.candidates.fleet_min_slots = 0
        decide = core.decide

        def both(*args: Any) -> Decision:
            core.candidates.fleet = False
            ref = decide(*args)
            core.candidates.fleet = True
            got = decide(*args)
            agree.append(ref.chosen.key == got.chosen.key)
            return got

        core.decide = both  # type: ignore[method-assign]

    return on_core


async def test_fleet_path_agrees_with_the_exhaustive_scorer_on_matrix_workloads() -> None:
    routing = bench()
    agree: list[bool] = []
    workload = routing.Workload(groups=6, per_group=12, rate=40.0)
    distinct = [(t, r) for t, _, r in routing.requests(workload)]
    setup = routing.Setup(num_gpu_blocks=160, speedup_ratio=20.0)
    await routing.run_requests("kv", setup, distinct, None, on_core=shadowed(agree))
    docs, _ = routing.docs_requests(48)
    await routing.run_requests(
        "kv", routing.Setup(num_gpu_blocks=150, speedup_ratio=20.0), docs, 8, context_length=1024, on_core=shadowed(agree)
    )
    assert len(agree) >= 72 + 48
    assert all(agree), f"{agree.count(False)} of {len(agree)} decisions differ"
