"""The planner's loop: observe an interval, predict the next, size each role, scale, and keep the state.

    async with Planner(config, reader=..., connector=..., profile=..., leadership=...) as planner:
        await planner.run()      # campaign, then one step per --interval-s while leading

A step that cannot read the mesh (a frontend down) or act on it (the connector failed) is logged and
counted (`meshllm_planner_interval_failures`) and changes nothing; the next interval tries again. A worker
template the workers refuse (ConfigError from the local connector) ends the planner: no later interval
would do better.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from meshllm.errors import ConfigError, MeshError
from meshllm.lifecycle import AsyncCloseable
from meshllm.planner.config import PlannerConfig
from meshllm.planner.decide import AS_PROFILED, Scaler, corrections, needed
from meshllm.planner.leader import EtcdLeadership
from meshllm.planner.local import LocalConnector
from meshllm.planner.metrics import PlannerMetrics
from meshllm.planner.model import Connector, Decision
from meshllm.planner.observe import MeshReader, observation
from meshllm.planner.predict import LoadPredictor
from meshllm.planner.profile import Profile
from meshllm.served_counts import Counts

__all__ = ["STATE_VERSION", "Planner"]

log = logging.getLogger(__name__)

STATE_VERSION = 1


class Planner(AsyncCloseable):
    def __init__(
        self,
        config: PlannerConfig,
        *,
        reader: MeshReader,
        connector: Connector,
        profile: Profile,
        leadership: EtcdLeadership | None,
        metrics: PlannerMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.reader = reader
        self.connector = connector
        self.profile = profile
        self.leadership = leadership
        self.metrics = metrics if metrics is not None else PlannerMetrics(config.planner_id)
        self.clock = clock
        self.roles = config.mode.roles
        opts: dict[str, Any] = {}
        if config.predictor == "moving-average":
            opts["window"] = config.predictor_window
        elif config.predictor == "holt-winters" and config.season:
            opts["season"] = config.season
        self.predictor = LoadPredictor(config.predictor, **opts)
        self.scaler = Scaler(
            {r: (config.bounds[r].low, config.bounds[r].high) for r in self.roles},
            down_intervals=config.down_intervals,
            up_cooldown_s=config.up_cooldown_s,
            down_cooldown_s=config.down_cooldown_s,
            max_step_down=config.max_step_down or None,
        )
        self._last: Counts | None = None
        self.corrections = AS_PROFILED  # the last interval's, kept where an interval measures none
        self.steps = 0

    # ------------------------------------------------------------ one interval

    async def step(self) -> list[Decision]:
        """One interval; the decisions made (none on the first reading, which only sets the baseline)."""
        now = self.clock()
        counts = await self.reader.counts(now)
        workers = await self.reader.workers()
        replicas = await self.connector.replicas()
        self.metrics.set_workers(replicas)
        last, self._last = self._last, counts
        if last is None:
            first = [self.scaler.decide(r, float(replicas.get(r, 0)), replicas.get(r, 0), now, why="first reading")
                     for r in self.roles]  # fmt: skip
            self.metrics.decided(first)
            return await self._apply(first)
        obs = observation(counts, last, workers)
        self.predictor.add(obs)
        load = self.predictor.predict()
        corr = self.corrections = corrections(obs, self.profile, self.corrections)
        need = needed(load, self.profile, self.config.ttft_s, self.config.itl_s, prefill_correction=corr.prefill,
                      decode_correction=corr.decode, mode=self.config.mode.value)  # fmt: skip
        decisions = [self.scaler.decide(r, need[r][0], replicas.get(r, 0), now, why=need[r][1]) for r in self.roles]
        self.metrics.record(obs, load, {r: need[r][0] for r in self.roles}, decisions)
        log.info("planner: observed %.2f req/s (ISL %s, OSL %s, TTFT p90 %s, ITL p90 %s); predicted %.2f req/s; %s",
                 obs.request_rate, _num(obs.isl), _num(obs.osl), _ms(obs.ttft_p90_s), _ms(obs.itl_p90_s),
                 load.request_rate, "; ".join(f"{d.role} {d.current}→{d.target} ({d.reason})" for d in decisions))  # fmt: skip
        return await self._apply(decisions, workers.busy)

    async def _apply(self, decisions: list[Decision], busy: Mapping[str, int] | None = None) -> list[Decision]:
        if not self.config.dry_run:
            for d in decisions:
                if d.target != d.current:
                    await self.connector.scale(d.role, d.target, busy=busy)
        self.steps += 1
        return decisions

    # ------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        """What a restarted (or the next) planner continues from."""
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "planner_id": self.config.planner_id,
            "saved_at": self.clock(),
            "targets": {"ttft_s": self.config.ttft_s, "itl_s": self.config.itl_s},
            "profile": self.profile.to_json(),
            "predictor": self.predictor.state(),
            "scaler": self.scaler.state(),
            "decisions": list(self.metrics.recent),
        }
        if isinstance(self.connector, LocalConnector):
            state["local_workers"] = self.connector.workers()
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a saved state: the predictor's history, the scaler's cooldowns, the recent decisions,
        the local workers. The saved state is the whole story (it carries what this planner saved before, when it
        led earlier): the decisions kept here are replaced, not added to. A history that does not parse is logged
        and ignored (the planner starts afresh, still adopting its workers) rather than ending it at every start."""
        if state.get("version") != STATE_VERSION:
            log.warning("planner state version %r is not %d; starting afresh", state.get("version"), STATE_VERSION)
            return
        try:
            self._restore_history(state)
        except (TypeError, ValueError, AttributeError) as exc:
            log.warning("planner state of %s does not parse (%s); starting afresh", state.get("planner_id"), exc)
        if isinstance(self.connector, LocalConnector):
            self.connector.adopt(state.get("local_workers") or [])
        log.info("planner: continuing from the state %s saved", state.get("planner_id"))

    def _restore_history(self, state: dict[str, Any]) -> None:
        """The predictor, scaler and decisions of `state`, all or (raising) none."""
        decisions = [dict(d) for d in state.get("decisions") or []]
        history = {q: [float(v) for v in samples] for q, samples in (state.get("predictor") or {}).items()}
        self.scaler.restore(state.get("scaler") or {"version": 1, "roles": {}})  # unchanged when it raises
        self.predictor.restore(history)
        self.metrics.recent.clear()
        self.metrics.recent.extend(decisions[: self.metrics.recent.maxlen])  # newest first, as saved

    async def _save(self) -> None:
        if self.leadership is not None and not await self.leadership.save_state(self.state()):
            log.warning("planner: state not saved (no longer the leader)")

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Lead (after winning the election) and plan every interval; stand by again if leadership is lost."""
        while True:
            if self.leadership is not None:
                await self.leadership.campaign()
                saved = await self.leadership.load_state()
                if saved is not None:
                    self.restore(saved)
            self.metrics.leader.set(1)
            self._last = None
            await self._lead()
            self.metrics.leader.set(0)

    async def _lead(self) -> None:
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while self.leadership is None or self.leadership.leading:
            try:
                await self.step()
                await self._save()
            except ConfigError:
                raise
            except (MeshError, OSError) as exc:
                self.metrics.failures.inc()
                log.warning("planner: interval skipped: %s", getattr(exc, "message", exc))
            except Exception:  # a bug: logged with its traceback; one bad interval must not end the planner
                self.metrics.failures.inc()
                log.exception("planner: interval failed")
            tick += self.config.interval_s
            lost = self.leadership.lost.wait() if self.leadership is not None else asyncio.Event().wait()
            try:
                await asyncio.wait_for(lost, max(0.0, tick - loop.time()))  # the interval's ticker
            except TimeoutError:
                continue
        log.warning("planner: leadership lost; standing by")

    async def _aclose(self) -> None:
        # Resign first (meshllm.planner.main's order): a standby takes over within one poll instead of waiting
        # while this planner's workers drain (--stop-workers-on-exit) with the lease still held.
        if self.leadership is not None:
            await self.leadership.aclose()
        await self.connector.aclose()
        await self.reader.aclose()


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"
