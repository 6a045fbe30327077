"""Real `meshllm` processes on secured planes (issue 13): etcd with TLS, client certificates and auth, NATS with TLS and a token.

A worker given the right credentials (files as flags, secrets from variables
and files) registers, serves and publishes load; the worker, the router and
the frontend each exit with status 1 and one clear line when a credential is
wrong, without a traceback and without printing the secret.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm.certs import CertFiles, make_dev_pki
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.credentials import EtcdCredentials, NatsCredentials
from meshllm.plane.discovery.base import open_discovery
from meshllm.plane.events.base import open_events
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.names import load_subject
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.v1 import events_pb2
from meshllm.worker.client import WorkerClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD, TOKEN = "meshllm", "etcd-pw-4711", "nats-token-4711"


@dataclass(frozen=True)
class Planes:
    etcd: EtcdServer
    nats: NatsServer
    client: CertFiles
    token_file: Path

    def flags(self) -> list[str]:
        c = self.client
        return [
            "--discovery", "etcd", "--etcd-endpoints", self.etcd.endpoint, "--lease-ttl", "3",
            "--etcd-ca", str(c.ca), "--etcd-cert", str(c.cert), "--etcd-key", str(c.key), "--etcd-user", USER,
            "--nats-url", self.nats.url, "--nats-ca", str(c.ca), "--nats-cert", str(c.cert), "--nats-key", str(c.key),
        ]  # fmt: skip

    def env(self, *, password: str = PASSWORD) -> dict[str, str]:
        return {"MESHLLM_ETCD_PASSWORD": password, "MESHLLM_NATS_TOKEN_FILE": str(self.token_file)}

    def plane(self) -> PlaneConfig:
        c = self.client
        return PlaneConfig(
            discovery=DiscoveryKind.ETCD,
            etcd_endpoints=(self.etcd.endpoint,),
            lease_ttl_s=3,
            events=EventsKind.NATS,
            nats_url=self.nats.url,
            etcd_credentials=EtcdCredentials(ca=str(c.ca), cert=str(c.cert), key=str(c.key), user=USER, password=PASSWORD),
            nats_credentials=NatsCredentials(ca=str(c.ca), cert=str(c.cert), key=str(c.key), token=TOKEN),
        )


@pytest.fixture
async def planes(tmp_path: Path) -> AsyncIterator[Planes]:
    _, files = make_dev_pki(tmp_path / "pki", ["etcd", "nats", "mesh"])
    token_file = tmp_path / "nats-token"
    token_file.write_text(TOKEN + "\n")
    async with (
        EtcdServer(tls=files["etcd"], users={USER: PASSWORD}) as etcd,
        NatsServer(tls=files["nats"], token=TOKEN) as nats,
    ):
        yield Planes(etcd, nats, files["mesh"], token_file)


async def test_a_worker_registers_serves_and_publishes_load_on_secured_planes(planes: Planes) -> None:
    worker = MeshllmProcess("worker", "--engine", "sample", *planes.flags(), env=planes.env())
    try:
        address = await worker.address(timeout_s=60)
        async with await open_discovery(planes.plane()) as disc, await open_events(planes.plane()) as bus, ChannelCache() as ch:
            sub = await bus.subscribe(load_subject("meshllm", "worker"), events_pb2.LoadSnapshot)
            async with asyncio.timeout(15):
                async for snap in disc.watch_instances("worker"):
                    if any(i.address == address for i in snap.values()):
                        (inst,) = snap.values()
                        break
            client = WorkerClient(ch, address)
            chunks = [c async for c in client.generate({"request_id": "r1", "token_ids": [10, 20], "stop": {"max_tokens": 3}})]
            assert [t for c in chunks for t in c.get("token_ids", [])] == [21, 22, 23]
            async with asyncio.timeout(15):
                async for load in sub:
                    if load.worker_id == inst.id:
                        break
        worker.send_signal(signal.SIGTERM)
        assert await worker.wait() == 0
        stderr = worker.stderr_tail(1_000_000)
        assert "discovery on etcd" in stderr and "user 'meshllm'" in stderr, stderr  # it says what it uses ...
        assert PASSWORD not in stderr and TOKEN not in stderr  # ... never the secrets
    finally:
        await worker.stop()


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshllm", *command],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.parametrize(
    "command",
    [["worker", "--engine", "sample"], ["router"], ["frontend", "--http-port", "0", "--grpc-port", "0"]],
    ids=["worker", "router", "frontend"],
)
@pytest.mark.parametrize("wrong", ["etcd password", "NATS token"])
async def test_each_service_exits_with_one_clear_line_on_wrong_credentials(
    planes: Planes, command: list[str], wrong: str, tmp_path: Path
) -> None:
    env = planes.env(password="not-" + PASSWORD if wrong == "etcd password" else PASSWORD)
    if wrong == "NATS token":
        bad = tmp_path / "bad-token"
        bad.write_text("not-" + TOKEN)
        env["MESHLLM_NATS_TOKEN_FILE"] = str(bad)
    proc = await asyncio.to_thread(run, [*command, *planes.flags()], env)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    expected = "authentication failed" if wrong == "etcd password" else "NATS at"
    hint = "MESHLLM_ETCD_PASSWORD" if wrong == "etcd password" else "--nats-token"
    assert last.startswith(f"meshllm {command[0]}: error: ") and expected in last and hint in last, proc.stderr
    assert PASSWORD not in proc.stderr and TOKEN not in proc.stderr


async def test_a_missing_certificate_file_is_a_one_line_config_error(planes: Planes, tmp_path: Path) -> None:
    flags = planes.flags()
    flags[flags.index("--etcd-cert") + 1] = str(tmp_path / "missing.pem")
    proc = await asyncio.to_thread(run, ["worker", "--engine", "sample", *flags], planes.env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--etcd-cert" in proc.stderr and "no such file" in proc.stderr, proc.stderr
