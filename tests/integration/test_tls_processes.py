"""TLS settings of real `meshllm` processes: variables, startup errors, `meshllm health` over mTLS (issue 13)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshllm.certs import DevPki
from meshllm.errors import Unavailable
from meshllm.plane.auth import MeshSecurity
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.tls import TlsConfig
from meshllm.testing.processes import MeshllmProcess
from meshllm.worker.client import WorkerClient

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


async def meshllm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "meshllm", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, **(env or {})},
    )  # fmt: skip


async def test_a_worker_process_serves_mtls_from_its_variables_and_meshllm_health_probes_it(tmp_path: Path) -> None:
    ca = DevPki.create(tmp_path)
    worker, client = ca.issue("worker"), ca.issue("client")
    env = {"MESHLLM_TLS_CERT": str(worker.cert), "MESHLLM_TLS_KEY": str(worker.key), "MESHLLM_TLS_CA": str(worker.ca)}
    proc = MeshllmProcess("worker", "--engine", "sample", "--static", "--grace-period", "0", env=env)
    try:
        address = await proc.address()
        tls = ["--tls-cert", str(client.cert), "--tls-key", str(client.key), "--tls-ca", str(client.ca)]
        ok = await meshllm("health", address, *tls, env={"MESHLLM_TLS_CERT": "", "MESHLLM_TLS_KEY": "", "MESHLLM_TLS_CA": ""})
        assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
        plain = await meshllm("health", address, env={"MESHLLM_TLS_CERT": "", "MESHLLM_TLS_KEY": "", "MESHLLM_TLS_CA": ""})
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr and plain.stderr.count("\n") == 1, plain.stderr
        sec = MeshSecurity(tls=TlsConfig(cert=client.cert, key=client.key, ca=client.ca))
        async with ChannelCache(security=sec) as channels:
            chunks = [
                c
                async for c in WorkerClient(channels, address).generate(
                    {"request_id": "p", "token_ids": [3], "stop": {"max_tokens": 2}}
                )
            ]
        assert [t for c in chunks for t in c.get("token_ids", [])] == [4, 5]
        async with ChannelCache() as plaintext:
            with pytest.raises(Unavailable):
                await WorkerClient(plaintext, address).get_info(timeout_s=3)
    finally:
        await proc.stop()


@pytest.mark.parametrize(
    "command",
    [
        ["worker", "--engine", "sample", "--static"],
        ["router", "--static-workers", "127.0.0.1:1", "--static-endpoint", "a.b.c", "--model-name", "m"],
        ["frontend", "--static-workers", "127.0.0.1:1", "--static-endpoint", "a.b.c", "--model-name", "m"],
        ["run"],
    ],
    ids=["worker", "router", "frontend", "run"],
)
async def test_unusable_tls_files_stop_every_service_with_one_line(command: list[str], tmp_path: Path) -> None:
    ca = DevPki.create(tmp_path)
    a, b = ca.issue("a"), ca.issue("b")
    cases = [
        (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(a.key)], "cannot read"),
        (["--tls-cert", str(a.cert), "--tls-key", str(b.key)], "does not belong to the certificate"),
        (["--tls-cert", str(a.cert)], "--tls-cert and --tls-key must be given together"),
        (["--mesh-token", "short"], "--mesh-token is too short"),
    ]
    for flags, message in cases:
        proc = await meshllm(*command, *flags)
        assert proc.returncode == 2, (flags, proc.stderr)
        assert message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
