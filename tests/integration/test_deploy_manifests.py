"""The deploy/ files name only what exists: every flag in the compose commands and the k8s manifests is a real
flag of its command, every MESHLLM_* variable names one, only the frontend is published on all interfaces, and
the compose header's port table is complete. No services are started (only `meshllm ... --help`).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from functools import cache
from typing import Any

import pytest
import yaml
from compose_model import DEPLOY, default_profile, is_meshllm, load_compose, published_ports
from mesh_run import ROOT, clean_env

# MESHLLM_* variables read outside the flag parsers.
NON_FLAG_VARS = {"MESHLLM_LOG_LEVEL", "MESHLLM_ENGINE"}


@cache
def help_of(command: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """`meshllm SUBCOMMAND [--engine E] --help`, as the command would run."""
    argv = [sys.executable, "-m", "meshllm", command[1]]
    if command[1] == "worker":
        argv += ["--engine", command[command.index("--engine") + 1] if "--engine" in command else "mocker"]
    return subprocess.run([*argv, "--help"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60)


def flags_of(command: tuple[str, ...]) -> frozenset[str]:
    """Every long flag the real parser of `command` lists in its --help."""
    done = help_of(command)
    assert done.returncode == 0, done.stderr
    flags = set()
    for line in done.stdout.splitlines():
        s = line.strip()
        if s.startswith("-"):
            flags.update(re.findall(r"--[a-z0-9][a-z0-9-]*", re.split(r"\s{2,}", s)[0]))
    return frozenset(flags | ({"--engine"} if command[1] == "worker" else set()))


def env_var(flag: str) -> str:
    return "MESHLLM_" + flag.lstrip("-").replace("-", "_").upper()


def check_command(where: str, command: list[str], env_vars: set[str]) -> list[str]:
    """Problems with a meshllm command and the MESHLLM_* variables given to it."""
    flags = flags_of(tuple(command))
    problems = [f"{where}: unknown flag {a}" for a in command if a.startswith("--") and a.split("=")[0] not in flags]
    known = {env_var(f) for f in flags} | NON_FLAG_VARS
    problems += [f"{where}: {v} names no flag of `meshllm {command[1]}`" for v in sorted(env_vars - known)]
    return problems


def compose_problems(name: str, svc: dict[str, Any]) -> list[str]:
    env = {k for k in (svc.get("environment") or {}) if k.startswith("MESHLLM_")}
    return check_command(f"compose {name}", svc["command"], env)


def test_compose_commands_use_real_flags_and_every_meshllm_variable_names_one() -> None:
    problems: list[str] = []
    for name, svc in default_profile(load_compose()).items():
        if is_meshllm(svc):
            problems += compose_problems(name, svc)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", [n for n, s in load_compose()["services"].items() if is_meshllm(s) and s.get("profiles")])
def test_profile_services_use_real_flags_where_their_engine_is_installed(name: str) -> None:
    svc = load_compose()["services"][name]
    done = help_of(tuple(svc["command"]))
    if done.returncode != 0 and "cannot import" in done.stderr:
        pytest.skip(f"{name}: its engine cannot be imported here ({done.stderr.strip()})")
    problems = compose_problems(name, svc)
    assert not problems, "\n".join(problems)
    assert svc["healthcheck"]["test"][1:3] == ["meshllm", "health"], svc.get("healthcheck")


def k8s_documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_manifests_use_real_flags_and_the_configmap_only_names_flags() -> None:
    docs = k8s_documents()
    configmaps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    problems: list[str] = []
    shared_used: dict[str, set[str]] = {}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            command = [str(a) for a in c.get("command", [])]
            if not command or command[0] != "meshllm":
                continue
            own = {e["name"] for e in c.get("env", []) if e["name"].startswith("MESHLLM_")}
            problems += check_command(f"k8s {d['metadata']['name']}", command, own)
            flags = {env_var(f) for f in flags_of(tuple(command))} | NON_FLAG_VARS
            for ref in c.get("envFrom", []):
                cm = ref["configMapRef"]["name"]
                assert cm in configmaps, f"{d['metadata']['name']}: no ConfigMap {cm}"
                shared_used.setdefault(cm, set()).update(k for k in configmaps[cm] if k in flags)
            for probe in ("readinessProbe", "livenessProbe"):
                exec_cmd = c.get(probe, {}).get("exec", {}).get("command")
                if exec_cmd:
                    assert exec_cmd[:2] == ["meshllm", "health"], exec_cmd
    for cm, used in shared_used.items():
        unused = set(configmaps[cm]) - used
        problems += [f"k8s ConfigMap {cm}: {v} names no flag of any role that loads it" for v in sorted(unused)]
    assert not problems, "\n".join(problems)


def containers(docs: list[dict[str, Any]], subcommand: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(Deployment, container) for every container running `meshllm SUBCOMMAND`."""
    return [
        (d, c)
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        if [str(a) for a in c.get("command", [])[:2]] == ["meshllm", subcommand]
    ]


