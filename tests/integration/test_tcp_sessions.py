"""Generate sessions on TCP across real processes: frontend → router → workers, every hop on its session port.

`meshllm worker --session-port 0` and `meshllm router --session-port 0` register their TCP session addresses in a
real etcd; the router learns the workers' with the workers, the frontend its `--router-address`'s from the
router's record. Locks: completions stream through both hops, each hop's client holds an established connection
to the next one's session port (nothing went over a GenerateSession call instead), and the same mesh with mTLS and
a mesh token on every process does the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from net_support import holds_connection

from meshllm.certs import DevPki
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.plane.auth import MeshSecurity
from meshllm.plane.discovery.base import open_discovery
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.tls import TlsConfig
from meshllm.testing.mesh import ProcessMesh, stream_completion
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until
from meshllm.worker.client import WorkerClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = "tcp-sessions-test-token-0123456789"


def tls_flags(pki: DevPki, name: str) -> list[str]:
    f = pki.issue(name)
    return ["--tls-cert", str(f.cert), "--tls-key", str(f.key), "--tls-ca", str(f.ca), "--mesh-token", TOKEN]


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "mtls+token"])
async def test_completions_stream_through_router_and_workers_over_tcp_sessions(
    secure: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = DevPki.create(tmp_path) if secure else None
    if pki is not None:
        monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_path))  # this test's HTTPS client trusts the dev CA
    sec = (lambda name: tls_flags(pki, name)) if pki is not None else (lambda name: [])
    async with EtcdServer() as etcd, NatsServer() as nats, ProcessMesh(etcd.endpoint, nats.url) as procs:
        workers = [await procs.worker(f"w{i}", "--session-port", "0", *sec(f"worker{i}")) for i in range(2)]
        router, router_address = await procs.router("--session-port", "0", "--router-mode", "round-robin", *sec("router"))
        api = ["--api-client-certs", "none"] if secure else []  # the HTTP API: TLS alone, as for public clients
        _, url = await procs.frontend("--router-address", router_address, *sec("frontend"), *api)

        client_sec = None
        if pki is not None:
            f = pki.issue("probe")
            client_sec = MeshSecurity(tls=TlsConfig(cert=f.cert, key=f.key, ca=f.ca), token=TOKEN)
        async with ChannelCache(security=client_sec) as channels:
            sessions = [(await WorkerClient(channels, a).get_info(timeout_s=10)).instance.session_address for _, a in workers]
        assert all(sessions) and len(set(sessions)) == 2, sessions

        body = {"model": "mocker", "prompt": "one two three four five six seven", "max_tokens": 24, "ignore_eos": True}
        done = []

        async def served() -> bool:  # the frontend and router see their peers asynchronously (etcd watches)
            result = await stream_completion(url, body, timeout_s=30)
            done.append(result)
            return result.ok

        await wait_until(served, timeout_s=60, what="a completion through the mesh")
        for _ in range(4):
            result = await stream_completion(url, body, timeout_s=30)
            assert result.ok and result.usage is not None and result.usage["completion_tokens"] == 24, result
        # Round-robin put requests on both workers: the router holds a session connection to each one's TCP port.
        for address in sessions:
            assert holds_connection(router.proc.pid, address), address
        frontend = procs.procs[-1]
        plane = PlaneConfig(discovery=DiscoveryKind.ETCD, etcd_endpoints=(etcd.endpoint,), events=EventsKind.NONE)
        async with await open_discovery(plane) as discovery:
            (record,) = (await discovery.list_instances("router")).values()
        assert record.address == router_address and record.session_address, record
        assert holds_connection(frontend.proc.pid, record.session_address), record.session_address
