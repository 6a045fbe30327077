"""Frontend API keys: `--api-keys` / `--api-keys-file`, checked in constant time, named by a key id.

    --api-keys KEY[,ID:KEY...]      MESHLLM_API_KEYS        comma-separated
    --api-keys-file PATH            MESHLLM_API_KEYS_FILE   one KEY or ID:KEY a line, `#` comments
    --open-metrics                  MESHLLM_OPEN_METRICS    /metrics and /dashboard* need no key

With keys set, every route of the OpenAI HTTP API but `/health` and `/live`
(and `/metrics`, `/dashboard*` with `--open-metrics`) and every method of the
Inference gRPC API need `Authorization: Bearer KEY` (gRPC: the
`authorization` metadata). A key is known to metrics and logs only by its id:
the `ID:` of its entry, or a fingerprint (`key-` and 8 hex digits of a
SHA-256) that does not give the key back. Keys are at least `MIN_KEY_CHARS`
characters, which also keeps a fingerprint from being brute-forced back to
its key.

**Tenants.** A key's id is its *tenant*: the owner of what its requests
store (Responses API conversations) and the name every request carries down
the mesh (`tenant` annotation, metrics, traces). Without keys every request
belongs to one tenant, `ANONYMOUS`.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import enum
import hashlib
import hmac
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshllm.config import ConfigError

__all__ = [
    "ANONYMOUS",
    "MIN_KEY_CHARS",
    "ApiKey",
    "ApiKeys",
    "AuthFailure",
    "add_api_key_args",
    "api_keys_from_namespace",
    "bearer_token",
    "exposure_warning",
    "unauthorized_body",
]

MIN_KEY_CHARS = 16
ANONYMOUS = "anonymous"  # the one tenant of a frontend without API keys
_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Visible ASCII without ',' (the list separator): the characters a header value carries unchanged.
_KEY_RE = re.compile(r"[!-+\--~]+")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def fingerprint(secret: bytes) -> str:
    """A short, non-reversible name of a key for metrics: `key-` + 8 hex digits."""
    return "key-" + hashlib.sha256(b"meshllm-api-key\x00" + secret).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One accepted key: its id (safe to show) and the SHA-256 of the key (never shown)."""

    id: str
    digest: bytes = field(repr=False)


class AuthFailure(enum.Enum):
    """Why a request was refused; the value is the metrics label."""

    MISSING = "missing"
    INVALID = "invalid"

    @property
    def message(self) -> str:
        if self is AuthFailure.MISSING:
            return (
                "You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
                "(Authorization: Bearer YOUR_KEY)."
            )
        return "Incorrect API key provided."


