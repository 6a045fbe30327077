"""The etcd backend of the discovery plane (async client `aetcd`; see docs/discovery.md).

Registration: the first `register_*` grants a lease of `lease_ttl_s` and puts
the record under it; a background task refreshes the lease every TTL/2. When
the lease is lost (etcd restarted with its data wiped, or unreachable longer
than the TTL: a refresh answers TTL 0 or a put says "lease not found") the
handle grants a new lease and re-puts everything it registered in one
transaction, retrying with backoff until etcd answers again; it never gives
up and never crashes.

Watching: one background task per watch reads the prefix (noting its
revision), publishes the snapshot, then watches from revision + 1, so no
change falls in between. When the stream breaks it reads again and publishes
a fresh full snapshot.

aetcd and grpc errors become `meshllm.errors` in exactly one place,
`etcd_error` (plane/discovery/etcd_client.py): CannotConnect (etcd refused or dropped the connection),
NotFound (the lease is gone), Unavailable (anything else etcd answered).

Security (`EtcdCredentials`, docs/security.md): TLS with the CA and client
certificate given (or for `https://` endpoints), user/password auth. Wrong
credentials or a failed TLS handshake stop `connect` with one line that
names the flags to check. When etcd no longer knows the auth token (it
expired unused: `--auth-token-ttl`) the call logs in again and is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Self, TypeVar

from google.protobuf import json_format

from meshllm.config import parse_host_port
from meshllm.credentials import EtcdCredentials
from meshllm.errors import CannotConnect, InvalidArgument, MeshError, NotFound
from meshllm.plane.discovery.base import Discovery, M, Record, SnapshotFeed, record_id
from meshllm.plane.discovery.etcd_client import (
    CHANNEL_OPTIONS,
    TLS_MARKERS,
    TRANSLATED,
    SecureClient,
    auth_hint,
    etcd_error,
    is_auth_failure,
    is_invalid_token,
)
from meshllm.plane.discovery.retry import REVOKE_BOUND_S, Backoff, cancel_and_wait, log_failure

__all__ = ["EtcdDiscovery"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_CLOSE_BOUND_S = 1.0


class EtcdDiscovery(Discovery):
    """Discovery in etcd v3: lease-bound records, watched with snapshot + watch-from-revision."""

    def __init__(
        self,
        endpoints: Sequence[str],
        namespace: str,
        lease_ttl_s: float = 10.0,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        if not endpoints:
            raise InvalidArgument("no etcd endpoints", param="etcd_endpoints")
        if lease_ttl_s <= 0:
            raise InvalidArgument(f"lease TTL {lease_ttl_s}s must be positive", param="lease_ttl_s")
        self.namespace = namespace
        self.endpoints = tuple(endpoints)
        self.lease_ttl_s = lease_ttl_s
        self._call_timeout_s = min(5.0, max(1.0, lease_ttl_s / 2))
        self.credentials = credentials if credentials is not None else EtcdCredentials()
        self._clients = [self._new_client(ep) for ep in self.endpoints]
        self._current = 0
        self._registered: dict[str, bytes] = {}  # key -> JSON value, everything this handle put
        self._lease: int | None = None
        self._granted_before = False
        self._lock = asyncio.Lock()  # serialises lease and registration changes
        self._keepalive_task: asyncio.Task[None] | None = None
        self._watch_tasks: set[asyncio.Task[None]] = set()
        self._feeds: set[SnapshotFeed[Any]] = set()

    def _new_client(self, endpoint: str) -> SecureClient:
        scheme, _, rest = endpoint.rpartition("://")
        host, port = parse_host_port(rest, what="etcd endpoint")
        tls = scheme == "https" or self.credentials.tls
        return SecureClient(
            host,
            port,
            self.credentials,
            tls=tls,
            timeout=self._call_timeout_s,
            options=CHANNEL_OPTIONS,  # type: ignore[arg-type]
        )

    @classmethod
    async def connect(
        cls,
        endpoints: Sequence[str],
        namespace: str,
        lease_ttl_s: float = 10.0,
        credentials: EtcdCredentials | None = None,
    ) -> Self:
        """A handle on the first endpoint that answers; raises CannotConnect when none does.

        Refused credentials end the attempt at once (every endpoint would
        refuse them too), with a message naming the flags to check.
        """
        discovery = cls(endpoints, namespace, lease_ttl_s, credentials)
        errors = []
        for index in range(len(discovery.endpoints)):
            discovery._current = index
            try:
                await discovery._call("connect", lambda c: c.get(b"meshllm/v1/"))
            except MeshError as exc:
                if exc.__cause__ is not None and is_auth_failure(exc.__cause__):
                    await discovery._close_clients()
                    raise CannotConnect(f"{exc.message} ({auth_hint(exc.message)})") from exc
                errors.append(exc.message)
                continue
            log.info("discovery on etcd %s (namespace %s; %s)", discovery.endpoint, namespace, discovery.credentials.describe())
            return discovery
        await discovery._close_clients()
        hint = ""
        if any(m in e.lower() for e in errors for m in TLS_MARKERS):
            hint = (
                " (TLS failed: etcd refused the client certificate or serves one not trusted here;"
                " check --etcd-ca, --etcd-cert and --etcd-key against etcd's --trusted-ca-file and certificate)"
            )
        raise CannotConnect("cannot reach etcd: " + "; ".join(errors) + hint)

    @property
    def endpoint(self) -> str:
        """The endpoint in use now (the next one is tried after a connection failure)."""
        return self.endpoints[self._current]

    @property
    def _client(self) -> SecureClient:
        return self._clients[self._current]

    # ------------------------------------------------------------ errors

    async def call(self, what: str, call: Callable[[SecureClient], Awaitable[T]]) -> T:
        """One etcd call of a caller's own (the planner's election and state), with this handle's failover,
        re-login and error translation."""
        self._check_open()
        return await self._call(what, call)

    async def _call(self, what: str, call: Callable[[SecureClient], Awaitable[T]]) -> T:
        """`call(client)` on the current endpoint, errors translated.

        Once more after logging in again when etcd no longer knows our auth
        token (it expired unused, or etcd lost it).
        """
        client = self._client
        try:
            return await self._call_once(what, call(client))
        except MeshError as exc:
            if exc.__cause__ is None or not is_invalid_token(exc.__cause__) or not self.credentials.user:
                raise
        await self._reauthenticate(client)
        return await self._call_once(what, call(client))

    async def _call_once(self, what: str, call: Awaitable[T]) -> T:
        # aetcd bounds its grpc calls by the client timeout, but not its own
        # queues and locks (e.g. creating a watch on a dying stream): bound all.
        with self._translated(what):
            async with asyncio.timeout(self._call_timeout_s + 1.0):
                return await call

    async def _reauthenticate(self, client: SecureClient) -> None:
        with self._translated("authenticate"):
            async with asyncio.timeout(self._call_timeout_s + 1.0):
                await client.reauthenticate()

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except TRANSLATED as exc:
            err = etcd_error(exc, what, self.endpoint)
            if isinstance(err, CannotConnect) and len(self._clients) > 1:
                self._current = (self._current + 1) % len(self._clients)
            raise err from exc

    # ------------------------------------------------------------ registration

    async def _register(self, key: str, record: Record) -> None:
        value = json_format.MessageToJson(record, preserving_proto_field_name=True, indent=None).encode()
        async with self._lock:
            self._check_open()
            previous = self._registered.get(key)
            self._registered[key] = value
            try:
                if self._lease is not None:
                    try:
                        await self._call("put", lambda c: c.put(key.encode(), value, lease=self._lease))
                        return
                    except NotFound:
                        log.warning("etcd lease %x is gone; granting a new one", self._lease)
                        self._lease = None
                await self._grant_and_put_all()
            except MeshError:
                if previous is None:
                    del self._registered[key]
                else:
                    self._registered[key] = previous
                raise

    async def _grant_and_put_all(self) -> None:
        """Grant a lease and put every registered record under it, atomically. Holds `_lock`."""
        lease = await self._call("grant lease", lambda c: c.lease(max(1, math.ceil(self.lease_ttl_s))))
        txn = self._client.transactions
        puts = [txn.put(k.encode(), v, lease=lease.id) for k, v in self._registered.items()]
        await self._call("put", lambda c: c.transaction(compare=[], success=puts, failure=[]))
        self._lease = lease.id
        if self._granted_before:
            log.info("etcd lease %x granted; re-registered %d record(s)", lease.id, len(puts))
        else:
            log.info("etcd lease %x granted (ttl %ds)", lease.id, lease.ttl)
        self._granted_before = True
        if self._keepalive_task is None or self._keepalive_task.done():
            self._keepalive_task = asyncio.create_task(self._keepalive(), name=f"etcd keep-alive {self.namespace}")

    async def _keepalive(self) -> None:
        """Refresh the lease every TTL/2; recover a lost lease; retry with backoff while etcd is away."""
        interval = self.lease_ttl_s / 2
        backoff = Backoff(cap=interval)
        delay, failures = interval, 0
        while True:
            await asyncio.sleep(delay)
            try:
                await self._refresh_or_recover()
            except Exception as exc:  # MeshError: etcd trouble; anything else is a bug, logged, never fatal
                failures += 1
                delay = backoff.next()
                if not isinstance(exc, MeshError):
                    log.exception("etcd keep-alive: unexpected error")
                log_failure(failures, "etcd keep-alive failed (%s); retrying in %.1fs", exc, delay)
                continue
            if failures:
                log.info("etcd keep-alive works again after %d failure(s)", failures)
            backoff.reset()
            delay, failures = interval, 0

    async def _refresh_or_recover(self) -> None:
        lease = self._lease
        if lease is not None:
            with contextlib.suppress(NotFound):  # etcd answers TTL 0 for an unknown lease; some versions raise
                reply = await self._call("refresh lease", lambda c: c.refresh_lease(lease))
                if reply is not None and reply.TTL > 0:
                    return
            log.warning(
                "etcd lease %x lost (etcd restarted or unreachable for over %gs); re-registering", lease, self.lease_ttl_s
            )
        async with self._lock:
            if self._lease == lease and self._registered:  # nobody recovered it meanwhile
                self._lease = None
                await self._grant_and_put_all()

    async def unregister(self) -> None:
        async with self._lock:
            self._registered.clear()
            lease, self._lease = self._lease, None
            await self._stop_keepalive()
            if lease is None:
                return
            try:
                async with asyncio.timeout(REVOKE_BOUND_S):
                    await self._call("revoke lease", lambda c: c.revoke_lease(lease))
                log.info("etcd lease %x revoked", lease)
            except NotFound:
                pass  # already expired
            except (MeshError, TimeoutError) as exc:
                log.warning("etcd lease %x not revoked (%s); its records expire within %gs", lease, exc, self.lease_ttl_s)

    async def _stop_keepalive(self) -> None:
        task = self._keepalive_task
        if task is not None:
            await cancel_and_wait([task])
            if self._keepalive_task is task:
                self._keepalive_task = None

    # ------------------------------------------------------------ reading

    def _decode(self, key: bytes, value: bytes, kind: type[M]) -> M | None:
        try:
            return json_format.Parse(value, kind(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            log.warning("skipping unreadable etcd value at %s: %s", key.decode(errors="replace"), exc)
            return None

    async def _read(self, prefix: str, kind: type[M]) -> tuple[dict[str, M], int]:
        """{key: record} under `prefix` and the revision it was read at."""
        got = await self._call("get", lambda c: c.get_prefix(prefix.encode()))
        state = {}
        for kv in got:
            record = self._decode(kv.key, kv.value, kind)
            if record is not None:
                state[kv.key.decode()] = record
        return state, got.header.revision

    async def _list(self, prefix: str, kind: type[M]) -> dict[str, M]:
        state, _ = await self._read(prefix, kind)
        return _by_id(state)

    async def _watch(self, prefix: str, kind: type[M]) -> AsyncIterator[dict[str, M]]:
        if self.closed:
            return
        feed: SnapshotFeed[M] = SnapshotFeed()
        task = asyncio.create_task(self._follow(prefix, kind, feed), name=f"etcd watch {prefix}")
        self._feeds.add(feed)
        self._watch_tasks.add(task)
        try:
            async for snapshot in feed.snapshots():
                yield snapshot
        finally:
            self._feeds.discard(feed)
            self._watch_tasks.discard(task)
            await cancel_and_wait([task])

    async def _follow(self, prefix: str, kind: type[M], feed: SnapshotFeed[M]) -> None:
        """Feed snapshots of `prefix` until cancelled, resyncing whenever the watch breaks."""
        backoff = Backoff(cap=min(5.0, self.lease_ttl_s / 2))
        failures = 0
        while True:
            try:
                await self._follow_once(prefix, kind, feed, backoff)
                reason = "the stream ended"
            except MeshError as exc:
                reason = exc.message
            except Exception as exc:  # a bug: surface it to the consumer rather than hang it
                log.exception("etcd watch on %s failed", prefix)
                feed.fail(exc)
                return
            failures = 1 if backoff.fresh else failures + 1
            log_failure(failures, "etcd watch on %s broke (%s); resyncing", prefix, reason)
            await asyncio.sleep(backoff.next())

    async def _follow_once(self, prefix: str, kind: type[M], feed: SnapshotFeed[M], backoff: Backoff) -> None:
        state, revision = await self._read(prefix, kind)
        feed.publish(_by_id(state))
        watch = await self._call("watch", lambda c: c.watch_prefix(prefix.encode(), start_revision=revision + 1))
        backoff.reset()
        try:
            with self._translated(f"watch {prefix}"):
                # Events of one etcd response are queued together and taken
                # here without suspending, so the feed coalesces them: the
                # consumer never sees half of a multi-key change.
                async for event in watch:
                    key = event.kv.key.decode()
                    record = self._decode(event.kv.key, event.kv.value, kind) if event.kind == "PUT" else None
                    if record is None:
                        state.pop(key, None)
                    else:
                        state[key] = record
                    feed.publish(_by_id(state))
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CLOSE_BOUND_S):
                    await watch.cancel()

    # ------------------------------------------------------------ closing

    async def _aclose(self) -> None:
        for feed in list(self._feeds):
            feed.close()
        tasks, self._watch_tasks = list(self._watch_tasks), set()
        await cancel_and_wait(tasks)
        try:
            async with asyncio.timeout(REVOKE_BOUND_S + 0.5):
                await self.unregister()
        except TimeoutError:
            log.warning("etcd discovery: unregister timed out on close; records expire within %gs", self.lease_ttl_s)
            await self._stop_keepalive()
        await self._close_clients()

    async def _close_clients(self) -> None:
        for client in self._clients:
            try:
                async with asyncio.timeout(_CLOSE_BOUND_S):
                    await client.close()
            except (TimeoutError, *TRANSLATED) as exc:
                log.debug("closing etcd client: %s", exc)


def _by_id(state: dict[str, M]) -> dict[str, M]:
    return {record_id(key): record for key, record in state.items()}
