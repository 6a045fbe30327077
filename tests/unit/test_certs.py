"""`meshllm certs` and `make_dev_pki`: files, SANs, key usage, validity, permissions, refusal to overwrite."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from meshllm.certs import DevPki, compose_services, main, make_dev_pki
from meshllm.cli import main as cli_main

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose.yaml"


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def sans(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(ext.get_values_for_type(x509.DNSName)), {str(ip) for ip in ext.get_values_for_type(x509.IPAddress)}


def test_the_command_writes_a_ca_and_a_certificate_per_compose_service(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "certs"
    assert cli_main(["certs", "--out", str(out), "--compose", str(COMPOSE), "--host", "mesh.example", "--host", "10.0.0.7"]) == 0
    services = compose_services(COMPOSE)
    assert {"etcd", "nats", "router", "frontend", "prefill", "decode"} <= set(services)
    names = {p.name for p in out.iterdir()}
    assert names == {"ca.pem", "ca-key.pem"} | {f"{s}.pem" for s in services} | {f"{s}-key.pem" for s in services}
    ca = load(out / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for service, hostname in services.items():
        cert = load(out / f"{service}.pem")
        cert.verify_directly_issued_by(ca)
        dns, ips = sans(cert)
        assert {service, hostname, "localhost", "mesh.example"} <= dns
        assert {"127.0.0.1", "::1", "10.0.0.7"} <= ips
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        assert ku.digital_signature and not ku.key_cert_sign
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        now = datetime.datetime.now(datetime.UTC)
        assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc
        assert cert.not_valid_after_utc - now > datetime.timedelta(days=360)
        assert stat.S_IMODE((out / f"{service}-key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "ca-key.pem").stat().st_mode) == 0o600
    assert "created CA" in capsys.readouterr().out


def test_existing_files_are_not_overwritten_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--service", "router"]) == 0
    before = (tmp_path / "router.pem").read_bytes()
    capsys.readouterr()
    assert main(["--out", str(tmp_path), "--service", "router"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "router" in err and "--force" in err
    assert (tmp_path / "router.pem").read_bytes() == before
    # --force re-issues from the same CA: certificates rotate, trust stays.
    ca_before = (tmp_path / "ca.pem").read_bytes()
    assert main(["--out", str(tmp_path), "--service", "router", "--force"]) == 0
    assert (tmp_path / "router.pem").read_bytes() != before
    assert (tmp_path / "ca.pem").read_bytes() == ca_before
    load(tmp_path / "router.pem").verify_directly_issued_by(load(tmp_path / "ca.pem"))
    assert main(["--out", str(tmp_path), "--service", "other", "--new-ca"]) == 2  # the CA exists
    assert main(["--out", str(tmp_path), "--service", "other", "--new-ca", "--force"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() != ca_before


def test_bad_arguments_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--service", "a/b"]) == 2
    assert main(["--out", str(tmp_path), "--days", "0"]) == 2
    assert main(["--out", str(tmp_path), "--compose", str(tmp_path / "missing.yaml")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("meshllm certs: error: ") for line in lines)


def test_the_helper_makes_a_foreign_ca_and_an_expired_certificate(tmp_path: Path) -> None:
    pki, files = make_dev_pki(tmp_path / "a", ["worker"])
    other, _ = make_dev_pki(tmp_path / "b", ["worker"])
    expired = pki.issue("old", expired=True)
    ca = load(pki.ca_path)
    assert load(expired.cert).not_valid_after_utc < datetime.datetime.now(datetime.UTC)
    with pytest.raises(InvalidSignature):  # same CA name, another key
        load(files["worker"].cert).verify_directly_issued_by(load(other.ca_path))
    # The files are what ssl (and so grpc, nats-py) loads.
    ctx = ssl.create_default_context(cafile=str(files["worker"].ca))
    ctx.load_cert_chain(str(files["worker"].cert), str(files["worker"].key))
    assert isinstance(DevPki.load(tmp_path / "a").ca_key, ec.EllipticCurvePrivateKey)
    assert load(files["worker"].cert).issuer == ca.subject
    assert {ipaddress.ip_address("127.0.0.1")} <= {ipaddress.ip_address(i) for i in sans(load(files["worker"].cert))[1]}
