"""deploy/compose.yaml works as written, run as local processes (Docker cannot run here; issue 8).

Every meshllm service of the default profile is started with its own
`command` and `environment` (x-planes merged as YAML merges it), `meshllm`
replaced by `python -m meshllm`; real `etcd` and `nats-server` binaries stand
in for their images. Service hostnames become 127.0.0.1 and every published
port is remapped to a free one, consistently in commands, environments,
healthchecks and prometheus.yml's scrape targets. depends_on is honoured by
running each dependency's own healthcheck until it passes. Jaeger and
Prometheus are not started: OTEL_* variables are dropped, and Prometheus is
replaced by scraping its configured targets directly.

Locks: a chat completion flows frontend → router → prefill → decode; every
service serves Prometheus metrics at the target prometheus.yml names for it,
with the expected metric names; SIGTERM stops every service cleanly (exit 0).
A static check (no processes but `--help`) locks that every flag in the
compose commands and the k8s manifests exists and every MESHLLM_* variable
names a flag of the service it is given to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from mesh_run import ROOT, clean_env
from prometheus_client.parser import text_string_to_metric_families

from meshllm.testing.servers import EtcdServer, NatsServer, free_port

DEPLOY = ROOT / "deploy"
STAND_INS = {"etcd", "nats"}  # images replaced by real binaries
NOT_STARTED = {"prometheus", "jaeger"}  # images this test does not replace
# MESHLLM_* variables read outside the flag parsers.
NON_FLAG_VARS = {"MESHLLM_LOG_LEVEL", "MESHLLM_ENGINE"}

EXPECTED_METRICS = {
    "frontend": {
        "meshllm_frontend_requests",
        "meshllm_frontend_inflight_requests",
        "meshllm_frontend_time_to_first_token_seconds",
        "meshllm_frontend_inter_token_latency_seconds",
        "meshllm_frontend_request_duration_seconds",
        "meshllm_frontend_input_tokens",
        "meshllm_frontend_output_tokens",
    },
    "router": {
        "meshllm_router_decisions",
        "meshllm_router_overlap_blocks",
        "meshllm_router_kv_index_blocks",
        "meshllm_router_kv_events_applied",
        "meshllm_router_requests",
        "meshllm_router_workers",
    },
    "worker": {
        "meshllm_worker_inflight_requests",
        "meshllm_worker_kv_usage_ratio",
        "meshllm_worker_waiting_requests",
        "meshllm_worker_running_requests",
        "meshllm_worker_requests",
        "meshllm_worker_aborts",
        "meshllm_worker_kv_transfer_bytes",
    },
}


# ---------------------------------------------------------------- compose.yaml


def load_compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return compose


def default_profile(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if not svc.get("profiles")}


def is_meshllm(svc: dict[str, Any]) -> bool:
    return bool(svc.get("command")) and svc["command"][0] == "meshllm"


def role_of(svc: dict[str, Any]) -> str:
    """frontend | router | worker: the meshllm subcommand."""
    return str(svc["command"][1])


def published_ports(svc: dict[str, Any]) -> list[int]:
    """Container ports of `ports: ["HOST:CONTAINER", ...]`."""
    return [int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in svc.get("ports", [])]


def depends_on(svc: dict[str, Any]) -> list[str]:
    deps = svc.get("depends_on") or []
    return list(deps) if isinstance(deps, (list, dict)) else []


# ---------------------------------------------------------------- rewriting


@dataclass
class Rewriter:
    """Compose hostnames → 127.0.0.1 and published ports → free ports, applied to any string."""

    hosts: set[str]
    ports: dict[int, int]
    _host_port: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        names = "|".join(sorted((re.escape(h) for h in self.hosts), key=len, reverse=True))
        self._host_port = re.compile(rf"(?<![\w.-])({names}):(\d+)\b")

    def text(self, value: str) -> str:
        def sub(m: re.Match[str]) -> str:
            port = int(m[2])
            assert port in self.ports, f"{m[0]!r}: port {port} is not published by any compose service"
            return f"127.0.0.1:{self.ports[port]}"

        return self._host_port.sub(sub, value)

    def argv(self, argv: list[str]) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(argv):
            prev = argv[i - 1] if i else ""
            if prev.startswith("--") and prev.endswith("port") and arg.isdigit():
                assert int(arg) in self.ports, f"{prev} {arg}: the service does not publish that port"
                arg = str(self.ports[int(arg)])
            elif prev.startswith("--") and prev.endswith("host") and arg in self.hosts:
                arg = "127.0.0.1"  # listen on loopback only: this machine is shared
            out.append(self.text(arg))
        return out

    def env(self, env: dict[str, Any]) -> dict[str, str]:
        return {k: self.text(str(v)) for k, v in env.items() if not k.startswith("OTEL_")}


def meshllm_argv(argv: list[str]) -> list[str]:
    """`meshllm ...` / `python ...` as this interpreter runs them."""
    if argv[0] == "meshllm":
        return [sys.executable, "-m", "meshllm", *argv[1:]]
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return argv


def healthcheck_argv(svc: dict[str, Any], rw: Rewriter) -> list[str]:
    test = svc["healthcheck"]["test"]
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    kind, *argv = test
    if kind == "CMD-SHELL":
        argv = shlex.split(argv[0])
    assert kind in ("CMD", "CMD-SHELL"), test
    return meshllm_argv(rw.argv(argv))


def scrape_targets(rw: Rewriter, started: set[str]) -> dict[str, str]:
    """service → its metrics URL, from prometheus.yml's static targets (services not started are left out)."""
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    out: dict[str, str] = {}
    for job in prom["scrape_configs"]:
        path = job.get("metrics_path", "/metrics")
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host = target.rsplit(":", 1)[0]
                if host in started:
                    out[host] = f"http://{rw.text(target)}{path}"
    return out


