"""etcd and NATS secured (issue 13), against real servers.

etcd runs with TLS, --client-cert-auth and auth enabled; nats-server with
TLS (--tlsverify) and a token, users or NKeys.

The discovery and events planes work with the right credentials; every wrong
one (password, missing user, no client certificate, a certificate from
another CA, an expired one, plaintext against TLS, TLS against plaintext) is
refused at connect, quickly, with one line naming what to check.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import aetcd
import pytest

import meshllm.plane.backends  # noqa: F401  (registers the etcd and NATS openers)
from meshllm.certs import CertFiles, make_dev_pki
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.credentials import EtcdCredentials, NatsCredentials
from meshllm.errors import CannotConnect
from meshllm.plane.discovery.base import open_discovery
from meshllm.plane.discovery.etcd_client import SecureClient, is_invalid_token
from meshllm.plane.events.base import open_events
from meshllm.plane.events.nats import NatsEventBus
from meshllm.testing.servers import EtcdServer, NatsServer, nkey_user
from meshllm.testing.waiting import wait_until
from meshllm.v1 import discovery_pb2, events_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

USER, PASSWORD = "meshllm", "etcd-secret"
TOKEN = "nats-token-123"


@dataclass(frozen=True)
class Pki:
    etcd: CertFiles
    nats: CertFiles
    worker: CertFiles
    foreign: CertFiles  # same service name, another CA
    expired: CertFiles


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("pki")
    ca, files = make_dev_pki(base / "mesh", ["etcd", "nats", "worker"])
    _, foreign = make_dev_pki(base / "foreign", ["worker"])
    return Pki(files["etcd"], files["nats"], files["worker"], foreign["worker"], ca.issue("expired", expired=True))


def etcd_creds(pki: Pki, *, cert: CertFiles | None = None, ca: bool = True, **auth: str) -> EtcdCredentials:
    c = pki.worker if cert is None else cert
    return EtcdCredentials(ca=str(pki.worker.ca) if ca else "", cert=str(c.cert), key=str(c.key), **auth)


def nats_creds(pki: Pki, *, cert: CertFiles | None = None, ca: bool = True, **auth: str) -> NatsCredentials:
    c = pki.worker if cert is None else cert
    return NatsCredentials(ca=str(pki.worker.ca) if ca else "", cert=str(c.cert), key=str(c.key), **auth)


@pytest.fixture
async def secure_etcd(pki: Pki) -> AsyncIterator[EtcdServer]:
    async with EtcdServer(tls=pki.etcd, users={USER: PASSWORD}) as etcd:
        yield etcd


def etcd_plane(etcd: EtcdServer, credentials: EtcdCredentials) -> PlaneConfig:
    return PlaneConfig(discovery=DiscoveryKind.ETCD, etcd_endpoints=(etcd.endpoint,), lease_ttl_s=3, etcd_credentials=credentials)


def instance(id_: str) -> discovery_pb2.Instance:
    return discovery_pb2.Instance(component="worker", endpoint="generate", id=id_, address=f"127.0.0.1:{1000 + len(id_)}")


async def next_snapshot(watch: AsyncIterator[dict[str, discovery_pb2.Instance]], pred: object) -> dict[str, object]:
    async with asyncio.timeout(15):
        async for snap in watch:
            if pred(snap):  # type: ignore[operator]
                return dict(snap)
    raise AssertionError("watch ended")


async def test_discovery_works_over_tls_with_client_certificates_and_auth(pki: Pki, secure_etcd: EtcdServer) -> None:
    right = etcd_creds(pki, user=USER, password=PASSWORD)
    worker = await open_discovery(etcd_plane(secure_etcd, right))
    router = await open_discovery(replace(etcd_plane(secure_etcd, right), etcd_endpoints=(secure_etcd.url,)))  # https://
    try:
        watch = router.watch_instances()
        assert await next_snapshot(watch, lambda s: not s) == {}
        await worker.register_instance(instance("w1"))
        assert set(await next_snapshot(watch, lambda s: "w1" in s)) == {"w1"}
        await worker.unregister()
        assert await next_snapshot(watch, lambda s: not s) == {}
    finally:
        await worker.aclose()
        await router.aclose()


async def test_a_call_after_the_auth_token_expired_logs_in_again_and_succeeds(pki: Pki) -> None:
    """etcd forgets a token unused for --auth-token-ttl: the next call must log in again, not fail."""
    right = etcd_creds(pki, user=USER, password=PASSWORD)
    async with EtcdServer(tls=pki.etcd, users={USER: PASSWORD}, auth_token_ttl_s=1) as etcd:
        worker = await open_discovery(etcd_plane(etcd, right))  # logged in (token A), nothing registered: A goes unused
        probe = SecureClient("127.0.0.1", etcd.port, right, tls=True, timeout=3)  # token B, issued after A
        try:
            await probe.get(b"meshllm/x")

            async def probe_token_expired() -> bool:
                try:
                    await probe.get(b"meshllm/x")
                except aetcd.ClientError as exc:
                    return is_invalid_token(exc)
                return False

            # Polled less often than the token TTL: a successful poll would keep the token alive.
            await wait_until(probe_token_expired, timeout_s=15, interval_s=2.5, what="etcd to expire an idle token")
            await worker.register_instance(instance("w1"))  # token A is gone too: logs in again, then succeeds
            assert set(await worker.list_instances()) == {"w1"}
        finally:
            await probe.close()
            await worker.aclose()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong password", "authentication failed"),
        ("no user", "permission denied"),
        ("no client certificate", "TLS failed"),
        ("certificate of another CA", "TLS failed"),
        ("expired certificate", "TLS failed"),
        ("server not trusted", "TLS failed"),
        ("plaintext", "TLS failed"),
    ],
)
async def test_etcd_refuses_wrong_credentials_with_one_clear_line(
    pki: Pki, secure_etcd: EtcdServer, case: str, expected: str
) -> None:
    credentials = {
        "wrong password": etcd_creds(pki, user=USER, password="wrong"),
        "no user": etcd_creds(pki),
        "no client certificate": EtcdCredentials(ca=str(pki.worker.ca), user=USER, password=PASSWORD),
        "certificate of another CA": etcd_creds(pki, cert=pki.foreign, user=USER, password=PASSWORD),
        "expired certificate": etcd_creds(pki, cert=pki.expired, user=USER, password=PASSWORD),
        "server not trusted": etcd_creds(pki, ca=False, user=USER, password=PASSWORD),
        "plaintext": EtcdCredentials(user=USER, password=PASSWORD),
    }[case]
    t0 = time.monotonic()
    with pytest.raises(CannotConnect) as info:
        await open_discovery(etcd_plane(secure_etcd, credentials))
    assert time.monotonic() - t0 < 10
    message = info.value.message
    assert expected in message and "\n" not in message, message
    assert PASSWORD not in message


# ------------------------------------------------------------------ NATS


def events_plane(nats: NatsServer, credentials: NatsCredentials) -> PlaneConfig:
    return PlaneConfig(discovery=DiscoveryKind.STATIC, events=EventsKind.NATS, nats_url=nats.url, nats_credentials=credentials)


async def roundtrip(nats: NatsServer, credentials: NatsCredentials) -> None:
    """A message published by one bus reaches a subscriber on another."""
    sub_bus = await open_events(events_plane(nats, credentials), name="sub")
    pub_bus = await open_events(events_plane(nats, credentials), name="pub")
    try:
        sub = await sub_bus.subscribe("meshllm.test.load", events_pb2.LoadSnapshot)
        pub_bus.publish("meshllm.test.load", events_pb2.LoadSnapshot(worker_id="w1"))
        await pub_bus.flush(5)
        async with asyncio.timeout(10):
            got = await anext(aiter(sub))
        assert got.worker_id == "w1"
    finally:
        await pub_bus.aclose()
        await sub_bus.aclose()


@pytest.mark.parametrize("auth", ["token", "user", "nkey"])
async def test_events_work_over_tls_with_client_certificates_and_each_kind_of_auth(pki: Pki, tmp_path: Path, auth: str) -> None:
    seed = tmp_path / "user.nk"
    server_auth: dict[str, object] = {
        "token": {"token": TOKEN},
        "user": {"users": {"mesh": "nats-pw"}},
        "nkey": {"nkeys": [nkey_user(seed)]},
    }[auth]
    client_auth = {"token": {"token": TOKEN}, "user": {"user": "mesh", "password": "nats-pw"}, "nkey": {"nkey": str(seed)}}[auth]
    async with NatsServer(tls=pki.nats, **server_auth) as nats:  # type: ignore[arg-type]
        await roundtrip(nats, nats_creds(pki, **client_auth))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong token", "refused the credentials"),
        ("no token", "requires authentication"),
        ("no client certificate", "TLS with NATS"),
        ("certificate of another CA", "TLS with NATS"),
        ("expired certificate", "TLS with NATS"),
        ("server not trusted", "TLS with NATS"),
    ],
)
async def test_nats_refuses_wrong_credentials_with_one_clear_line(pki: Pki, case: str, expected: str) -> None:
    credentials = {
        "wrong token": nats_creds(pki, token="wrong"),
        "no token": nats_creds(pki),
        "no client certificate": NatsCredentials(ca=str(pki.worker.ca), token=TOKEN),
        "certificate of another CA": nats_creds(pki, cert=pki.foreign, token=TOKEN),
        "expired certificate": nats_creds(pki, cert=pki.expired, token=TOKEN),
        "server not trusted": nats_creds(pki, ca=False, token=TOKEN),
    }[case]
    async with NatsServer(tls=pki.nats, token=TOKEN) as nats:
        t0 = time.monotonic()
        with pytest.raises(CannotConnect) as info:
            await open_events(events_plane(nats, credentials))
        assert time.monotonic() - t0 < 8  # refused, not after the 10 s connect timeout (~1-5 s on 2 busy cores)
    message = info.value.message
    assert expected in message and "\n" not in message, message
    assert "wrong" not in message and TOKEN not in message  # no secret in the line


async def test_a_tls_client_never_falls_back_to_plaintext(pki: Pki) -> None:
    async with NatsServer(users={"mesh": "nats-pw"}) as nats:
        with pytest.raises(CannotConnect, match="secure connection not available"):
            await open_events(events_plane(nats, NatsCredentials(ca=str(pki.worker.ca), user="mesh", password="nats-pw")))
        await roundtrip(nats, NatsCredentials(user="mesh", password="nats-pw"))
        with pytest.raises(CannotConnect, match="--nats-user and its password"):
            await open_events(events_plane(nats, NatsCredentials(user="mesh", password="wrong")))


async def test_rotated_nats_client_certificates_are_used_at_the_next_reconnection(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = tmp_path / "client.pem", tmp_path / "client-key.pem"

    def install(files: CertFiles) -> None:
        for src, dst in ((files.key, key), (files.cert, cert)):
            dst.write_bytes(src.read_bytes())

    install(pki.worker)
    credentials = NatsCredentials(ca=str(pki.worker.ca), cert=str(cert), key=str(key), token=TOKEN)
    async with NatsServer(tls=pki.nats, token=TOKEN) as nats:
        bus = await NatsEventBus.connect(nats.url, credentials=credentials, reconnect_wait_s=0.1)
        try:
            install(pki.expired)  # the files now hold a certificate the server refuses
            await nats.restart()
            await wait_until(
                lambda: any("certificate" in r.getMessage() for r in caplog.records if r.name == "meshllm.plane.events.nats"),
                timeout_s=15,
                what="a reconnection refused for the expired certificate (the files were read again)",
            )
            assert not bus.connected
            install(pki.worker)  # fixed on disk: the next attempt uses it, no restart of ours
            await wait_until(lambda: bus.connected, timeout_s=15, what="the reconnection with the new files")
        finally:
            await bus.aclose()
