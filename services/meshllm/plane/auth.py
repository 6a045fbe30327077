"""Who may call the mesh's internal services, and who a caller is.

`MeshSecurity` is one process's settings (`--tls-cert/--tls-key/--tls-ca`,
`--mesh-token`/`--mesh-token-file`, with `MESHLLM_*` variables):

- With mutual TLS (`--tls-ca`), the handshake admits only certificates from
  the mesh CA: every connected peer is a mesh peer, its certificate subject
  its identity.
- With a mesh token, every mesh client sends it as `meshllm-mesh-token`
  metadata and `MeshAuth` (a server interceptor) refuses calls to the internal
  services (`meshllm.v1.Worker`, `meshllm.v1.Router`) without it
  (UNAUTHENTICATED; constant-time compare). Health and reflection stay open.
- With neither, the internal services are open (as before; docs/security.md).

`caller_identity` names the caller of a call (certificate subject, token
holder or anonymous, plus the caller's process instance id) so that request
ids are scoped to their caller: a worker aborts a request only for the caller
that started it.
"""

from __future__ import annotations

import argparse
import contextvars
import hmac
import ssl
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from meshllm.config import ConfigError, EnvArgumentParser
from meshllm.plane.request.transport import HandlerInterceptor
from meshllm.plane.tls import TlsConfig, TlsFiles, channel_credentials, ssl_client_context

__all__ = [
    "CALLER_HEADER",
    "MESH_SERVICES",
    "TOKEN_HEADER",
    "ClientSecurity",
    "MeshAuth",
    "MeshSecurity",
    "add_security_args",
    "caller_identity",
    "client_interceptors",
    "session_scope",
]

TOKEN_HEADER = "meshllm-mesh-token"
CALLER_HEADER = "meshllm-caller"
MESH_SERVICES = ("/meshllm.v1.Worker/", "/meshllm.v1.Router/")

# The caller of the Generate session being served (set by the servicer for the
# session's tasks): a session's streams belong to the session's caller.
session_scope: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshllm_session_scope", default=None)


def _check_token(token: str, what: str) -> str:
    if not token:
        raise ConfigError(f"{what} is empty")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ConfigError(f"{what} must be printable ASCII without spaces")
    if len(token) < 16:
        raise ConfigError(f"{what} is too short (16 characters at least)")
    return token


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshSecurity:
    """TLS files and mesh token of one process (both optional: nothing = open plaintext, as before)."""

    tls: TlsConfig | None = None
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.token is not None:
            _check_token(self.token, "--mesh-token")

    @property
    def enabled(self) -> bool:
        return self.tls is not None or self.token is not None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> MeshSecurity:
        """Build from the flags added by `add_security_args` (files are read and checked now)."""
        token = (ns.mesh_token or "").strip() or None
        token_file = (ns.mesh_token_file or "").strip()
        if token and token_file:
            raise ConfigError("give --mesh-token or --mesh-token-file, not both")
        if token_file:
            path = Path(token_file).expanduser()
            try:
                token = _check_token(path.read_text().strip(), f"--mesh-token-file {path}")
            except OSError as exc:
                raise ConfigError(f"--mesh-token-file {path}: cannot read ({exc.strerror or exc})") from None
            except UnicodeDecodeError:
                raise ConfigError(f"--mesh-token-file {path} is not text") from None
        return cls(tls=TlsConfig.from_values(ns.tls_cert, ns.tls_key, ns.tls_ca), token=token)


def add_security_args(
    parser: EnvArgumentParser | argparse.ArgumentParser,
    *,
    tls: str = "TLS on every gRPC server and client of this process",
    tls_ca: str = "clients need a certificate from it; servers are verified against it",
    mesh_token: str = "shared secret of the mesh: internal RPCs without it are refused",
) -> None:
    """The TLS and mesh-token flags every gRPC service shares; each says what they cover on it (the docs' meanings)."""
    g = parser.add_argument_group("security")
    g.add_argument(
        "--tls-cert", default="",
        help=f"PEM certificate and key: {tls}; reloaded when the files change ([security.md](security.md#tls-and-mtls))",
    )  # fmt: skip
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default="", help=f"PEM CA bundle: mutual TLS — {tls_ca}")
    g.add_argument("--mesh-token", default="", help=f"{mesh_token} ([security.md](security.md#control-rpcs))")
    g.add_argument("--mesh-token-file", default="", help="file holding the mesh token (instead of --mesh-token)")


# ---------------------------------------------------------------- server side


