"""A fully secured mesh of real processes logs no secret (issue 36).

etcd with TLS, client certificates and a user; nats-server with TLS, client
certificates and a user whose password travels *inside the NATS URL*
(`nats://meshllm:PASSWORD@host`, the form that used to be logged as given);
a worker, a router process and a frontend with mTLS between them, a mesh
token on every internal call and two API keys on the public APIs. All run
at DEBUG. A few requests go through (chat, a stored response, a wrong key),
every process is stopped, and every line each one wrote is searched for
every secret: the API keys, the mesh token, the etcd and NATS passwords,
and the body of every private key file.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm.certs import make_dev_pki
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ETCD_USER, ETCD_PASSWORD = "meshllm", "etcd-pw-5d2f9c1a7b"
NATS_USER, NATS_PASSWORD = "meshllm", "nats-pw-8e41a07c3d"
MESH_TOKEN = "mesh-token-3b9d27e1f0c4a6"
KEY_A, KEY_B = "sk-team-a-7f3c9e21d4b80a56", "sk-team-b-02e6d8b4c1f9a375"


def call(url: str, body: dict[str, Any] | None, key: str | None, ca: Path) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60, context=ssl.create_default_context(cafile=str(ca))) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_a_secured_mesh_logs_none_of_its_secrets(tmp_path: Path) -> None:
    _, files = make_dev_pki(tmp_path / "pki", ["etcd", "nats", "worker", "router", "frontend"])
    async with (
        EtcdServer(tls=files["etcd"], users={ETCD_USER: ETCD_PASSWORD}) as etcd,
        NatsServer(tls=files["nats"], users={NATS_USER: NATS_PASSWORD}) as nats,
    ):
        nats_url = nats.url.replace("://", f"://{NATS_USER}:{NATS_PASSWORD}@", 1)

        def flags(role: str) -> list[str]:
            f = files[role]
            return [
                "--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--lease-ttl", "3",
                "--etcd-ca", str(f.ca), "--etcd-cert", str(f.cert), "--etcd-key", str(f.key), "--etcd-user", ETCD_USER,
                "--nats-url", nats_url, "--nats-ca", str(f.ca), "--nats-cert", str(f.cert), "--nats-key", str(f.key),
                "--tls-cert", str(f.cert), "--tls-key", str(f.key), "--tls-ca", str(f.ca),
            ]  # fmt: skip

        env = {
            "MESHLLM_LOG_LEVEL": "DEBUG",
            "MESHLLM_ETCD_PASSWORD": ETCD_PASSWORD,
            "MESHLLM_MESH_TOKEN": MESH_TOKEN,
            "MESHLLM_API_KEYS": f"team-a:{KEY_A},team-b:{KEY_B}",
        }
        procs: list[MeshllmProcess] = []
        try:
            worker = MeshllmProcess("worker", "--engine", "sample", "--port", "0", *flags("worker"), env=env)
            procs.append(worker)
            await worker.address()
            router = MeshllmProcess("router", "--port", "0", *flags("router"), env=env)
            procs.append(router)
            router_address = (await router.line()).rsplit(" ", 1)[-1]
            frontend = MeshllmProcess(
                "frontend", "--http-port", "0", "--grpc-port", "0", "--router-address", router_address,
                "--api-client-certs", "none", *flags("frontend"), env=env,
            )  # fmt: skip
            procs.append(frontend)
            line = await frontend.line()
            base = re.search(r"(https://\S+)/v1", line)
            assert base, line
            url, ca = base.group(1), files["frontend"].ca

            chat = {"model": "sample", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

            async def served() -> bool:
                return bool((await asyncio.to_thread(call, f"{url}/v1/models", None, KEY_A, ca))[1].get("data"))

            await wait_until(served, timeout_s=60)
            status, body = await asyncio.to_thread(call, f"{url}/v1/chat/completions", chat, KEY_A, ca)
            assert status == 200, body
            resp = {"model": "sample", "input": "hello", "max_output_tokens": 4}
            status, body = await asyncio.to_thread(call, f"{url}/v1/responses", resp, KEY_B, ca)
            assert status == 200, body
            status, _ = await asyncio.to_thread(call, f"{url}/v1/responses/{body['id']}", None, KEY_A, ca)
            assert status == 404  # another tenant's stored response
            status, _ = await asyncio.to_thread(call, f"{url}/v1/chat/completions", chat, KEY_A[::-1], ca)
            assert status == 401
        finally:
            logs = {}
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p, name in zip(procs, ["worker", "router", "frontend"], strict=False):
                await p.wait(30)
                logs[name] = p.stderr_tail(10_000_000)
                await p.stop()

    assert "discovery on etcd" in logs["worker"] and "connected to NATS at" in logs["worker"], logs["worker"][-3000:]
    assert f"nats://{NATS_USER}:***@" in logs["router"], "the NATS URL is shown, its password redacted"
    secrets = {
        "etcd password": ETCD_PASSWORD, "NATS password": NATS_PASSWORD, "mesh token": MESH_TOKEN,
        "API key A": KEY_A, "API key B": KEY_B,
    }  # fmt: skip
    for role, f in files.items():
        body = "".join(line for line in f.key.read_text().splitlines() if not line.startswith("-----"))
        secrets[f"{role} private key"] = body[10:50]
    for name, log in logs.items():
        assert log.count("\n") > 20, f"{name} logged almost nothing at DEBUG: {log}"
        for what, secret in secrets.items():
            assert secret not in log, f"the {what} appears in the {name}'s log"
