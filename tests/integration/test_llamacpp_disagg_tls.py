"""Disaggregated llama.cpp over mTLS: the decode worker pulls the prefill worker's KV (`Worker.PullKv`) with its certificate.

Both workers are real processes started with `--tls-cert/--tls-key/--tls-ca`
and a mesh token; the router and the client use their own certificates. A
prompt routed prefill → decode finishes, so the worker → worker PullKv call
passed the handshake and the token check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_llamacpp_support import collect, greedy, question, require_model, start_worker, tokens_of

from meshllm.certs import CertFiles, DevPki
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.plane.auth import MeshSecurity
from meshllm.plane.request.channels import ChannelCache
from meshllm.plane.tls import TlsConfig
from meshllm.router.client import RouterClient
from meshllm.router.config import RouterConfig, StaticEndpoint
from meshllm.router.main import RouterServer
from meshllm.worker.client import WorkerClient

require_model()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

ENGINE = ("--n-ctx", "512", "--n-seq-max", "1", "--n-batch", "64")
TOKEN = "disagg-mesh-token-0123456789"


def flags(leaf: CertFiles) -> tuple[str, ...]:
    return ("--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key), "--tls-ca", str(leaf.ca), "--mesh-token", TOKEN)


def security(leaf: CertFiles) -> MeshSecurity:
    return MeshSecurity(tls=TlsConfig(cert=leaf.cert, key=leaf.key, ca=leaf.ca), token=TOKEN)


async def test_kv_travels_between_workers_over_mtls(tmp_path: Path) -> None:
    ca = DevPki.create(tmp_path)
    prefill, p_addr = await start_worker("prefill", *ENGINE, *flags(ca.issue("prefill")))
    decode, d_addr = await start_worker("decode", *ENGINE, *flags(ca.issue("decode")))
    channels = ChannelCache(security=security(ca.issue("client")))
    router = None
    try:
        model = (await WorkerClient(channels, d_addr).get_info()).model_card.name
        router = await RouterServer.start(
            RouterConfig(
                plane=PlaneConfig(discovery=DiscoveryKind.STATIC, events=EventsKind.NONE),
                static_endpoint=StaticEndpoint.parse("meshllm.worker.generate"),
                static_workers=(p_addr, d_addr),
                model_name=model,
                security=security(ca.issue("router")),
            )
        )
        core = router.core
        assert core is not None
        await core.pool.wait_until(lambda: len(core.pool.all()) == 2, 60)
        chunks = await collect(RouterClient(channels, router.address).generate(greedy("tls-0", question("Hi?"), 4, model=model)))
        assert chunks[-1]["finish_reason"] in ("eos", "length"), chunks[-1]
        assert tokens_of(chunks)
        prefill_legs = core.metrics.registry.get_sample_value(
            "meshllm_router_decisions_total", {"router_id": core.id, "policy": core.mode.value, "role": "prefill"}
        )
        assert prefill_legs == 1  # prefill worker → decode worker, the KV pulled over mTLS
    finally:
        if router is not None:
            await router.aclose()
        await channels.aclose()
        await prefill.stop()
        await decode.stop()
