"""nats-py's client made strict about TLS (never plaintext when TLS is configured, files read at every connection),
and what a refused connection means: `is_refusal` and the one line naming the flags to check."""

from __future__ import annotations

import logging
import ssl
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from meshllm.credentials import NatsCredentials
from meshllm.errors import MeshError
from meshllm.logs import redact_text

__all__ = ["SecureClient", "is_refusal", "refusal_message"]

log = logging.getLogger("meshllm.plane.events.nats")

_REFUSALS = ("authorization violation", "authentication", "user authentication expired")


class _SslEofNoise(logging.Filter):
    """Drops asyncio's "returning true from eof_received() has no effect when using ssl".

    asyncio logs it at warning whenever a TLS peer closes a stream connection
    (nats-py's transport); it is harmless and would otherwise precede every
    NATS-over-TLS disconnect, including a refused login.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_SslEofNoise())


class SecureClient(Client):
    """nats-py's client: TLS only when configured, TLS files read again at every (re)connection.

    nats-py upgrades to TLS only when the server's INFO asks for it, so a
    client holding a CA and certificate would otherwise talk (and send its
    credentials) in plaintext to a server without TLS.
    """

    require_tls = False
    credentials: NatsCredentials | None = None

    @property
    def ssl_context(self) -> ssl.SSLContext:
        # Rebuilt per handshake so certificates rotated on disk are used at the
        # next reconnection; a half-written pair keeps the previous context.
        if self.credentials is not None and self.credentials.tls:
            try:
                ctx = self.credentials.ssl_context()
            except MeshError as exc:
                log.warning("events: NATS TLS files unusable (%s); keeping the previous ones", exc.message)
            else:
                if ctx is not None:
                    self.options["tls"] = ctx
        return super().ssl_context

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if self.require_tls and initial_connection and not info.get("tls_required"):
            raise nats.errors.SecureConnWantedError()
        await super()._process_info(info, initial_connection)


def is_refusal(exc: BaseException) -> bool:
    """The server refused who we are or the TLS handshake failed: retrying cannot help."""
    if isinstance(exc, (ssl.SSLError, nats.errors.AuthorizationError, nats.errors.SecureConnWantedError)):
        return True
    if isinstance(exc, (nats.errors.SecureConnRequiredError, nats.errors.InvalidUserCredentialsError)):
        return True
    return isinstance(exc, nats.errors.Error) and any(r in str(exc).lower() for r in _REFUSALS)


def refusal_message(url: str, exc: BaseException, credentials: NatsCredentials) -> str:
    detail = redact_text(str(exc)) or type(exc).__name__
    if isinstance(exc, ssl.SSLError) or isinstance(exc, (nats.errors.SecureConnWantedError, nats.errors.SecureConnRequiredError)):
        return f"TLS with NATS at {url} failed ({detail}): check --nats-ca, --nats-cert and --nats-key against the server's TLS"
    if credentials.token:
        hint = "check --nats-token (or MESHLLM_NATS_TOKEN / --nats-token-file)"
    elif credentials.user:
        hint = "check --nats-user and its password (MESHLLM_NATS_PASSWORD or --nats-password-file)"
    elif credentials.creds:
        hint = "check --nats-creds"
    elif credentials.nkey:
        hint = "check --nats-nkey"
    else:
        hint = "the server requires authentication: set --nats-token, --nats-user, --nats-creds or --nats-nkey"
    return f"NATS at {url} refused the credentials ({detail}): {hint}"
