"""`meshllm certs`: a development CA and one certificate per service, so a secure mesh is one command away.

    meshllm certs --out ./certs            # CA + a certificate for every service of deploy/compose.yaml
    meshllm certs --out ./certs --service worker-7 --host 10.0.0.7 --force

Files (PEM), named predictably in `--out`: `ca.pem` and `ca-key.pem` (the
CA), `<service>.pem` and `<service>-key.pem` for each service. Private keys
are written 0600. Each service certificate is valid for both TLS server and
client authentication (the mesh uses one certificate per process for both
directions) and names in its subjectAltName the service, its compose
hostname, `localhost`, `127.0.0.1` and `::1`, plus every `--host`.

An existing CA in `--out` is reused (new service certificates chain to the
CA the mesh already trusts, which is how certificates are rotated); existing
service files are not overwritten unless `--force`; `--new-ca` replaces the
CA too (needs `--force` when one exists). Keys are ECDSA P-256.

`make_dev_pki` and `DevPki` are the same machinery for tests: a CA, service
certificates, a second unrelated CA, an expired certificate.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshllm.lifecycle import command_error

__all__ = [
    "DEFAULT_SERVICES",
    "CertFiles",
    "DevPki",
    "compose_services",
    "main",
    "make_dev_pki",
    "san_hosts",
]

# Used when no compose file is found: the processes of deploy/compose.yaml.
DEFAULT_SERVICES = ("etcd", "nats", "router", "prefill", "decode", "frontend")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 365
CA_DAYS = 3650
_BACKDATE = datetime.timedelta(minutes=5)  # tolerate clocks a little behind the issuer's


class CertsError(Exception):
    """A one-line reason `meshllm certs` cannot do what it was asked."""


@dataclass(frozen=True, slots=True)
class CertFiles:
    """Paths of one issued certificate, its key and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshllm"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def san_hosts(service: str, extra: Iterable[str] = (), *, hostname: str | None = None) -> list[str]:
    """The subjectAltName entries of a service certificate, in order, without duplicates."""
    hosts = [service, *([hostname] if hostname else []), *LOCAL_HOSTS, *extra]
    return list(dict.fromkeys(h for h in hosts if h))


def _general_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write(path: Path, data: bytes, *, private: bool, force: bool) -> None:
    """Write `data` to `path` (0600 for a key); refuses an existing file unless `force`.

    Written to a temporary file and renamed, so a reader never sees half a
    file and a key is never readable by others, not even for a moment.
    """
    if path.exists() and not force:
        raise CertsError(f"{path} exists (use --force to overwrite)")
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signing only: certificates and CRLs for the CA, TLS handshakes (ECDSA) for a service."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


