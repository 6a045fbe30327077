"""One planner at a time: a leader elected through an etcd lease, and the state it keeps in etcd.

The leader key (`meshllm/v1/NS/planner/leader`) is created only when absent
(a transaction comparing its version with 0) and bound to a lease of the
candidate's own, refreshed every TTL/3. A leader that cannot refresh its
lease for a whole TTL (etcd away, or the lease gone) counts itself out at
once: by then etcd may have let the key expire and another planner may lead,
so it stops acting before it could act twice. Its TTL counts from when it
sent the grant or the last refresh etcd answered (etcd's own count starts
later), a refresh that hangs is given only what is left of it, and the lease
etcd grants is the TTL rounded up: the leader counts itself out before etcd
lets its key go, never after. Standbys poll the key every TTL/2 and take it
when it is gone; a leader that stops resigns by revoking its lease, so a
standby takes over within one poll.

The state key (`.../planner/state`, JSON, no lease) is written only while
the leader key still holds this planner's identity (the same transaction
compares it), so a deposed planner cannot overwrite its successor's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from typing import Any

from meshllm.errors import MeshError, NotFound
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.protocol.names import planner_key

__all__ = ["EtcdLeadership"]

log = logging.getLogger(__name__)


class EtcdLeadership(AsyncCloseable):
    """Campaign for, hold and give up the planner's leadership; load and save its state while leading."""

    def __init__(self, discovery: EtcdDiscovery, identity: str, *, ttl_s: float = 10.0) -> None:
        if ttl_s < 2:
            raise ValueError(f"the leader lease TTL {ttl_s:g} s is too short (at least 2 s)")
        self._etcd = discovery
        self.identity = identity
        self.ttl_s = ttl_s
        self._leader_key = planner_key(discovery.namespace, "leader").encode()
        self._state_key = planner_key(discovery.namespace, "state").encode()
        self._lease: int | None = None
        self.lost = asyncio.Event()  # set when leadership ends without resigning
        self._keeper: asyncio.Task[None] | None = None

    @property
    def leading(self) -> bool:
        return self._lease is not None and not self.lost.is_set()

    async def leader(self) -> str | None:
        """The identity of the planner that leads now, if any."""
        got = await self._etcd.call("get planner leader", lambda c: c.get(self._leader_key))
        return None if got is None else got.value.decode()

    async def campaign(self) -> None:
        """Return once this planner leads (standby until then, polling every TTL/2)."""
        announced = False
        while not await self._try_lead():
            if not announced:
                log.info("planner %s: standby (planner %s leads)", self.identity, await self.leader())
                announced = True
            await asyncio.sleep(self.ttl_s / 2)
        log.info("planner %s: leading (lease %x, ttl %gs)", self.identity, self._lease, self.ttl_s)

    async def _try_lead(self) -> bool:
        granted = time.monotonic()  # etcd counts the lease's TTL from a moment after this
        lease = await self._etcd.call("grant planner lease", lambda c: c.lease(max(2, math.ceil(self.ttl_s))))

        def txn(c: Any) -> Any:
            t = c.transactions
            return c.transaction(
                compare=[t.version(self._leader_key) == 0],
                success=[t.put(self._leader_key, self.identity.encode(), lease=lease.id)],
                failure=[],
            )

        won, _ = await self._etcd.call("elect planner", txn)
        if not won:
            with contextlib.suppress(MeshError):
                await self._etcd.call("revoke planner lease", lambda c: c.revoke_lease(lease.id))
            return False
        self._lease = lease.id
        self.lost.clear()
        self._keeper = asyncio.create_task(self._keep(lease.id, granted + self.ttl_s), name="planner leader lease")
        return True

    async def _keep(self, lease: int, valid_until: float) -> None:
        """Refresh every TTL/3 until the lease is gone or `valid_until` (monotonic) passes without a refresh."""
        while True:
            await asyncio.sleep(max(0.0, min(self.ttl_s / 3, valid_until - time.monotonic())))
            sent = time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, valid_until - sent)):  # a hung etcd must not keep it leading
                    reply = await self._etcd.call("refresh planner lease", lambda c: c.refresh_lease(lease))
                if reply is None or reply.TTL <= 0:
                    raise NotFound("the planner's lease is gone")
                valid_until = sent + self.ttl_s
                continue
            except NotFound:
                log.warning("planner %s: leader lease %x is gone; standing down", self.identity, lease)
            except (MeshError, TimeoutError) as exc:
                if time.monotonic() < valid_until:
                    log.warning("planner %s: lease refresh failed (%s); retrying", self.identity, exc or "timed out")
                    continue
                log.warning("planner %s: no lease refresh for %gs; standing down", self.identity, self.ttl_s)
            self._lease = None
            self.lost.set()
            return

    async def resign(self) -> None:
        """Stop leading now: the key goes with the lease, and a standby takes over within one poll."""
        lease, self._lease = self._lease, None
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if lease is not None:
            try:
                await self._etcd.call("revoke planner lease", lambda c: c.revoke_lease(lease))
                log.info("planner %s: resigned", self.identity)
            except MeshError as exc:
                log.warning("planner %s: lease not revoked (%s); leadership expires within %gs", self.identity, exc,
                            self.ttl_s)  # fmt: skip

    async def load_state(self) -> dict[str, Any] | None:
        """The last leader's saved state, or None when none was saved (or it does not parse)."""
        got = await self._etcd.call("get planner state", lambda c: c.get(self._state_key))
        if got is None:
            return None
        try:
            state = json.loads(got.value)
        except ValueError as exc:
            log.warning("planner state in etcd does not parse (%s); starting afresh", exc)
            return None
        return state if isinstance(state, dict) else None

    async def save_state(self, state: dict[str, Any]) -> bool:
        """Write the state if this planner still leads; False (nothing written) when it does not."""
        value = json.dumps(state, separators=(",", ":")).encode()

        def txn(c: Any) -> Any:
            t = c.transactions
            return c.transaction(
                compare=[t.value(self._leader_key) == self.identity.encode()],
                success=[t.put(self._state_key, value)],
                failure=[],
            )

        won, _ = await self._etcd.call("save planner state", txn)
        return bool(won)

    async def _aclose(self) -> None:
        await self.resign()