# ---------------------------------------------------------------- processes


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class Stack:
    """The started processes, stopped in reverse start order on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.services: dict[str, Service] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                argv, env={**clean_env(), **env}, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.services[name] = Service(name, proc, log)

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} (exit {s.proc.poll()}):\n{s.tail()}" for s in self.services.values())

    async def stop(self, name: str, timeout_s: float = 30.0) -> int:
        """SIGTERM; SIGKILL after `timeout_s`; the exit status (negative = killed by a signal)."""
        proc = self.services[name].proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.to_thread(proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
            return -int(signal.SIGKILL)

    def kill_all(self) -> None:
        for s in self.services.values():
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()


async def wait_healthy(stack: Stack, name: str, argv: list[str], timeout_s: float = 120.0) -> None:
    """Run the service's healthcheck until it passes (compose's `condition: service_healthy`), with a deadline."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if stack.services[name].proc.poll() is not None:
            raise AssertionError(f"{name} exited before it was healthy:\n{stack.logs()}")
        probe = await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, env=clean_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            out, _ = await asyncio.wait_for(probe.communicate(), 30)
        except TimeoutError:
            probe.kill()
            out = await probe.stdout.read() if probe.stdout else b""
            await probe.wait()
        if probe.returncode == 0:
            return
        last = out.decode(errors="replace")[-500:]
        await asyncio.sleep(0.25)  # between probe attempts, like compose's interval; the condition is the probe
    raise AssertionError(f"{name} not healthy in {timeout_s}s (last probe: {last}):\n{stack.logs()}")