class DevPki:
    """A CA kept in `directory` (`ca.pem`, `ca-key.pem`) that issues service certificates into it."""

    def __init__(self, directory: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey) -> None:
        self.directory = directory
        self.ca_cert = ca_cert
        self.ca_key = ca_key

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.pem"

    @classmethod
    def create(
        cls, directory: str | os.PathLike[str], *, common_name: str = "meshllm development CA", force: bool = False
    ) -> DevPki:
        """A new CA written to `directory` (created if needed)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        key = _new_key()
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        _write(path / "ca-key.pem", _pem_key(key), private=True, force=force)
        _write(path / "ca.pem", _pem_cert(cert), private=False, force=force)
        return cls(path, cert, key)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> DevPki:
        """The CA already in `directory`."""
        path = Path(directory)
        try:
            cert = x509.load_pem_x509_certificate((path / "ca.pem").read_bytes())
            key = serialization.load_pem_private_key((path / "ca-key.pem").read_bytes(), password=None)
        except (OSError, ValueError) as exc:
            raise CertsError(f"cannot read the CA in {path}: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CertsError(f"{path / 'ca-key.pem'} is not an EC key")
        return cls(path, cert, key)

    def issue(
        self,
        name: str,
        *,
        hosts: Iterable[str] | None = None,
        days: float = DEFAULT_DAYS,
        expired: bool = False,
        server: bool = True,
        client: bool = True,
        force: bool = False,
    ) -> CertFiles:
        """Issue `<name>.pem` / `<name>-key.pem`, signed by this CA.

        `hosts` are the subjectAltNames (default: `san_hosts(name)`); `expired`
        makes a certificate whose validity ended an hour ago (for tests).
        """
        if not name or "/" in name or name.startswith(".") or name in ("ca", "ca-key"):
            raise CertsError(f"service name {name!r} cannot name a certificate file")
        key = _new_key()
        now = _now()
        if expired:
            start, end = now - datetime.timedelta(days=2), now - datetime.timedelta(hours=1)
        else:
            start, end = now - _BACKDATE, now + datetime.timedelta(days=days)
        usages = [*([ExtendedKeyUsageOID.SERVER_AUTH] if server else []), *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])]
        if not usages:
            raise CertsError("a certificate needs server or client usage")
        ca_ski = self.ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self.ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.SubjectAlternativeName(_general_names(san_hosts(name) if hosts is None else hosts)), critical=False
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(self.ca_key, hashes.SHA256())
        )
        files = CertFiles(cert=self.directory / f"{name}.pem", key=self.directory / f"{name}-key.pem", ca=self.ca_path)
        _write(files.key, _pem_key(key), private=True, force=force)
        _write(files.cert, _pem_cert(cert), private=False, force=force)
        return files


def make_dev_pki(
    directory: str | os.PathLike[str],
    services: Sequence[str] = DEFAULT_SERVICES,
    *,
    hosts: Iterable[str] = (),
    hostnames: dict[str, str] | None = None,
    days: float = DEFAULT_DAYS,
    force: bool = False,
    new_ca: bool = False,
) -> tuple[DevPki, dict[str, CertFiles]]:
    """A CA (reused from `directory` when there is one, unless `new_ca`) and a certificate per service.

    Each service's SANs are `san_hosts(service, hosts, hostname=hostnames[service])`.
    Raises CertsError when a file exists and `force` is false.
    """
    path = Path(directory)
    if not force:  # check everything first: refuse before writing anything
        for service in services:
            for existing in (path / f"{service}.pem", path / f"{service}-key.pem"):
                if existing.exists():
                    raise CertsError(f"{existing} exists (use --force to overwrite)")
    if not new_ca and (path / "ca.pem").exists() and (path / "ca-key.pem").exists():
        pki = DevPki.load(path)
    else:
        pki = DevPki.create(path, force=force)
    extra = list(hosts)
    names = hostnames or {}
    issued = {
        s: pki.issue(s, hosts=san_hosts(s, extra, hostname=names.get(s)), days=days, force=force) for s in dict.fromkeys(services)
    }
    return pki, issued


def compose_services(path: str | os.PathLike[str]) -> dict[str, str]:
    """{service: hostname} of a compose file (the hostname is the service name when none is set)."""
    import yaml  # only `meshllm certs` reads YAML

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CertsError(f"cannot read {path}: {exc}") from exc
    services = doc.get("services") if isinstance(doc, dict) else None
    if not isinstance(services, dict) or not services:
        raise CertsError(f"{path} names no services")
    return {str(name): str((spec or {}).get("hostname") or name) for name, spec in services.items()}


def _arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshllm certs",
        description="Create a development CA and a server+client certificate per service (ECDSA P-256, PEM).",
    )
    parser.add_argument("--out", default="certs", help="output directory (default: ./certs)")
    parser.add_argument(
        "--compose",
        default=None,
        help="compose file whose services get certificates (default: deploy/compose.yaml when it exists)",
    )
    parser.add_argument(
        "--service",
        action="append",
        default=None,
        help="a service to issue a certificate for (repeatable; replaces the compose file's list)",
    )
    parser.add_argument("--host", action="append", default=[], help="an extra DNS name or IP for every certificate (repeatable)")
    parser.add_argument(
        "--days", type=float, default=DEFAULT_DAYS, help=f"validity of service certificates (default {DEFAULT_DAYS})"
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing certificate and key files")
    parser.add_argument("--new-ca", action="store_true", help="create a new CA even when --out holds one (needs --force then)")
    return parser


def _services(ns: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    if ns.service:
        return list(ns.service), {}
    compose = ns.compose if ns.compose is not None else ("deploy/compose.yaml" if Path("deploy/compose.yaml").exists() else None)
    if compose is None:
        return list(DEFAULT_SERVICES), {}
    found = compose_services(compose)
    return list(found), found


def main(argv: Sequence[str]) -> int:
    """`meshllm certs [--out DIR] [--service NAME ...] [--host H ...] [--days N] [--force] [--new-ca]`."""
    ns = _arg_parser().parse_args(list(argv))
    try:
        if ns.days <= 0:
            raise CertsError(f"--days must be positive, got {ns.days:g}")
        services, hostnames = _services(ns)
        out = Path(ns.out)
        reused = not ns.new_ca and (out / "ca.pem").exists() and (out / "ca-key.pem").exists()
        _, issued = make_dev_pki(
            out, services, hosts=ns.host, hostnames=hostnames, days=ns.days, force=ns.force, new_ca=ns.new_ca
        )
    except CertsError as exc:
        return command_error("certs", str(exc))
    except OSError as exc:
        return command_error("certs", f"{exc.strerror or exc}: {exc.filename or ns.out}")
    print(f"{'reused' if reused else 'created'} CA {out / 'ca.pem'}")
    for service, files in issued.items():
        print(f"  {service}: {files.cert} {files.key}")
    print("development certificates: keep ca-key.pem private; use a real CA in production")
    return 0
