"""TLS for every gRPC hop: the certificate files, server and channel credentials, and their reload.

`--tls-cert` and `--tls-key` (PEM) turn TLS on for a process's servers and
clients; `--tls-ca` adds mutual TLS: servers then require a client
certificate signed by that CA, and clients verify servers against it (without
it, clients verify servers against the system's roots).

Rotation without restart: a server's credentials ask `TlsFiles.changed()` at
every handshake (grpc's `dynamic_ssl_server_credentials`), so a connection
made after the files change gets the new certificate; connections already up
keep theirs. Clients (`ChannelCache`) build new channels once the files change.
A half-written pair (the key does not match the certificate yet) is ignored
until it is complete: the last good one stays in use.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from meshllm.config import ConfigError

__all__ = [
    "TlsConfig",
    "TlsFiles",
    "TlsMaterial",
    "channel_credentials",
    "keep_reloaded",
    "server_credentials",
    "ssl_client_context",
    "ssl_server_context",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """The bytes of one consistent certificate, key and (optional) CA bundle."""

    cert: bytes
    key: bytes = b""
    ca: bytes | None = None

    def __repr__(self) -> str:  # never print a private key
        return f"TlsMaterial(cert={len(self.cert)} bytes, key=<hidden>, ca={None if self.ca is None else len(self.ca)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class TlsConfig:
    """Paths of a process's certificate, key and CA; checked when built (one-line errors)."""

    cert: Path
    key: Path
    ca: Path | None = None

    def __post_init__(self) -> None:
        TlsFiles(self).load()  # readable, PEM, key matches certificate

    @property
    def mutual(self) -> bool:
        """True when a CA is given: servers require client certificates from it."""
        return self.ca is not None

    @classmethod
    def from_values(cls, cert: str | None, key: str | None, ca: str | None) -> TlsConfig | None:
        """Build from the flag values; None when TLS is off (no flag given)."""
        cert, key, ca = (cert or "").strip(), (key or "").strip(), (ca or "").strip()
        if not (cert or key or ca):
            return None
        if not cert or not key:
            raise ConfigError("--tls-cert and --tls-key must be given together")
        return cls(cert=Path(cert).expanduser(), key=Path(key).expanduser(), ca=Path(ca).expanduser() if ca else None)


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read ({exc.strerror or exc})") from None


def _check(material: TlsMaterial, config: TlsConfig) -> None:
    """Raise ConfigError unless the bytes are PEM and the key belongs to the certificate."""
    try:
        cert = x509.load_pem_x509_certificates(material.cert)[0]
    except ValueError:
        raise ConfigError(f"--tls-cert {config.cert}: not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(material.key, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"--tls-key {config.key}: not an unencrypted PEM private key") from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, pub) != cert.public_key().public_bytes(
        serialization.Encoding.PEM, pub
    ):
        raise ConfigError(f"--tls-key {config.key} does not belong to the certificate in --tls-cert {config.cert}")
    if material.ca is not None:
        try:
            x509.load_pem_x509_certificates(material.ca)
        except ValueError:
            raise ConfigError(f"--tls-ca {config.ca}: not a PEM certificate bundle") from None


def _stamp(path: Path | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class TlsFiles:
    """The current material of a TlsConfig, re-read when a file changes (thread-safe)."""

    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._stamps: tuple[tuple[int, int, int] | None, ...] = ()
        self._bad: tuple[tuple[int, int, int] | None, ...] = ()
        self.material: TlsMaterial | None = None
        self.generation = 0  # bumped at every successful reload

    def _file_stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        return (_stamp(self.config.cert), _stamp(self.config.key), _stamp(self.config.ca))

    def load(self) -> TlsMaterial:
        """Read and check the files now (ConfigError when unusable)."""
        with self._lock:
            stamps = self._file_stamps()
            material = TlsMaterial(
                _read(self.config.cert, "--tls-cert"),
                _read(self.config.key, "--tls-key"),
                None if self.config.ca is None else _read(self.config.ca, "--tls-ca"),
            )
            _check(material, self.config)
            self.material, self._stamps = material, stamps
            self.generation += 1
            return material

    def changed(self) -> TlsMaterial | None:
        """The new material when the files changed since the last load and are consistent, else None."""
        stamps = self._file_stamps()
        if stamps == self._stamps or stamps == self._bad:
            return None
        try:
            material = self.load()
        except ConfigError as exc:
            if stamps != self._bad:
                log.warning("TLS files changed but are not usable yet, keeping the previous ones: %s", exc.message)
            self._bad = stamps
            return None
        log.info("TLS certificate reloaded from %s", self.config.cert)
        return material

    def current(self) -> TlsMaterial:
        """The material in use (loaded on first call)."""
        return self.material if self.material is not None else self.load()


def _server_cert_config(material: TlsMaterial) -> object:
    return grpc.ssl_server_certificate_configuration([(material.key, material.cert)], root_certificates=material.ca)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that pick up changed files at the next handshake; mTLS when a CA is set."""
    initial = _server_cert_config(files.current())

    def fetch() -> object | None:
        # Called by grpc at every handshake (from its own threads): stat, reload on change.
        try:
            material = files.changed()
        except Exception as exc:  # never fail a handshake over a reload
            log.warning("TLS reload failed: %s", exc)
            return None
        return None if material is None else _server_cert_config(material)

    return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=files.config.mutual)


def channel_credentials(material: TlsMaterial) -> grpc.ChannelCredentials:
    """Client credentials: verify servers against the CA (or the system roots), present our certificate."""
    return grpc.ssl_channel_credentials(root_certificates=material.ca, private_key=material.key, certificate_chain=material.cert)


# ---------------------------------------------------------------- HTTPS (the frontend's HTTP API)


def _load_into(ctx: ssl.SSLContext, material: TlsMaterial) -> None:
    # ssl loads certificate chains from files only: write the checked bytes to a private temp dir.
    with tempfile.TemporaryDirectory(prefix="meshllm-tls-") as tmp:
        cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert.write_bytes(material.cert)
        key.touch(0o600)
        key.write_bytes(material.key)
        ctx.load_cert_chain(cert, key)
    if material.ca is not None:
        ctx.load_verify_locations(cadata=material.ca.decode())


def ssl_client_context(material: TlsMaterial) -> ssl.SSLContext:
    """A client SSLContext as `channel_credentials`: verify the server against the CA (or the system roots), present
    our certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_into(ctx, material)
    if material.ca is None:
        ctx.load_default_certs()
    return ctx


def ssl_server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server SSLContext from the files: client certificates required when a CA is set."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    material = files.current()
    _load_into(ctx, material)
    if material.ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def keep_reloaded(ctx: ssl.SSLContext, files: TlsFiles, *, interval_s: float = 1.0) -> None:
    """Load changed files into `ctx` until cancelled: handshakes after a change use the new certificate."""
    while True:
        await asyncio.sleep(interval_s)  # a poll period, not a synchronisation
        material = files.changed()
        if material is not None:
            try:
                _load_into(ctx, material)
            except (ssl.SSLError, OSError) as exc:
                log.warning("HTTPS certificate reload failed, keeping the previous one: %s", exc)
