"""Rolling-origin backtest of arrival forecasters: MAE, MAPE and WAPE per horizon.

At every origin ``t`` (from ``first_origin`` to the last one that leaves ``max(horizons)`` periods to score), each
forecaster sees ``series[:t]`` only and predicts ``series[t:t + H]``. Forecasters are refitted every ``refit_every``
origins on the history they have then (never on the future), and forecast from the full history at every origin in
between. Every forecaster is scored on the same origins, so their errors compare like with like.

MAPE is taken over the periods with at least one arrival (a period with none has no percentage error) and says how
many it left out; WAPE (sum of absolute errors over sum of actuals) has no such hole and is the figure to rank by when
a trace has empty periods.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tailguard.plan.forecast import Forecaster, LastValue


@dataclass
class HorizonScore:
    horizon: int
    mae: float
    mape: float | None  # percent; None when every actual was zero
    wape: float | None  # percent
    mape_excluded_zero: int  # scored points left out of MAPE (actual zero)
    points: int

    def as_dict(self) -> dict:
        return {"horizon": self.horizon, "mae": self.mae, "mape_pct": self.mape, "wape_pct": self.wape,
                "mape_excluded_zero_actuals": self.mape_excluded_zero, "points": self.points}


@dataclass
class ForecasterScore:
    name: str
    horizons: list[HorizonScore]
    fits: int
    fit_seconds_max: float
    fit_seconds_total: float
    forecasts: np.ndarray = field(repr=False)  # [origin, horizon step]

    def mean_mae(self) -> float:
        return float(np.mean([h.mae for h in self.horizons]))

    def as_dict(self) -> dict:
        return {"forecaster": self.name, "horizons": [h.as_dict() for h in self.horizons],
                "mean_mae": self.mean_mae(), "fits": self.fits,
                "fit_seconds_max": self.fit_seconds_max, "fit_seconds_total": self.fit_seconds_total}


def score(actual: np.ndarray, predicted: np.ndarray, horizon: int) -> HorizonScore:
    a = np.asarray(actual, dtype=float)
    p = np.asarray(predicted, dtype=float)
    err = np.abs(a - p)
    nz = a > 0
    mape = float(np.mean(err[nz] / a[nz]) * 100) if nz.any() else None
    wape = float(err.sum() / a.sum() * 100) if a.sum() > 0 else None
    return HorizonScore(horizon, float(err.mean()), mape, wape, int((~nz).sum()), int(a.size))


def rolling_origin(series: np.ndarray, forecasters: Sequence[Forecaster], horizons: Sequence[int] = (1, 3, 6),
                   first_origin: int | None = None, refit_every: int = 1) -> list[ForecasterScore]:
    """Score each forecaster at every origin; see the module docstring."""
    y = np.asarray(series, dtype=float)
    hs = sorted(set(int(h) for h in horizons))
    if not hs or hs[0] < 1:
        raise ValueError("horizons must be >= 1")
    if refit_every < 1:
        raise ValueError("refit_every must be >= 1")
    max_h = hs[-1]
    first = first_origin if first_origin is not None else max(24, y.size // 2)
    origins = list(range(first, y.size - max_h + 1))
    if not origins:
        raise ValueError(f"a series of {y.size} periods leaves no origin at {first} with {max_h} periods to score")
    actual = np.stack([y[t:t + max_h] for t in origins])
    out = []
    for f in forecasters:
        preds = np.empty((len(origins), max_h))
        fit_times = []
        for i, t in enumerate(origins):
            if i % refit_every == 0:
                t0 = time.perf_counter()
                f.fit(y[:t])
                fit_times.append(time.perf_counter() - t0)
            preds[i] = f.forecast(y[:t], max_h)
        scores = [score(actual[:, h - 1], preds[:, h - 1], h) for h in hs]
        out.append(ForecasterScore(f.name, scores, len(fit_times), max(fit_times), sum(fit_times), preds))
    return out


def versus_last_value(scores: list[ForecasterScore]) -> dict:
    """Each forecaster's MAE as a ratio of last-value's, per horizon, and the winner by mean MAE over horizons."""
    base = next((s for s in scores if s.name == LastValue.name), None)
    ratios: dict[str, dict[str, float]] = {}
    if base is not None:
        for s in scores:
            ratios[s.name] = {str(h.horizon): (h.mae / b.mae if b.mae > 0 else float("nan"))
                              for h, b in zip(s.horizons, base.horizons)}
    winner = min(scores, key=lambda s: s.mean_mae())
    beats = base is not None and winner.name != base.name and winner.mean_mae() < base.mean_mae()
    return {"winner": winner.name, "winner_mean_mae": winner.mean_mae(),
            "last_value_mean_mae": base.mean_mae() if base else None,
            "winner_beats_last_value": bool(beats), "mae_ratio_to_last_value": ratios}
