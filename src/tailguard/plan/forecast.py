"""Forecasters of next-period request arrivals, behind one interface.

A forecaster learns from a history of per-period arrival counts (``fit``) and then, given a history that may run past
what it was fitted on, predicts the next ``horizon`` periods (``forecast``). Splitting the two lets a backtest refit an
expensive model (the LSTM) every few periods and still forecast from the latest data at every origin, which is what a
live planner does too.

* ``LastValue``: the next periods equal the last one (the baseline every other forecaster must beat);
* ``MovingMean``: the mean of the last ``window`` periods (Poisson noise makes single periods jumpy);
* ``SeasonalNaive``: the value one period (season) earlier, for traces with a detected periodicity;
* ``HoltWinters``: exponential smoothing with a damped additive trend (and an additive season when given one), from
  ``statsmodels`` (the ``plan`` extra);
* ``LSTMForecaster``: the case study's LSTM, small enough to train on CPU in seconds, seeded so that it is reproducible.

Arrivals are read from a trace CSV (``TIMESTAMP,...``, the Azure LLM inference trace format) and bucketed by
``arrival_counts``.
"""

from __future__ import annotations

import csv
import math
from abc import ABC, abstractmethod
from datetime import datetime
from pathlib import Path

import numpy as np


def read_arrival_times(path: str | Path) -> np.ndarray:
    """Seconds from the first request, sorted, from a CSV with a ``TIMESTAMP`` column (ISO date-time or seconds)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such trace file")
    times: list[float] = []
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or "TIMESTAMP" not in reader.fieldnames:
            raise ValueError(f"{p}: expected a TIMESTAMP column, found {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            raw = (row.get("TIMESTAMP") or "").strip()
            try:
                times.append(float(raw))
            except ValueError:
                try:
                    # Python's ISO parser takes at most 6 fractional digits; the Azure trace has 7
                    head, _, frac = raw.partition(".")
                    times.append(datetime.fromisoformat(head + ("." + frac[:6] if frac else "")).timestamp())
                except ValueError as exc:
                    raise ValueError(f"{p}:{line}: unreadable TIMESTAMP {raw!r}") from exc
    if not times:
        raise ValueError(f"{p}: no requests")
    t = np.sort(np.asarray(times, dtype=float))
    return t - t[0]


def arrival_counts(times_s: np.ndarray, period_s: float) -> np.ndarray:
    """Requests per period; the last, partial period is dropped (it would read as a collapse of load)."""
    if period_s <= 0:
        raise ValueError("period_s must be > 0")
    t = np.asarray(times_s, dtype=float)
    if t.size == 0:
        return np.zeros(0)
    t = t - t.min()
    full = int(t.max() // period_s)
    counts = np.bincount((t // period_s).astype(int), minlength=full + 1)
    return counts[:full].astype(float)


def detect_period(series: np.ndarray, min_lag: int = 2, max_lag: int | None = None,
                  min_acf: float = 0.3, min_prominence: float = 0.2) -> int | None:
    """The lag of the strongest autocorrelation peak, if it is a real peak and clearly significant; else None.

    A peak must beat its neighbours, the ``2/sqrt(n)`` noise band and ``min_acf``, and rise ``min_prominence`` above
    the lowest autocorrelation at shorter lags: a slowly varying level has a high, slowly decaying autocorrelation
    with small wiggles, which is no season.
    """
    x = np.asarray(series, dtype=float)
    n = x.size
    max_lag = max_lag or n // 3
    if n < 3 * min_lag or max_lag <= min_lag:
        return None
    x = x - x.mean()
    denom = float(np.dot(x, x))
    if denom == 0:
        return None
    acf = np.array([np.dot(x[:-k], x[k:]) / denom for k in range(1, max_lag + 2)])  # acf[k-1] is lag k
    best, best_val = None, max(min_acf, 2.0 / math.sqrt(n))
    for k in range(min_lag, max_lag + 1):
        v = acf[k - 1]
        # a season's peak rises well above the trough before it; a slowly drifting level has no such trough
        prominent = v - float(acf[: k - 1].min()) >= min_prominence
        if v > best_val and prominent and v > acf[k - 2] and v >= acf[k]:
            best, best_val = k, v
    return best


class Forecaster(ABC):
    """Fit on a history of per-period counts; forecast the next periods from a (possibly longer) history."""

    name: str = "forecaster"

    def fit(self, history: np.ndarray) -> Forecaster:
        """Learn parameters from ``history``; returns self. Stateless forecasters learn nothing."""
        _check_history(history, 1)
        return self

    @abstractmethod
    def forecast(self, history: np.ndarray, horizon: int) -> np.ndarray:
        """Counts of the ``horizon`` periods after the end of ``history`` (never negative)."""


def _check_history(history: np.ndarray, need: int) -> np.ndarray:
    h = np.asarray(history, dtype=float)
    if h.ndim != 1 or h.size < need:
        raise ValueError(f"need a 1-D history of at least {need} periods, got shape {h.shape}")
    if not np.all(np.isfinite(h)):
        raise ValueError("history holds NaN or infinite values")
    return h


class LastValue(Forecaster):
    name = "last-value"

    def forecast(self, history: np.ndarray, horizon: int) -> np.ndarray:
        h = _check_history(history, 1)
        return np.full(horizon, max(0.0, h[-1]))


class MovingMean(Forecaster):
    name = "moving-mean"

    def __init__(self, window: int = 6) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self.name = f"moving-mean({window})"

    def forecast(self, history: np.ndarray, horizon: int) -> np.ndarray:
        h = _check_history(history, 1)
        return np.full(horizon, max(0.0, float(h[-self.window:].mean())))


class SeasonalNaive(Forecaster):
    name = "seasonal-naive"

    def __init__(self, season: int) -> None:
        if season < 1:
            raise ValueError("season must be >= 1")
        self.season = season
        self.name = f"seasonal-naive({season})"

    def forecast(self, history: np.ndarray, horizon: int) -> np.ndarray:
        h = _check_history(history, self.season)
        last_season = h[-self.season:]
        return np.maximum(0.0, np.array([last_season[i % self.season] for i in range(horizon)]))


class HoltWinters(Forecaster):
    """statsmodels' ExponentialSmoothing, damped additive trend, optional additive season; refit by ``fit``.

    ``forecast`` re-runs the smoothing recursion with the fitted parameters over the given history (no
    re-optimization), so that between refits it follows the latest data at the cost of one pass.
    """

    name = "holt-winters"

    def __init__(self, season: int | None = None, max_history: int = 720, min_smoothing_level: float = 0.1) -> None:
        self.season = season
        self.max_history = max_history
        self.min_smoothing_level = min_smoothing_level
        self.name = "holt-winters" + (f"({season})" if season else "")
        self._params: dict | None = None

    def _model(self, h: np.ndarray):
        try:
            from statsmodels.tsa.holtwinters import ExponentialSmoothing
        except ImportError as exc:  # pragma: no cover - the plan extra is part of dev
            raise RuntimeError("Holt-Winters needs statsmodels: pip install 'tailguard[plan]'") from exc
        seasonal = "add" if self.season and h.size >= 2 * self.season + 2 else None
        # a level that never moves (smoothing 0, the optimum on a calm stretch) would miss every later change of
        # load: the level always follows the data at least a little
        return ExponentialSmoothing(h, trend="add", damped_trend=True, seasonal=seasonal,
                                    seasonal_periods=self.season if seasonal else None,
                                    initialization_method="estimated",
                                    bounds={"smoothing_level": (self.min_smoothing_level, 1.0)})

    def _need(self) -> int:
        return max(10, 2 * (self.season or 0) + 2)

    def fit(self, history: np.ndarray) -> HoltWinters:
        import warnings

        h = _check_history(history, self._need())[-self.max_history:]
        with warnings.catch_warnings():  # convergence chatter on short, noisy series; the backtest judges the result
            warnings.simplefilter("ignore")
            res = self._model(h).fit()
        self._params = {k: v for k, v in res.params.items()
                        if k in ("smoothing_level", "smoothing_trend", "smoothing_seasonal", "damping_trend")
                        and v is not None and np.isfinite(v)}
        return self

    def forecast(self, history: np.ndarray, horizon: int) -> np.ndarray:
        import warnings

        h = _check_history(history, self._need())[-self.max_history:]
        if self._params is None:
            self.fit(h)
        model = self._model(h)
        params = {k: v for k, v in self._params.items() if k != "smoothing_seasonal" or model.seasonal}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # fixed smoothing parameters; the initial states are still estimated on this history
            res = model.fit(**params, optimized=False)
        out = np.asarray(res.forecast(horizon), dtype=float)
        return np.maximum(0.0, np.nan_to_num(out, nan=float(h[-1])))


class LSTMForecaster(Forecaster):
    """The case study's LSTM: the last ``window`` periods in, the next ``max_horizon`` periods out (direct, one shot).

    Counts are divided by the training mean so that one network fits a trace of any rate. Training is full-batch
    Adam on ``threads`` threads (1) with a fixed seed: the same history gives the same weights and the same forecasts.
    torch's thread count is process-wide: in a process whose engine is running, pass ``threads=None`` (leave it as it
    is) rather than have training change it under the engine for a few seconds.
    """

    name = "lstm"

    def __init__(self, window: int = 12, max_horizon: int = 6, hidden: int = 16, epochs: int = 300,
                 lr: float = 0.01, seed: int = 0, threads: int | None = 1) -> None:
        self.window, self.max_horizon, self.hidden, self.threads = window, max_horizon, hidden, threads
        self.epochs, self.lr, self.seed = epochs, lr, seed
        self._net = None
        self._scale = 1.0

    def _build(self):
        import torch

        class Net(torch.nn.Module):
            def __init__(self, hidden: int, out: int) -> None:
                super().__init__()
                self.lstm = torch.nn.LSTM(input_size=1, hidden_size=hidden, batch_first=True)
                self.head = torch.nn.Linear(hidden, out)

            def forward(self, x):
                y, _ = self.lstm(x)
                return self.head(y[:, -1, :])

        return Net(self.hidden, self.max_horizon)

    def fit(self, history: np.ndarray) -> LSTMForecaster:
        import torch

        h = _check_history(history, self.window + self.max_horizon + 4)
        self._scale = max(1e-9, float(h.mean()))
        z = h / self._scale
        n = z.size - self.window - self.max_horizon + 1
        xs = np.stack([z[i:i + self.window] for i in range(n)])
        ys = np.stack([z[i + self.window:i + self.window + self.max_horizon] for i in range(n)])
        threads = torch.get_num_threads()
        if self.threads is not None:  # a fixed count: reproducible sums, and no fight for the cores
            torch.set_num_threads(self.threads)
        try:
            torch.manual_seed(self.seed)
            net = self._build()
            opt = torch.optim.Adam(net.parameters(), lr=self.lr)
            x = torch.tensor(xs, dtype=torch.float32).unsqueeze(-1)
            y = torch.tensor(ys, dtype=torch.float32)
            for _ in range(self.epochs):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
                opt.step()
        finally:
            if self.threads is not None:
                torch.set_num_threads(threads)
        self._net = net.eval()
        return self

    def forecast(self, history: np.ndarray, horizon: int) -> np.ndarray:
        import torch

        if horizon > self.max_horizon:
            raise ValueError(f"this LSTM predicts at most {self.max_horizon} periods ahead")
        h = _check_history(history, self.window)
        if self._net is None:
            self.fit(h)
        with torch.no_grad():
            x = torch.tensor(h[-self.window:] / self._scale, dtype=torch.float32).view(1, -1, 1)
            out = self._net(x).numpy()[0, :horizon].astype(float) * self._scale
        return np.maximum(0.0, out)


def default_forecasters(season: int | None, max_horizon: int, seed: int = 0) -> list[Forecaster]:
    """The set the backtest compares: the baselines, seasonal-naive when a season was found, Holt-Winters, LSTM."""
    out: list[Forecaster] = [LastValue(), MovingMean(6)]
    if season:
        out.append(SeasonalNaive(season))
    out.append(HoltWinters(season))
    out.append(LSTMForecaster(max_horizon=max_horizon, seed=seed))
    return out
