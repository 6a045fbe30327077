"""deploy/grafana: every dashboard query names metrics and labels that a running mesh exports (issue 16).

A real `meshllm run` (one prefill and two decode workers, API keys on)
serves every component's metrics on its one /metrics: the frontend's, the
embedded router's and each worker's. After a few chat completions and one
refused key, the scrape is the ground truth: each panel's PromQL (and each
template variable's `label_values`) may only name metrics found there, filter
and group by labels those metrics carry, and print legend labels the query's
result keeps. The same scrape locks the exposition itself: no `_created`
series, worker series labelled with model and role, request counters with
model. A static part checks the provisioning (datasource uid, dashboard
folder) matches the compose file's mounts.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from mesh_run import ROOT, MeshRun
from prometheus_client.parser import text_string_to_metric_families

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
KEY = "sk-grafana-0123456789abcdef"
METRIC = re.compile(r"\b(meshllm_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b(meshllm_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
LABEL_VALUES = re.compile(r"label_values\((meshllm_[a-z0-9_]+)(?:\{[^}]*\})?\s*,\s*([a-zA-Z_]+)\)")


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in board["panels"]:
        yield p
        yield from p.get("panels", ())


def queries(board: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(panel title, expr, legend) of every target."""
    for p in panels(board):
        for t in p.get("targets", ()):
            yield p["title"], t["expr"], t.get("legendFormat", "")


@cache
def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


# ---------------------------------------------------------------- static


def test_the_dashboards_are_well_formed_and_provisioned_by_compose() -> None:
    assert [p.name for p in DASHBOARDS] == ["meshllm-frontend.json", "meshllm-router.json", "meshllm-workers.json"]
    uids = [load(p)["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids)
    for path in DASHBOARDS:
        board = load(path)
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in panels(board)]
        assert len(set(ids)) == len(ids), path.name
        for p in panels(board):
            assert p.get("gridPos") and p.get("title"), (path.name, p)
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}" and p["targets"], (path.name, p["title"])
        used = {v for _, expr, _ in queries(board) for v in re.findall(r"\$(\w+)", expr)} - {"__rate_interval"}
        assert used <= set(variables), f"{path.name} uses undefined variables {used - set(variables)}"

    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":", 1) for v in grafana["volumes"])
    assert mounts == {
        "./grafana/provisioning": "/etc/grafana/provisioning",
        "./grafana/dashboards": "/var/lib/grafana/dashboards",
    }
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "meshllm.yaml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert (source["uid"], source["url"]) == ("prometheus", "http://prometheus:9090")
    assert "prometheus" in compose["services"] and "prometheus" in grafana["depends_on"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).name in {p.name for p in DASHBOARDS}


# ---------------------------------------------------------------- against a running mesh


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from a running `meshllm run`'s one /metrics."""
    with MeshRun.start("--prefill-workers", "1", "--workers", "2", "--api-keys", f"ci:{KEY}") as mesh:
        for i in range(4):
            body = {"model": "mocker", "messages": [{"role": "user", "content": f"grafana {i} " * 30}], "max_tokens": 8}
            assert post(mesh.http_url + "/v1/chat/completions", body, KEY) == 200
        assert post(mesh.http_url + "/v1/chat/completions", {"model": "mocker"}, "sk-wrong") == 401
        scrape = urllib.request.Request(mesh.http_url + "/metrics", headers={"authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(scrape, timeout=10) as resp:  # with keys set, /metrics needs one too
            text = resp.read().decode()
    assert "_created" not in text
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return labels


def post(url: str, body: dict[str, Any], key: str) -> int:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json", "authorization": f"Bearer {key}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_meshllm_run_serves_every_components_metrics_with_model_labels(exported: dict[str, set[str]]) -> None:
    for prefix in ("meshllm_frontend_", "meshllm_router_", "meshllm_worker_"):
        assert any(name.startswith(prefix) for name in exported), prefix
    for name, labels in exported.items():
        if name.startswith("meshllm_worker_"):
            assert {"worker_id", "model", "role"} <= labels, (name, labels)
    assert "model" in exported["meshllm_frontend_requests_total"]
    assert not [n for n in exported if n.endswith("_created")]


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_query_names_exported_metrics_and_labels(path: Path, exported: dict[str, set[str]]) -> None:
    board = load(path)
    problems: list[str] = []
    for title, expr, legend in queries(board):
        names = METRIC.findall(expr)
        if not names:
            problems.append(f"{title}: no meshllm metric in {expr!r}")
        for name in names:
            if name not in exported:
                problems.append(f"{title}: {name} is not exported")
        carried = set().union(*(exported.get(n, set()) for n in names))
        for name, matchers in SELECTOR.findall(expr):
            for label in MATCHER.findall(matchers):
                if label not in exported.get(name, set()):
                    problems.append(f"{title}: {name} has no label {label!r}")
        groups = [set(filter(None, (x.strip() for x in g.split(",")))) for g in GROUPING.findall(expr)]
        for group in groups:
            problems += [f"{title}: grouped by {label!r}, which no metric of it carries" for label in group - carried]
        kept = set.intersection(*groups) if groups else carried
        problems += [f"{title}: legend {{{{{label}}}}} is not in the result" for label in set(LEGEND.findall(legend)) - kept]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            for name, label in LABEL_VALUES.findall(var["definition"]):
                if label not in exported.get(name, set()):
                    problems.append(f"variable {var['name']}: {name} has no label {label!r}")
    assert not problems, "\n".join(problems)