def flag_in(command: list[Any], flag: str) -> str | None:
    args = [str(a) for a in command]
    return args[args.index(flag) + 1] if flag in args else None


def test_k8s_planner_may_read_and_scale_only_the_worker_deployments_it_names() -> None:
    """planner.yaml's Role: get the Deployments, get and patch their scale, by name, and nothing else."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "planner.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    [(planner, container)] = containers(docs, "planner")
    account = by_kind["ServiceAccount"]["metadata"]["name"]
    assert planner["spec"]["template"]["spec"]["serviceAccountName"] == account
    binding, role = by_kind["RoleBinding"], by_kind["Role"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert flag_in(container["command"], "--connector") == "kubernetes"
    workers = {d["metadata"]["name"]: flag_in(c["command"], "--role") for d, c in containers(k8s_documents(), "worker")}
    named = {role: flag_in(container["command"], f"--kube-deployment-{role}") for role in ("prefill", "decode")}
    assert named == {"prefill": "meshllm-prefill", "decode": "meshllm-decode"}
    assert all(workers.get(name) == r for r, name in named.items()), f"{named} against the worker Deployments {workers}"
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])), tuple(sorted(r["resourceNames"])))
             for r in role["rules"]}  # fmt: skip
    names = tuple(sorted(named.values()))
    assert rules == {(("apps",), ("deployments",), ("get",), names), (("apps",), ("deployments/scale",), ("get", "patch"), names)}


# The worker's shutdown steps around the drain (meshllm.worker.runtime: unregister's and stop_all's bounds).
UNREGISTER_S, STOP_REST_S = 5, 5


def test_k8s_workers_finish_their_drain_before_sigkill() -> None:
    """A scale-down is a drain: terminationGracePeriodSeconds outlasts unregister, grace period and drain timeout."""
    from meshllm.engine.worker_config import WorkerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
    for d, c in containers(k8s_documents(), "worker"):
        grace = float(flag_in(c["command"], "--grace-period") or defaults["grace_period_s"])
        drain = float(flag_in(c["command"], "--drain-timeout") or defaults["drain_timeout_s"])
        allowed = d["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        needed = UNREGISTER_S + grace + drain + STOP_REST_S
        assert allowed > needed, f"{d['metadata']['name']}: {allowed} s before SIGKILL, the drain takes up to {needed:g} s"


def test_k8s_planner_reaches_what_it_reads_and_prometheus_reaches_it() -> None:
    docs = k8s_documents()
    [(planner, container)] = containers(docs, "planner")
    port = int(flag_in(container["command"], "--metrics-port") or 0)
    assert planner["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert port in {p["port"] for rule in policies["meshllm-metrics"]["ingress"] for p in rule["ports"]}
    [egress] = [p for p in policies.values() if p["podSelector"] == {"matchLabels": {"app": "meshllm-planner"}}]
    reached = {(next(iter(t.get("podSelector", {}).get("matchLabels", {}).values()), "any"), p["port"])
               for rule in egress["egress"] for t in rule.get("to", [{}]) for p in rule["ports"]}  # fmt: skip
    assert {("etcd", 2379), ("meshllm-router", 9000), ("meshllm-frontend", 8000), ("kube-dns", 53), ("any", 443)} <= reached


def test_only_the_frontend_is_published_and_profile_extras_only_on_loopback() -> None:
    services = load_compose()["services"]
    published = {n for n, s in default_profile(load_compose()).items() if s.get("ports")}
    assert published == {"frontend"}, f"the default profile publishes {sorted(published)}: only the frontend may"
    for name, svc in services.items():
        if svc.get("profiles") and "observability" in svc["profiles"]:
            for port in svc.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is published beyond loopback"


def test_the_port_table_in_compose_matches_its_services() -> None:
    """The header comment's port table lists every port the default profile publishes."""
    compose_text = (DEPLOY / "compose.yaml").read_text()
    header = "\n".join(line for line in compose_text.splitlines() if line.startswith("#"))
    for name, svc in default_profile(load_compose()).items():
        for port in published_ports(svc):
            assert re.search(rf"\b{port}\b", header), f"{name} publishes {port}, the header's port table omits it"