def caller_identity(context: grpc.aio.ServicerContext) -> str:
    """Who made this call: `<principal>/<caller instance>`.

    The principal is `cert:<subject>` under mutual TLS, `token` for a caller
    that sent the mesh token, else `anonymous`. The instance is the
    `meshllm-caller` metadata a mesh client sends (one random id per client
    process), so two processes sharing a certificate or a token are apart.
    """
    caller = token = ""
    for key, value in context.invocation_metadata() or ():
        if key == CALLER_HEADER:
            caller = value if isinstance(value, str) else value.decode(errors="replace")
        elif key == TOKEN_HEADER:
            token = "token"
    principal = "anonymous"
    auth = context.auth_context() or {}
    names = auth.get("x509_subject") or auth.get("x509_common_name")
    if names:
        principal = "cert:" + b",".join(names).decode(errors="replace")
    elif token:
        principal = "token"
    return f"{principal}/{caller}"


def _denied(kind: str) -> Callable[..., Any]:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this service accepts only mesh peers: missing or wrong mesh token")

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this service accepts only mesh peers: missing or wrong mesh token")
        yield  # pragma: no cover - makes this an async generator, as grpc expects for streams

    return deny_stream if kind.endswith("stream") else deny


class MeshAuth(HandlerInterceptor):
    """Refuses calls to the mesh's internal services that lack the mesh token (UNAUTHENTICATED)."""

    def __init__(self, token: str, services: Iterable[str] = MESH_SERVICES) -> None:
        self._token = token.encode()
        self._services = tuple(services)

    def _allowed(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        sent = b""
        for key, value in metadata or ():
            if key == TOKEN_HEADER:
                sent = value.encode() if isinstance(value, str) else bytes(value)
        return hmac.compare_digest(sent, self._token)

    def intercept(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if not details.method.startswith(self._services) or self._allowed(details.invocation_metadata):
            return handler
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            if getattr(handler, kind) is not None:
                return handler._replace(**{kind: _denied(kind)})
        return handler


# ---------------------------------------------------------------- client side


def _with_metadata(details: Any, extra: tuple[tuple[str, str], ...]) -> Any:
    metadata = grpc.aio.Metadata(*extra) if details.metadata is None else details.metadata
    if details.metadata is not None:
        for key, value in extra:
            metadata.add(key, value)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)


class _Metadata:
    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self._extra = extra

    async def _intercept(self, continuation: Any, details: Any, request_or_iterator: Any) -> Any:
        return await continuation(_with_metadata(details, self._extra), request_or_iterator)


# grpc.aio files an interceptor under the first of the four kinds it is an instance of: one class per kind, each
# with the same method under its kind's name (grpc passes its arguments by position).
class _UnaryUnary(_Metadata, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    intercept_unary_unary = _Metadata._intercept


class _UnaryStream(_Metadata, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    intercept_unary_stream = _Metadata._intercept


class _StreamUnary(_Metadata, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    intercept_stream_unary = _Metadata._intercept


class _StreamStream(_Metadata, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    intercept_stream_stream = _Metadata._intercept


def client_interceptors(security: MeshSecurity | None, caller_id: str | None = None) -> list[Any]:
    """Interceptors adding the mesh token and this client's instance id to every call (none without a token)."""
    if security is None or security.token is None:
        return []
    extra = ((TOKEN_HEADER, security.token), (CALLER_HEADER, caller_id or uuid.uuid4().hex))
    return [kind(extra) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class ClientSecurity:
    """How a ChannelCache makes its channels secure: TLS credentials (rebuilt on file change) and the token."""

    CHECK_EVERY_S = 1.0  # how often `get` looks at the certificate files

    def __init__(self, security: MeshSecurity) -> None:
        self._files = TlsFiles(security.tls) if security.tls is not None else None
        self._credentials = channel_credentials(self._files.current()) if self._files is not None else None
        self.token = security.token
        self.caller_id = uuid.uuid4().hex  # the `meshllm-caller` of every call and session of this client
        self._interceptors = client_interceptors(security, self.caller_id)
        self._checked = time.monotonic()
        self._ssl: ssl.SSLContext | None = None  # for TCP sessions (plane/request/tcp_session.py), made on first use

    def rotated(self) -> bool:
        """True (once) when the certificate files changed: channels made from now on use the new ones."""
        if self._files is None or time.monotonic() - self._checked < self.CHECK_EVERY_S:
            return False
        self._checked = time.monotonic()
        material = self._files.changed()
        if material is None:
            return False
        self._credentials = channel_credentials(material)
        self._ssl = None
        return True

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of TCP sessions (None without TLS), from the current certificate files."""
        if self._files is None:
            return None
        if self._ssl is None:
            self._ssl = ssl_client_context(self._files.current())
        return self._ssl

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=self._interceptors)
        return grpc.aio.secure_channel(address, self._credentials, options=options, interceptors=self._interceptors)