class ApiKeys:
    """The accepted keys (empty = no authentication). Its repr names ids only."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self._keys = tuple(keys)
        ids = [k.id for k in self._keys]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ConfigError(f"API key id {dup!r} is given twice (or two keys are the same)")

    @classmethod
    def parse(cls, entries: Sequence[str], *, source: str) -> ApiKeys:
        """Entries `KEY` or `ID:KEY` (a key containing ':' needs an ID); ConfigError names `source`, never a key."""
        keys: list[ApiKey] = []
        for n, raw in enumerate(entries, 1):
            entry = raw.strip()
            where = f"{source} entry {n}"
            key_id, sep, secret = entry.partition(":")
            if not sep:
                key_id, secret = "", entry
            elif not _ID_RE.fullmatch(key_id):
                raise ConfigError(f"{where}: the key id before ':' must be 1-64 letters, digits, '-', '_' or '.'")
            if len(secret) < MIN_KEY_CHARS:
                raise ConfigError(
                    f"{where}: an API key must be at least {MIN_KEY_CHARS} characters (make one: openssl rand -hex 24)"
                )
            if not _KEY_RE.fullmatch(secret):
                raise ConfigError(f"{where}: an API key may hold visible ASCII characters only (no spaces or commas)")
            data = secret.encode()
            keys.append(ApiKey(id=key_id or fingerprint(data), digest=_digest(data)))
        return cls(keys)

    @classmethod
    def load(cls, keys: str = "", keys_file: str = "") -> ApiKeys:
        """The keys of `--api-keys` and `--api-keys-file` together; a named file must exist and list a key."""
        entries = [e for e in keys.split(",") if e.strip()]
        found = cls.parse(entries, source="--api-keys (MESHLLM_API_KEYS)")._keys
        if keys_file:
            try:
                text = Path(keys_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                raise ConfigError(f"--api-keys-file {keys_file!r}: cannot read it: {reason}") from None
            lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
            if not lines:
                raise ConfigError(f"--api-keys-file {keys_file!r} lists no key (one KEY or ID:KEY a line)")
            found += cls.parse(lines, source=f"--api-keys-file {keys_file!r}")._keys
        return cls(found)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[ApiKey]:
        return iter(self._keys)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKeys) and self._keys == other._keys

    def __hash__(self) -> int:
        return hash(self._keys)

    def __repr__(self) -> str:
        return f"ApiKeys(ids={[k.id for k in self._keys]!r})"

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(k.id for k in self._keys)

    def check(self, authorization: str | bytes | None, *, basic: bool = False) -> str | AuthFailure:
        """The key id (the tenant) of an `Authorization` header value, or why it is refused.

        `basic`: `Basic base64(USER:KEY)` counts too (any user name), so a browser's own login prompt
        opens the dashboard. Compares the SHA-256 of the presented key with every key's, each with
        `hmac.compare_digest` and without stopping at a match, so neither a
        key's content, its length nor its position shows in the time taken.
        """
        token = bearer_token(authorization)
        if token is None and basic:
            token = basic_password(authorization)
        if token is None:
            return AuthFailure.MISSING
        presented = _digest(token)
        match: str | None = None
        for key in self._keys:
            if hmac.compare_digest(presented, key.digest):
                match = key.id
        return AuthFailure.INVALID if match is None else match


def bearer_token(authorization: str | bytes | None) -> bytes | None:
    """The credentials of `Bearer CREDENTIALS` (scheme case-insensitive), or None when absent or another scheme."""
    if authorization is None:
        return None
    raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, token = raw.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


def basic_password(authorization: str | bytes | None) -> bytes | None:
    """The password of `Basic base64(USER:PASSWORD)` (scheme case-insensitive), or None."""
    if authorization is None:
        return None
    raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, encoded = raw.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (ValueError, binascii.Error):
        return None
    _, sep, password = decoded.partition(b":")
    return password if sep and password else None


def unauthorized_body(failure: AuthFailure) -> dict[str, Any]:
    """OpenAI's 401 body: type invalid_request_error, code invalid_api_key."""
    return {"error": {"message": failure.message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


def exposure_warning(listeners: Sequence[tuple[str, str, int]], keys: ApiKeys) -> str | None:
    """One line when an API (name, host, port) listens on every interface without API keys, else None."""
    if keys:
        return None
    open_ = [
        f"{name} on {'[::]' if host == '::' else host or '0.0.0.0'}:{port}"
        for name, host, port in listeners
        if host in _WILDCARD_HOSTS
    ]
    if not open_:
        return None
    return (
        f"serving {' and '.join(open_)} on every network interface without API keys: anyone who can reach this "
        "host can use it; set --api-keys or --api-keys-file (docs/security.md), or listen on 127.0.0.1"
    )


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    """`--api-keys`, `--api-keys-file`, `--open-metrics` (each also from its MESHLLM_* variable)."""
    g = parser.add_argument_group("API keys (docs/security.md)")
    g.add_argument(
        "--api-keys", default="",
        help=(
            "comma-separated `KEY` or `ID:KEY` entries; with any key set, the HTTP API (but `/health`, `/live`, `/metrics`, the"
            " `/dashboard` page and its data) and the Inference gRPC API need `Authorization: Bearer KEY` "
            "([security.md](security.md#frontend-api-keys))"
        ),
    )  # fmt: skip
    g.add_argument("--api-keys-file", default="", help="file of API keys: one `KEY` or `ID:KEY` a line, `#` comments")
    g.add_argument(
        "--open-metrics", action="store_true",
        help="with API keys set, serve `/metrics`, `/dashboard` and `/dashboard/state` without a key (by default they need one)",
    )  # fmt: skip


def api_keys_from_namespace(ns: argparse.Namespace) -> ApiKeys:
    """The keys named by the flags of `add_api_key_args`; ConfigError (one line, no key in it) when bad."""
    return ApiKeys.load(ns.api_keys, ns.api_keys_file)
