"""bench/routing.py's pure parts: the HTTP documents workload and how a partial run updates its section (routing_report)."""

from __future__ import annotations

from bench_support import load_bench as load


def test_http_documents_share_two_blocks_and_end_on_a_block_boundary() -> None:
    http = load("routing_http")
    docs = http.http_docs(40, docs=4, doc_blocks=10, block_size=16, seed=3)
    rendered = [(http.OPEN + c + http.CLOSE).encode() for c in docs.contents]
    assert len({r[:32] for r in rendered}) == 1  # one shared 2-block head: template + instruction
    heads = {r[:160] for r in rendered}
    assert len(heads) == 4  # 4 documents of exactly 10 blocks
    assert len({r[:48] for r in rendered}) == 4  # they differ from the third block on
    first_seen: set[bytes] = set()
    reusable = 0
    for r in rendered:
        reusable += 160 if r[:160] in first_seen else (32 if first_seen else 0)
        first_seen.add(r[:160])
    assert docs.ceiling == reusable / sum(len(r) for r in rendered)
    assert docs.prompt_blocks == sum(len(r) for r in rendered) / 40 / 16


def test_a_partial_run_replaces_its_scenarios_and_keeps_the_others() -> None:
    report = load("routing_report")
    old = "## Routing\n\nold head\n\n### distinct\n\nold distinct table\n\n### docs-seq\n\nold docs-seq\n\n" + report.FOOT
    new = {"docs-seq": "### docs-seq\n\nnew docs-seq\n"}
    merged = report.merge(old, "## Routing\n\nnew head\n", new, load("routing").SCENARIOS)
    assert "new head" in merged and "old head" not in merged
    assert "old distinct table" in merged and "old docs-seq" not in merged and "new docs-seq" in merged
    assert merged.index("### distinct") < merged.index("### docs-seq") < merged.index("`kv` prices")
    assert merged.count("`kv` prices") == 1
