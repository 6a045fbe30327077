"""The systems bench/mesh.py measures, each started as real OS processes on loopback and torn down after.

- `split`: etcd + nats-server + N `meshllm worker --engine mocker` + `meshllm frontend` (embedded routing core);
- `router`: the same with a `meshllm router` process between the frontend (`--router-address`) and the workers;
- `run`: `meshllm run` (frontend, routing core and workers in one process; in-memory planes);
- `split+mtls`, `router+mtls` (`bench/mesh.py --tls`): the same with mTLS on every gRPC hop (a certificate per
  process from `meshllm.certs.make_dev_pki`), HTTPS with the frontend's public API (`--api-client-certs none`,
  as in deploy/compose.yaml); etcd and NATS unchanged;
- `dynamo`: NVIDIA Dynamo 1.6.1 through ../shared/anchors/dynamo/up.sh agg (its etcd, NATS, frontend with
  embedded router, N mocker processes), stopped by down.sh; PIDs from the pids file up.sh writes.

Readiness is observed, never slept for: ready lines on stdout, the frontend's /health, the router's worker
gauge, and, for the split layouts, a probe request per worker until every worker's request counter moved.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson

from harness.probes import READY_S, healthy, http_get, metric_sum, until
from harness.servers import ready_match, ready_url
from meshllm.bench.http import Connection, Endpoint
from meshllm.certs import make_dev_pki
from meshllm.frontend.text.tokenizer import load_tokenizer
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer, free_port

__all__ = ["DYNAMO_DIR", "LABELS", "MODEL_DIR", "Running", "SystemSpec", "dynamo_venv", "start_system"]

ROOT = Path(__file__).resolve().parents[2]  # the repository: bench/harness/systems.py
DYNAMO_DIR = ROOT.parent / "shared" / "anchors" / "dynamo"
MODEL_DIR = DYNAMO_DIR / "models" / "smollm2-135m-instruct"
DYNAMO_VERSION = "1.6.1"  # what ../shared/anchors/dynamo installs; bench/mesh_report.py checks the installed one
LABELS = {
    "split": "meshllm split",
    "router": "meshllm split + router process",
    "split+mtls": "meshllm split, mTLS",
    "router+mtls": "meshllm split + router process, mTLS",
    "split+grpc": "meshllm split, sessions on gRPC",
    "router+grpc": "meshllm split + router process, sessions on gRPC",
    "run": "meshllm run (one process)",
    "dynamo": f"Dynamo {DYNAMO_VERSION}",
}
ENV = {"MESHLLM_LOG_LEVEL": "WARNING"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SystemSpec:
    """What every system is started with: same workers, policy, speedup and model."""

    speedup: float
    workers: int = 2
    router_mode: str = "round-robin"
    model_path: Path = MODEL_DIR
    model_name: str = "smollm2-135m-instruct"
    extra: Mapping[str, Sequence[str]] = field(default_factory=dict)  # command → extra flags (frontend, router, ...)
    tls: bool = False  # mTLS between the processes, HTTPS on the frontend (the `+mtls` kinds)
    # A directory put first on every meshllm process's PYTHONPATH (bench/mesh_ab.py: another commit's
    # `services/`); empty = the services of the interpreter's own install.
    services_path: str = ""

    def env(self) -> dict[str, str]:
        """The environment every meshllm process of the system gets on top of the bench's own."""
        if not self.services_path:
            return ENV
        inherited = os.environ.get("PYTHONPATH")
        return {**ENV, "PYTHONPATH": os.pathsep.join([self.services_path, *([inherited] if inherited else [])])}


@dataclass(slots=True)
class Running:
    """A started system: where to send load, and the processes to meter (name → root pid)."""

    kind: str
    url: str
    model: str
    processes: dict[str, int]
    python: dict[str, int] = field(default_factory=dict)  # meshllm processes py-spy can sample


@asynccontextmanager
async def start_system(kind: str, spec: SystemSpec) -> AsyncIterator[Running]:
    """Start `kind` (a key of LABELS), wait until it serves on every worker, stop it on exit."""
    if kind in ("split+mtls", "router+mtls"):
        async with _split(replace(spec, tls=True), router=kind == "router+mtls") as running:
            running.kind = kind
            yield running
    elif kind in ("split", "router"):
        async with _split(spec, router=kind == "router") as running:
            yield running
    elif kind in ("split+grpc", "router+grpc"):  # Generate sessions on gRPC calls only (no TCP session ports)
        extra = {cmd: [*spec.extra.get(cmd, ()), "--session-port", "-1"] for cmd in ("worker", "router")}
        async with _split(replace(spec, extra={**spec.extra, **extra}), router=kind == "router+grpc") as running:
            running.kind = kind
            yield running
    elif kind == "run":
        async with _run(spec) as running:
            yield running
    elif kind == "dynamo":
        async with _dynamo(spec) as running:
            yield running
    else:
        raise ValueError(f"unknown system {kind!r}")


# ---------------------------------------------------------------- readiness


