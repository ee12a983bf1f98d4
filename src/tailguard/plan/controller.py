"""Forecast-driven cap: arrivals in, a capacity plan out at every period's close.

``ForecastCapController`` is the piece a server wires between its request intake and its engine: ``record_arrival``
at every admitted request (``time.perf_counter()`` timestamps), ``advance(now)`` from a timer. At each closed period
it forecasts the next ``horizon`` periods from the counts so far, plans for their peak (``plan_ahead``) and calls
``apply(plan)`` when the settings change, so that the engine's running-sequence cap and token budget are set ahead of
the load, and the scale-out hook learns the replica estimate. It holds no engine: ``apply`` does the setting.

Until ``min_history`` periods are closed it forecasts by last value (the backtest's baseline); the chosen forecaster
is refitted every ``refit_every`` periods on what has been seen, never on the future.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from tailguard.plan.capacity import CapacityPlan, ServiceProfile, plan_ahead
from tailguard.plan.forecast import Forecaster, HoltWinters, LastValue


class ForecastCapController:
    def __init__(self, profile: ServiceProfile, *, period_s: float = 10.0, horizon: int = 6,
                 forecaster: Forecaster | None = None, refit_every: int = 36, min_history: int = 24,
                 history_limit: int = 720, start: float | None = None,
                 apply: Callable[[CapacityPlan], None] | None = None, **plan_kw) -> None:
        if period_s <= 0 or horizon < 1 or refit_every < 1 or min_history < 1:
            raise ValueError("need period_s > 0, horizon >= 1, refit_every >= 1 and min_history >= 1")
        self.profile, self.period_s, self.horizon = profile, period_s, horizon
        self.forecaster = forecaster if forecaster is not None else HoltWinters()
        self.refit_every, self.min_history, self.history_limit = refit_every, min_history, history_limit
        self.apply, self.plan_kw = apply, plan_kw
        self._baseline = LastValue()
        self._start = start
        self._closed: list[float] = []  # counts of closed periods, oldest first
        self._open: dict[int, int] = {}  # period index -> arrivals, for periods not yet closed
        self._next_index = 0  # the first period not yet closed
        self._fitted_at: int | None = None
        self._lock = threading.Lock()
        self.plan: CapacityPlan | None = None
        self.forecast: np.ndarray | None = None

    def record_arrival(self, at: float) -> None:
        with self._lock:
            if self._start is None:
                self._start = at
            idx = int((at - self._start) // self.period_s)
            if idx < self._next_index:  # late report of a closed period: count it in the oldest open one
                idx = self._next_index
            self._open[idx] = self._open.get(idx, 0) + 1

    @property
    def history(self) -> np.ndarray:
        with self._lock:
            return np.asarray(self._closed, dtype=float)

    def advance(self, now: float) -> CapacityPlan | None:
        """Close every period that ended by ``now``; returns the plan if ``apply`` was called with a new one."""
        with self._lock:
            if self._start is None:
                return None
            ended = int((now - self._start) // self.period_s)  # periods [0, ended) are over
            if ended <= self._next_index:
                return None
            for idx in range(self._next_index, ended):
                self._closed.append(float(self._open.pop(idx, 0)))
            self._next_index = ended
            if len(self._closed) > self.history_limit:
                del self._closed[: len(self._closed) - self.history_limit]
            history = np.asarray(self._closed, dtype=float)
        forecast = self._forecast(history)
        plan = plan_ahead(forecast, self.period_s, self.profile, **self.plan_kw)
        self.forecast = forecast
        changed = self.plan is None or (plan.max_num_seqs, plan.max_num_batched_tokens, plan.replicas) != (
            self.plan.max_num_seqs, self.plan.max_num_batched_tokens, self.plan.replicas)
        self.plan = plan
        if changed and self.apply is not None:
            self.apply(plan)
            return plan
        return None

    def _forecast(self, history: np.ndarray) -> np.ndarray:
        if history.size < self.min_history:
            return self._baseline.forecast(history, self.horizon)
        try:
            if self._fitted_at is None or self._next_index - self._fitted_at >= self.refit_every:
                self.forecaster.fit(history)
                self._fitted_at = self._next_index
            return self.forecaster.forecast(history, self.horizon)
        except ValueError:  # a history still too short for this forecaster (it says how long it needs)
            return self._baseline.forecast(history, self.horizon)
