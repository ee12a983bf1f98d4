"""Arrival schedules for open-loop load: when each request is meant to leave, in seconds from the start.

* ``poisson``: exponential gaps of mean 1/rate;
* ``gamma``: gamma gaps of mean 1/rate and shape ``burstiness`` (vLLM's convention: 1 is Poisson, below 1 is burstier,
  above 1 more regular; the coefficient of variation of the gaps is 1/sqrt(burstiness));
* ``constant``: evenly spaced;
* a trace's own offsets, divided by a speed-up factor.

Every schedule is a pure function of its arguments and the seed, so a run can be reproduced exactly.
"""

from __future__ import annotations

import numpy as np


def schedule(kind: str, rate: float, n: int | None = None, duration: float | None = None, seed: int = 0,
             burstiness: float = 1.0) -> np.ndarray:
    """Offsets (seconds, from 0) of ``n`` arrivals, or of every arrival before ``duration``."""
    if rate <= 0:
        raise ValueError("the rate must be positive")
    if n is None and duration is None:
        raise ValueError("give a number of requests or a duration")
    rng = np.random.default_rng(seed)
    mean = 1.0 / rate

    def gaps(k: int) -> np.ndarray:
        if kind == "poisson":
            return rng.exponential(mean, k)
        if kind == "gamma":
            if burstiness <= 0:
                raise ValueError("burstiness must be positive")
            return rng.gamma(burstiness, mean / burstiness, k)
        if kind == "constant":
            return np.full(k, mean)
        raise ValueError(f"unknown arrival process {kind!r}; choose poisson, gamma or constant")

    if n is not None:
        g = gaps(n)
        g[0] = 0.0  # the first request leaves at once
        out = np.cumsum(g)
        return out[out < duration] if duration is not None else out
    # by duration: draw in blocks until past the end
    chunks: list[np.ndarray] = []
    t = 0.0
    first = True
    while True:
        k = max(64, int(rate * (duration - t) * 1.2) + 16)
        g = gaps(k)
        if first:
            g[0] = 0.0
            first = False
        c = t + np.cumsum(g)
        chunks.append(c)
        t = float(c[-1])
        if t >= duration:
            break
    out = np.concatenate(chunks)
    return out[out < duration]


def scaled_offsets(offsets: list[float] | np.ndarray, speedup: float = 1.0) -> np.ndarray:
    """A trace's offsets replayed ``speedup`` times faster (2.0 halves every gap)."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    arr = np.asarray(offsets, dtype=float)
    return (arr - (arr[0] if len(arr) else 0.0)) / speedup


def achieved_rate(offsets: np.ndarray) -> float:
    """Arrivals per second over the schedule: (n - 1) / span."""
    if len(offsets) < 2:
        return float("nan")
    return (len(offsets) - 1) / float(offsets[-1] - offsets[0])