async def _every_worker_serves(url: str, model: str, metrics_ports: Sequence[int]) -> None:
    """Send tiny requests through the frontend until each worker's request counter has moved."""

    async def counts() -> list[float]:
        return [metric_sum((await http_get(p, "/metrics"))[1], "meshllm_worker_requests_total") for p in metrics_ports]

    start = await counts()
    conn = Connection(Endpoint.parse(url))
    sent = 0

    async def check() -> bool:
        nonlocal sent
        sent += 1  # a new prompt each time: a cache-aware policy must not pin every probe to one worker
        content = f"probe {sent} " * (1 + sent % 16)
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1})
        resp = await conn.post("/chat/completions", body)
        data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"probe request failed: HTTP {resp.status} {data[:300]!r}")
        return all(now > before for now, before in zip(await counts(), start, strict=True))

    try:
        await until("every worker served a probe request", check)
    finally:
        await conn.close()


# ---------------------------------------------------------------- meshllm


def simulated_model_flags(model_path: Path) -> list[str]:
    """The mocker simulates the tokenizer's model: its vocabulary size and EOS id (as `meshllm run` does)."""
    tok = load_tokenizer(str(model_path))
    flags = ["--vocab-size", str(tok.vocab_size)]
    if tok.eos_token_ids:
        flags += ["--eos-token-id", str(tok.eos_token_ids[0])]
    return flags


async def _stop_all(procs: Sequence[MeshllmProcess]) -> None:
    for p in procs:  # the caller lists the frontend first: it stops sending before the workers go
        await p.stop()


@contextmanager
def _mesh_tls(spec: SystemSpec, names: Sequence[str]) -> Iterator[dict[str, list[str]]]:
    """name → its `--tls-*` flags (empty without `spec.tls`); the load generator trusts the CA meanwhile."""
    if not spec.tls:
        yield {name: [] for name in names}
        return
    with tempfile.TemporaryDirectory(prefix="meshllm-bench-pki-") as tmp:
        pki, files = make_dev_pki(tmp, names)
        flags = {n: ["--tls-cert", str(f.cert), "--tls-key", str(f.key), "--tls-ca", str(f.ca)] for n, f in files.items()}
        flags["frontend"] += ["--api-client-certs", "none"]  # public clients: TLS alone, as in deploy/compose.yaml
        before = os.environ.get("SSL_CERT_FILE")
        os.environ["SSL_CERT_FILE"] = str(pki.ca_path)  # the bench's HTTPS clients verify the frontend with the dev CA
        try:
            yield flags
        finally:
            if before is None:
                os.environ.pop("SSL_CERT_FILE", None)
            else:
                os.environ["SSL_CERT_FILE"] = before


@asynccontextmanager
async def _split(spec: SystemSpec, *, router: bool) -> AsyncIterator[Running]:
    names = ["frontend", "router", *(f"worker-{i + 1}" for i in range(spec.workers))]
    with _mesh_tls(spec, names) as tls:
        async with _split_planes(spec, router=router, tls=tls) as running:
            yield running


@asynccontextmanager
async def _split_planes(spec: SystemSpec, *, router: bool, tls: Mapping[str, Sequence[str]]) -> AsyncIterator[Running]:
    async with EtcdServer() as etcd, NatsServer() as nats:
        planes = ("--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--nats-url", nats.url)
        sim = await asyncio.to_thread(simulated_model_flags, spec.model_path)
        procs: list[MeshllmProcess] = []
        try:
            ports = [free_port() for _ in range(spec.workers)]
            argv = [
                "worker", "--engine", "mocker", "--host", "127.0.0.1", "--port", "0", "--model-name", spec.model_name,
                *planes, "--speedup-ratio", f"{spec.speedup:g}", *sim, *spec.extra.get("worker", ()),
            ]  # fmt: skip
            workers = [
                MeshllmProcess(*argv, "--metrics-port", str(port), *tls[f"worker-{i + 1}"], env=spec.env())
                for i, port in enumerate(ports)
            ]
            procs[:0] = workers
            for w in workers:
                await w.address(READY_S)
            processes = {f"worker {i + 1}": w.proc.pid for i, w in enumerate(workers)}
            upstream: tuple[str, ...] = ()
            if router:
                rport = free_port()
                rp = MeshllmProcess(
                    "router", "--host", "127.0.0.1", "--port", "0", "--router-mode", spec.router_mode,
                    "--metrics-port", str(rport), *planes, *tls["router"], *spec.extra.get("router", ()), env=spec.env(),
                )  # fmt: skip
                procs.insert(0, rp)
                address = await rp.address(READY_S)

                async def pool_full() -> bool:
                    return metric_sum((await http_get(rport, "/metrics"))[1], "meshllm_router_workers") >= spec.workers

                await until(f"the router sees {spec.workers} workers", pool_full)
                upstream = ("--router-address", address)
                processes = {"router": rp.proc.pid, **processes}
            fe = MeshllmProcess(
                "frontend", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-port", "-1",
                "--router-mode", spec.router_mode, "--model-path", str(spec.model_path), *planes, *upstream,
                *tls["frontend"], *spec.extra.get("frontend", ()), env=spec.env(),
            )  # fmt: skip
            procs.insert(0, fe)
            url = await ready_url(fe, READY_S)
            await healthy(url)
            await _every_worker_serves(url, spec.model_name, ports)
            meshllm = {"frontend": fe.proc.pid, **processes}
            assert etcd.pid is not None and nats.pid is not None
            yield Running(
                kind="router" if router else "split", url=url, model=spec.model_name,
                processes={**meshllm, "etcd": etcd.pid, "nats": nats.pid}, python=meshllm,
            )  # fmt: skip
        except BaseException:
            for p in procs:
                if p.proc.poll() is not None:
                    print(f"  {p.proc.args!r} exited {p.proc.returncode}: {p.stderr_tail(1500)}", flush=True)
            raise
        finally:
            await _stop_all(procs)