def http(method: str, url: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return resp.status, resp.read()


def sample_value(families: dict[str, Any], family: str, **labels: str) -> float:
    """Sum of the family's samples (counters: the _total ones) whose labels include `labels`."""
    return sum(
        s.value
        for s in families[family].samples
        if not s.name.endswith("_created") and labels.items() <= s.labels.items()
    )


@pytest.fixture
async def planes() -> AsyncIterator[tuple[EtcdServer, NatsServer]]:
    async with EtcdServer() as etcd, NatsServer() as nats:
        yield etcd, nats


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.kill_all()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_compose_stack_serves_a_chat_and_every_service_serves_prometheus_metrics(
    planes: tuple[EtcdServer, NatsServer], stack: Stack
) -> None:
    etcd, nats = planes
    compose = load_compose()
    services = default_profile(compose)
    mesh = {name: svc for name, svc in services.items() if is_meshllm(svc)}
    assert {role_of(s) for s in mesh.values()} == {"frontend", "router", "worker"}, sorted(mesh)
    assert set(services) - set(mesh) <= STAND_INS | NOT_STARTED, "an image this test cannot stand in for"

    ports: dict[int, int] = {}
    for name, svc in services.items():
        for port in published_ports(svc):
            assert port not in ports, f"{name}: port {port} is published twice"
            ports[port] = free_port()
    ports[2379], ports[4222] = etcd.port, nats.port
    hosts = set(services) | {s.get("hostname", n) for n, s in services.items()} | {"0.0.0.0", "127.0.0.1", "localhost"}
    rw = Rewriter(hosts=hosts, ports=ports)

    # Start in depends_on order: a wave is every service whose dependencies are healthy.
    healthy = set(STAND_INS)
    pending = dict(mesh)
    while pending:
        wave = [n for n, s in pending.items() if set(depends_on(s)) <= healthy]
        assert wave, f"depends_on cannot be satisfied: {pending.keys()} wait on {[depends_on(s) for s in pending.values()]}"
        for name in wave:
            svc = pending.pop(name)
            stack.start(name, meshllm_argv(rw.argv(svc["command"])), rw.env(svc.get("environment") or {}))
        await asyncio.gather(*(wait_healthy(stack, n, healthcheck_argv(mesh[n], rw)) for n in wave))
        healthy |= set(wave)

    # A chat completion through the frontend's published HTTP port (the compose header's example).
    frontend = next(n for n, s in mesh.items() if role_of(s) == "frontend")
    http_port = ports[int(mesh[frontend]["command"][mesh[frontend]["command"].index("--http-port") + 1])]
    base = f"http://127.0.0.1:{http_port}"
    status, body = await asyncio.to_thread(
        http, "POST", f"{base}/v1/chat/completions",
        {"model": "mocker", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
    )  # fmt: skip
    reply = json.loads(body)
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"].strip(), reply
    assert reply["usage"]["completion_tokens"] >= 1, reply

    # Every service is a Prometheus target, and serves the metrics docs/operations.md lists for its role.
    targets = scrape_targets(rw, set(mesh))
    assert set(targets) == set(mesh), f"prometheus.yml scrapes {sorted(targets)}, the stack runs {sorted(mesh)}"
    scraped: dict[str, dict[str, Any]] = {}
    for name, url in targets.items():
        status, text = await asyncio.to_thread(http, "GET", url)
        assert status == 200, (name, url)
        scraped[name] = {f.name: f for f in text_string_to_metric_families(text.decode())}
        missing = EXPECTED_METRICS[role_of(mesh[name])] - set(scraped[name])
        assert not missing, f"{name} ({url}) lacks {sorted(missing)}; serves {sorted(scraped[name])}"
    assert sample_value(scraped[frontend], "meshllm_frontend_requests", route="/v1/chat/completions", status="200") >= 1
    router = next(n for n, s in mesh.items() if role_of(s) == "router")
    for role in ("prefill", "decode"):  # disaggregated: the router chose a prefill and a decode worker
        decisions = sample_value(scraped[router], "meshllm_router_decisions", role=role)
        assert decisions >= 1, scraped[router]["meshllm_router_decisions"].samples

    # Shutdown: the frontend first (stops admitting), then the router, then the workers; each exits 0.
    order = sorted(mesh, key=lambda n: ["frontend", "router", "worker"].index(role_of(mesh[n])))
    codes = {name: await stack.stop(name) for name in order}
    assert all(code == 0 for code in codes.values()), f"{codes}\n{stack.logs()}"


# ---------------------------------------------------------------- static checks (no services started)


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


@pytest.mark.parametrize(
    "name", [n for n, s in load_compose()["services"].items() if is_meshllm(s) and s.get("profiles")]
)
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


def test_the_port_table_in_compose_matches_its_services() -> None:
    """The header comment's port table lists every port the default profile publishes."""
    compose_text = (DEPLOY / "compose.yaml").read_text()
    header = "\n".join(line for line in compose_text.splitlines() if line.startswith("#"))
    for name, svc in default_profile(load_compose()).items():
        for port in published_ports(svc):
            assert re.search(rf"\b{port}\b", header), f"{name} publishes {port}, the header's port table omits it"
