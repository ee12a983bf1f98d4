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
    abs_errors: np.ndarray = field(repr=False)  # [origin, scored horizon], in the order of ``horizons``

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
        errors = np.abs(actual[:, [h - 1 for h in hs]] - preds[:, [h - 1 for h in hs]])
        out.append(ForecasterScore(f.name, scores, len(fit_times), max(fit_times), sum(fit_times), preds, errors))
    return out


def ratio_ci(errors: np.ndarray, base_errors: np.ndarray, block: int, reps: int = 2000, seed: int = 0,
             level: float = 0.95) -> tuple[float, float] | None:
    """Moving-block bootstrap CI of sum(errors) / sum(base_errors) over origins (paired: same origins resampled).

    Errors of neighbouring origins overlap in the periods they score, so origins are resampled in blocks of
    ``block`` (the longest horizon) rather than one by one.
    """
    e = np.asarray(errors, dtype=float).reshape(len(errors), -1).mean(axis=1)
    b = np.asarray(base_errors, dtype=float).reshape(len(base_errors), -1).mean(axis=1)
    n = e.size
    if n < 2 * block or b.sum() <= 0:
        return None
    rng = np.random.default_rng(seed)
    starts = np.arange(n - block + 1)
    k = int(np.ceil(n / block))
    ratios = np.empty(reps)
    for r in range(reps):
        idx = (rng.choice(starts, size=k)[:, None] + np.arange(block)[None, :]).ravel()[:n]
        bs = b[idx].sum()
        ratios[r] = e[idx].sum() / bs if bs > 0 else np.nan
    lo, hi = np.nanpercentile(ratios, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(lo), float(hi)


def versus_last_value(scores: list[ForecasterScore], seed: int = 0) -> dict:
    """Each forecaster's MAE as a ratio of last-value's (per horizon, and over all horizons with a 95% block-bootstrap
    CI), and the winner by mean MAE over horizons. A winner "beats" last-value only if its CI lies below 1."""
    base = next((s for s in scores if s.name == LastValue.name), None)
    ratios: dict[str, dict] = {}
    if base is not None:
        block = max(h.horizon for h in base.horizons)
        for s in scores:
            per_h = {str(h.horizon): (h.mae / b.mae if b.mae > 0 else None) for h, b in zip(s.horizons, base.horizons)}
            overall = s.mean_mae() / base.mean_mae() if base.mean_mae() > 0 else None
            ci = None if s is base else ratio_ci(s.abs_errors, base.abs_errors, block, seed=seed)
            ratios[s.name] = {"by_horizon": per_h, "overall": overall, "overall_ci95": list(ci) if ci else None}
    winner = min(scores, key=lambda s: s.mean_mae())
    lower = base is not None and winner.name != base.name and winner.mean_mae() < base.mean_mae()
    ci = ratios.get(winner.name, {}).get("overall_ci95")
    return {"winner": winner.name, "winner_mean_mae": winner.mean_mae(),
            "last_value_mean_mae": base.mean_mae() if base else None,
            "winner_beats_last_value": bool(lower),
            "winner_beats_last_value_beyond_noise": bool(lower and ci is not None and ci[1] < 1.0),
            "mae_ratio_to_last_value": ratios}