@asynccontextmanager
async def _run(spec: SystemSpec) -> AsyncIterator[Running]:
    proc = MeshllmProcess(
        "run", "--workers", str(spec.workers), "--router-mode", spec.router_mode, "--http-host", "127.0.0.1",
        "--http-port", "0", "--grpc-port", "0", "--router-port", "0", "--model-path", str(spec.model_path),
        "--model-name", spec.model_name, *spec.extra.get("run", ()), "--", "--speedup-ratio", f"{spec.speedup:g}",
        env=spec.env(),
    )  # fmt: skip
    try:
        url = await ready_url(proc, READY_S)
        await ready_match(proc, r"^try:")  # the last ready line: nothing more will sit in the pipe
        await healthy(url)
        yield Running(kind="run", url=url, model=spec.model_name, processes={"meshllm run": proc.proc.pid},
                      python={"meshllm run": proc.proc.pid})  # fmt: skip
    except BaseException:
        if proc.proc.poll() is not None:
            print(f"  meshllm run exited {proc.proc.returncode}: {proc.stderr_tail(1500)}", flush=True)
        raise
    finally:
        await proc.stop()


# ---------------------------------------------------------------- Dynamo


def dynamo_venv() -> Path:
    """Where up.sh looks for Dynamo's virtualenv ($DYN_VENV, else $ANCHOR_HOME/dyn, else /tmp/meshllm-anchor/dyn)."""
    if os.environ.get("DYN_VENV"):
        return Path(os.environ["DYN_VENV"])
    home = os.environ.get("ANCHOR_HOME") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "meshllm-anchor")
    return Path(home) / "dyn"


def read_pids(path: Path) -> dict[str, int]:
    """up.sh's pids file ('name pid' per line) → our process names (mockerN → 'worker N')."""
    out = {}
    for line in path.read_text().splitlines():
        name, _, pid = line.strip().partition(" ")
        if pid.strip().isdigit():
            m = re.fullmatch(r"mocker(\d+)", name)
            out[f"worker {m[1]}" if m else name] = int(pid)
    return out


async def _script(script: str, env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run up.sh / down.sh; output to a file, not a pipe: the services up.sh leaves running would hold a pipe open."""
    with tempfile.TemporaryFile() as out:
        proc = await asyncio.create_subprocess_exec(
            "bash", str(DYNAMO_DIR / script), *(["agg"] if script == "up.sh" else []), env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        out.seek(0)
        return proc.returncode or 0, out.read().decode(errors="replace")


@asynccontextmanager
async def _dynamo(spec: SystemSpec) -> AsyncIterator[Running]:
    if not (dynamo_venv() / "bin" / "python").exists():
        raise RuntimeError(f"Dynamo is not installed at {dynamo_venv()} (run {DYNAMO_DIR}/install.sh)")
    run_dir = Path(tempfile.mkdtemp(prefix="meshllm-bench-dynamo-"))
    http_port = free_port()
    env = {
        **os.environ, "RUN_DIR": str(run_dir), "DYN_VENV": str(dynamo_venv()), "HTTP_PORT": str(http_port),
        "ETCD_PORT": str(free_port()), "ETCD_PEER_PORT": str(free_port()), "NATS_PORT": str(free_port()),
        "NATS_MON_PORT": str(free_port()), "NUM_WORKERS": str(spec.workers), "ROUTER_MODE": spec.router_mode,
        "SPEEDUP": f"{spec.speedup:g}", "MODEL_DIR": str(spec.model_path), "MODEL_NAME": spec.model_name,
        "DYN_LOG": "warn",
    }  # fmt: skip
    try:
        rc, out = await _script("up.sh", env, 600)
        if rc != 0:
            raise RuntimeError(f"Dynamo up.sh failed ({rc}): {out[-2000:]}")
        processes = read_pids(run_dir / "pids")
        url = f"http://127.0.0.1:{http_port}"
        await _healthy_dynamo(url, spec.model_name)
        yield Running(kind="dynamo", url=url, model=spec.model_name, processes=processes)
    finally:
        await _script("down.sh", env, 120)
        shutil.rmtree(run_dir, ignore_errors=True)


async def _healthy_dynamo(url: str, model: str) -> None:
    port = Endpoint.parse(url).port

    async def check() -> bool:
        status, body = await http_get(port, "/v1/models")
        return status == 200 and model.encode() in body

    await until(f"Dynamo lists {model}", check)
