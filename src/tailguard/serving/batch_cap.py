"""Forecast-driven batch cap (``batch_cap.mode: forecast``, ``--batch-cap forecast``): the server's side of E1/M4.

Every request handed to the engine is counted at the moment it arrived (``record_arrival``); a timer closes each
period, the ``ForecastCapController`` forecasts the next ones and plans for their peak, and the plan's running-sequence
cap and token budget go to the engine (applied at its next step; a lower cap preempts nobody). The plan is made for
this one engine; the replica estimate the scale-out hook receives is the fleet the same forecast would need.

The service profile starts from the configured throughput and token means; the means then follow the requests served
(prompt and output tokens of each completed request), so the plan tracks the traffic it actually sees.

A forecast of arrivals does not see a backlog: after a burst, a quiet period would plan a small cap while requests
still wait. So the cap set is never below the requests the engine holds (running and waiting, up to ``max_seqs``),
checked four times a period: the forecast sets the cap ahead of load, the backlog keeps it from falling under load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from tailguard.plan.capacity import CapacityPlan, ServiceProfile, plan_ahead, plan_capacity, throughput_cap
from tailguard.plan.controller import ForecastCapController
from tailguard.plan.forecast import Forecaster, HoltWinters, LastValue, LSTMForecaster, MovingMean
from tailguard.serving.config import BatchCapConfig

log = logging.getLogger("tailguard.server")


def make_forecaster(cfg: BatchCapConfig) -> Forecaster:
    if cfg.forecaster == "last-value":
        return LastValue()
    if cfg.forecaster == "moving-mean":
        return MovingMean(6)
    if cfg.forecaster == "lstm":
        # threads=None: torch's thread count is process-wide; training must not change it under the engine
        return LSTMForecaster(max_horizon=cfg.horizon, threads=None)
    return HoltWinters()


class BatchCapDriver:
    def __init__(self, cfg: BatchCapConfig, engine: Any, registry: CollectorRegistry | None, model: str,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not callable(getattr(engine, "set_caps", None)):
            raise ValueError(f"batch_cap mode 'forecast' sets the embedded engine's caps; this backend "
                             f"({type(engine).__name__}) has none: use mode 'static'")
        self.cfg, self.engine, self.clock = cfg, engine, clock
        inner = getattr(engine, "engine", None)  # AsyncLLMEngine -> LLMEngine: what bounds the plan
        args = getattr(inner, "args", None)
        self._plan_kw: dict[str, Any] = {
            "min_seqs": cfg.min_seqs, "max_seqs": cfg.max_seqs, "headroom": cfg.headroom,
            "target_utilization": cfg.target_utilization,
            "prefill_chunk": getattr(args, "max_prefill_chunk", 256),
            "kv_cache_tokens": getattr(inner, "kv_capacity_tokens", None),
        }
        self._engine_budget = int(getattr(args, "max_num_batched_tokens", 512))
        self._tokens_in = self._tokens_out = 0.0
        self._served = 0
        self.controller = ForecastCapController(
            self.profile(), period_s=cfg.period_s, horizon=cfg.horizon, forecaster=make_forecaster(cfg),
            refit_every=cfg.refit_every, min_history=cfg.min_history, apply=self._on_plan,
            replicas=1, **self._plan_kw)  # the cap is this engine's: planned for one replica
        self.current: CapacityPlan | None = None  # what the engine was told last
        self.forecast_plan: CapacityPlan | None = None  # the forecast's plan, before the backlog floor
        self.changes = 0
        m = ["model"]
        self._model = model
        self.g_seqs = Gauge("tailguard_batch_cap_max_num_seqs", "The engine's running-sequence cap now (forecast-"
                            "driven batch cap).", m, registry=registry)
        self.g_tokens = Gauge("tailguard_batch_cap_max_num_batched_tokens", "The engine's per-step token budget now "
                              "(forecast-driven batch cap).", m, registry=registry)
        self.g_rate = Gauge("tailguard_batch_cap_planned_arrivals_per_second", "The forecast peak arrival rate the "
                            "cap is planned for.", m, registry=registry)
        self.g_replicas = Gauge("tailguard_batch_cap_replicas_estimate", "Replicas the forecast load needs (the "
                                "scale-out hook's capacity estimate).", m, registry=registry)
        # Until the first period closes: the widest cap of the range, so that an early burst is not held back.
        self._apply(self._budgeted(plan_capacity(0.0, self.profile(), replicas=1,
                                                 **{**self._plan_kw, "min_seqs": cfg.max_seqs})))

    # --- inputs ---------------------------------------------------------------------------------------------------
    def record_arrival(self, at: float) -> None:
        self.controller.record_arrival(at)

    def observe(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A request served to its end: its lengths update the profile's means."""
        if num_output_tokens > 0 and num_prompt_tokens > 0:
            self._tokens_in += num_prompt_tokens
            self._tokens_out += num_output_tokens
            self._served += 1

    def profile(self) -> ServiceProfile:
        c, n = self.cfg, self._served
        mean_in = self._tokens_in / n if n else c.mean_input_tokens
        mean_out = self._tokens_out / n if n else c.mean_output_tokens
        return ServiceProfile(mean_in, mean_out, c.prefill_tokens_per_s, dict(c.decode_tokens_per_s))

    # --- the period -----------------------------------------------------------------------------------------------
    def advance(self, now: float | None = None) -> CapacityPlan | None:
        """Close the periods that ended (a new forecast plan), then hold the cap at least at the backlog."""
        self.controller.profile = self.profile()
        self.controller.advance(self.clock() if now is None else now)
        plan = self.controller.plan
        if plan is not None:
            self.g_rate.labels(self._model).set(plan.arrivals_per_s)
            self.g_replicas.labels(self._model).set(self.capacity_estimate()["replicas"])
        if self.forecast_plan is None:
            return None
        target = self._budgeted(self._with_backlog(self.forecast_plan))
        cur = self.current
        if cur is None or (target.max_num_seqs, target.max_num_batched_tokens) != (
                cur.max_num_seqs, cur.max_num_batched_tokens):
            self._apply(target)
            return target
        return None

    def backlog(self) -> int:
        s = self.engine.stats()
        return int(s.running + s.waiting)

    def _with_backlog(self, plan: CapacityPlan) -> CapacityPlan:
        # Hold what the engine holds, but not beyond the throughput cap: a backlog above it means overload, where
        # admitting everyone only slows everyone (plan/capacity.py, throughput_cap).
        floor = min(self.cfg.max_seqs, self.backlog(),
                    throughput_cap(self.profile(), self.cfg.min_seqs, self.cfg.max_seqs))
        if floor <= plan.max_num_seqs:
            return plan
        return plan_capacity(plan.arrivals_per_s, self.profile(), replicas=1, **{**self._plan_kw, "min_seqs": floor})

    def _on_plan(self, plan: CapacityPlan) -> None:
        self.forecast_plan = plan  # applied (with the backlog floor) by advance

    def _budgeted(self, plan: CapacityPlan) -> CapacityPlan:
        if self.cfg.token_budget == "engine":  # only the cap moves; the budget stays the engine's own
            return dataclasses.replace(plan, max_num_batched_tokens=max(self._engine_budget, plan.max_num_seqs))
        return plan

    def _apply(self, plan: CapacityPlan) -> None:
        self.engine.set_caps(int(plan.max_num_seqs), int(plan.max_num_batched_tokens))
        if self.current is not None and plan.max_num_seqs != self.current.max_num_seqs:
            self.changes += 1
        self.current = plan
        self.g_seqs.labels(self._model).set(plan.max_num_seqs)
        self.g_tokens.labels(self._model).set(plan.max_num_batched_tokens)
        log.info("batch cap: %d sequences, %d tokens a step (planned for %.2f req/s)", plan.max_num_seqs,
                 plan.max_num_batched_tokens, plan.arrivals_per_s)

    async def run(self) -> None:
        """Close each period as it ends (the forecaster's fit runs off the event loop)."""
        while True:
            await asyncio.sleep(min(0.25, max(0.05, self.cfg.period_s / 4)))  # the backlog floor reacts fast
            try:
                await asyncio.to_thread(self.advance)
            except Exception:  # noqa: BLE001 - a failed plan keeps the last caps; it must not stop planning
                log.exception("batch cap: planning failed")

    # --- outputs --------------------------------------------------------------------------------------------------
    def capacity_estimate(self) -> dict[str, Any]:
        """What the scale-out hook is told: the caps now and the fleet the forecast peak needs."""
        forecast = self.controller.forecast
        fleet = (plan_ahead(forecast.tolist(), self.cfg.period_s, self.profile(), **self._plan_kw)
                 if forecast is not None and forecast.size else None)
        cur = self.current
        return {
            "max_num_seqs": cur.max_num_seqs if cur else None,
            "max_num_batched_tokens": cur.max_num_batched_tokens if cur else None,
            "forecast_arrivals_per_s": fleet.arrivals_per_s if fleet else None,
            "replicas": fleet.replicas if fleet else 1,
            "utilization_per_replica": fleet.utilization if fleet and math.isfinite(fleet.utilization) else None,
            "saturated": bool(cur.saturated) if cur else False,
            "forecaster": self.cfg.forecaster, "period_s": self.cfg.period_s,
        }
