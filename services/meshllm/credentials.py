"""How a process proves itself to etcd and NATS: TLS files, users, passwords, tokens, NKeys.

Both are parts of `PlaneConfig`, built at startup from flags and `MESHLLM_*`
variables (`add_etcd_args`, `add_nats_args`). Building them checks that every
file named is readable and that the combination makes sense, so a mistake
stops the process with one line before it connects anywhere. Secrets
(passwords, tokens) never appear in a repr or a log line: `describe()` says
what is configured without them.

Files are read again on every (re)connection, so certificates rotated on
disk are used by the next connection without a restart.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass, field
from typing import Any

import grpc

from meshllm.errors import ConfigError
from meshllm.flags import from_flags

__all__ = [
    "EtcdCredentials",
    "NatsCredentials",
    "add_etcd_args",
    "add_nats_args",
    "read_secret",
]


def _error(message: str) -> Exception:
    return ConfigError(message)


def _check_file(path: str, flag: str) -> None:
    if not path:
        return
    if not os.path.isfile(path):
        raise _error(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise _error(f"{flag} {path}: not readable")


def read_secret(value: str, path: str, *, flag: str) -> str:
    """A secret given directly (`value`, from a flag or variable) or as a file's first line (`path`)."""
    if value and path:
        raise _error(f"{flag} and {flag}-file are both set; give one")
    if not path:
        return value
    _check_file(path, f"{flag}-file")
    with open(path, encoding="utf-8") as f:
        secret = f.readline().strip()
    if not secret:
        raise _error(f"{flag}-file {path} is empty")
    return secret


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise _error(f"{flag} {path}: {exc.strerror or exc}") from exc


def _check_pair(cert: str, key: str, prefix: str) -> None:
    if bool(cert) != bool(key):
        raise _error(f"--{prefix}-cert and --{prefix}-key go together; give both or neither")
    _check_file(cert, f"--{prefix}-cert")
    _check_file(key, f"--{prefix}-key")


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdCredentials:
    """TLS files and user/password for etcd. Empty fields are off; TLS is on when a CA or a certificate is given."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        _check_file(self.ca, "--etcd-ca")
        _check_pair(self.cert, self.key, "etcd")
        if bool(self.user) != bool(self.password):
            raise _error("--etcd-user needs a password (MESHLLM_ETCD_PASSWORD or --etcd-password-file) and vice versa")

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC TLS credentials from the files as they are now (the system roots when no CA is given)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--etcd-ca") if self.ca else None,
            private_key=_read(self.key, "--etcd-key") if self.key else None,
            certificate_chain=_read(self.cert, "--etcd-cert") if self.cert else None,
        )

    def describe(self) -> str:
        """What is configured, for a log line (no secrets)."""
        parts = ["TLS" if self.tls else "plaintext"]
        if self.cert:
            parts.append("client certificate")
        if self.user:
            parts.append(f"user {self.user!r}")
        return ", ".join(parts)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EtcdCredentials:
        password = read_secret(ns.etcd_password, ns.etcd_password_file, flag="--etcd-password")
        return from_flags(cls, ns, prefix="etcd_", password=password)


@dataclass(frozen=True, kw_only=True, slots=True)
class NatsCredentials:
    """TLS files and one way of authenticating to NATS: a token, user/password, a creds file or an NKey seed file."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    token: str = field(default="", repr=False)
    user: str = ""
    password: str = field(default="", repr=False)
    creds: str = ""
    nkey: str = ""

    def __post_init__(self) -> None:
        _check_file(self.ca, "--nats-ca")
        _check_pair(self.cert, self.key, "nats")
        _check_file(self.creds, "--nats-creds")
        _check_file(self.nkey, "--nats-nkey")
        if bool(self.user) != bool(self.password):
            raise _error("--nats-user needs a password (MESHLLM_NATS_PASSWORD or --nats-password-file) and vice versa")
        methods = [
            name
            for name, on in (
                ("--nats-token", self.token),
                ("--nats-user", self.user),
                ("--nats-creds", self.creds),
                ("--nats-nkey", self.nkey),
            )
            if on
        ]
        if len(methods) > 1:
            raise _error(f"{' and '.join(methods)} are both set; NATS takes one way of authenticating")

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    @property
    def authenticates(self) -> bool:
        return bool(self.token or self.user or self.creds or self.nkey)

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context from the files as they are now, or None when TLS is not configured here."""
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca or None)
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise _error(f"NATS TLS files (--nats-ca/--nats-cert/--nats-key): {exc}") from exc
        return ctx

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's `Client.connect` (TLS and authentication)."""
        opts: dict[str, Any] = {}
        ctx = self.ssl_context()
        if ctx is not None:
            opts["tls"] = ctx
        if self.token:
            opts["token"] = self.token
        if self.user:
            opts["user"], opts["password"] = self.user, self.password
        if self.creds:
            opts["user_credentials"] = self.creds
        if self.nkey:
            opts["nkeys_seed"] = self.nkey
        return opts

    def describe(self) -> str:
        """What is configured, for a log line (no secrets)."""
        parts = ["TLS" if self.tls else "no client TLS"]
        if self.cert:
            parts.append("client certificate")
        if self.token:
            parts.append("token")
        if self.user:
            parts.append(f"user {self.user!r}")
        if self.creds:
            parts.append("creds file")
        if self.nkey:
            parts.append("NKey")
        return ", ".join(parts)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> NatsCredentials:
        return from_flags(
            cls, ns, prefix="nats_", token=read_secret(ns.nats_token, ns.nats_token_file, flag="--nats-token"),
            password=read_secret(ns.nats_password, ns.nats_password_file, flag="--nats-password"),
        )  # fmt: skip


_SECRET_HELP = "prefer the variable or the -file flag: a flag's value shows in ps"


def add_etcd_args(group: Any) -> None:
    """etcd TLS and auth flags (an argparse group of `add_plane_args`)."""
    _add_text_flags(
        group,
        {
            "--etcd-ca": "CA certificate (PEM) that signed etcd's certificate; turns TLS on",
            "--etcd-cert": "client certificate and key (PEM) for etcd's `--client-cert-auth`; turn TLS on",
            "--etcd-key": "private key (PEM) of --etcd-cert",
            "--etcd-user": "etcd user (etcd auth enabled); needs a password",
            "--etcd-password": "its password",
            "--etcd-password-file": "file whose first line is the password",
        },
    )


def add_nats_args(group: Any) -> None:
    """NATS TLS and auth flags (an argparse group of `add_plane_args`)."""
    _add_text_flags(
        group,
        {
            "--nats-ca": "CA certificate (PEM) that signed nats-server's; turns TLS on (never falls back to plaintext)",
            "--nats-cert": "client certificate and key (PEM) for nats-server `--tlsverify`; turn TLS on",
            "--nats-key": "private key (PEM) of --nats-cert",
            "--nats-token": "NATS token (one of token, user, creds, nkey)",
            "--nats-token-file": "file whose first line is the token",
            "--nats-user": "NATS user; needs a password",
            "--nats-password": "its password",
            "--nats-password-file": "file whose first line is the password",
            "--nats-creds": "NATS credentials file (user JWT + NKey seed; decentralised auth)",
            "--nats-nkey": "file holding a user NKey seed (`SU...`)",
        },
    )


def _add_text_flags(group: Any, helps: dict[str, str]) -> None:
    """Text flags that are unset when empty (their default), each with its help."""
    for flag, help_text in helps.items():
        group.add_argument(flag, default="", help=help_text)
