"""Percentiles with bootstrap confidence intervals, and the bootstrap of a difference between two runs.

Percentiles use linear interpolation between order statistics (numpy's default, as vLLM's bench does). The bootstrap
resamples *requests*: for per-request metrics (TTFT, E2E, TPOT) each value is its own cluster; for ITL, whose gaps
within one request are correlated, all gaps of a request are resampled together (a cluster bootstrap), so the
interval is not falsely narrow. Each replicate is computed from multinomial weights over the sorted values, which
costs O(n) and no sort.
"""

from __future__ import annotations

import math

import numpy as np

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
DEFAULT_BOOTSTRAP = 1000


def pkey(q: float) -> str:
    """50 -> 'p50', 99.9 -> 'p99.9'."""
    return f"p{q:g}"


def min_samples(q: float) -> int:
    """The fewest samples for which at least one lies beyond percentile ``q``: P99 needs 100, P99.9 needs 1000.

    With fewer, the interpolated "P99" sits between the two largest values: it describes the few slowest requests
    seen, not the tail of the distribution.
    """
    return max(1, math.ceil(round(100.0 / (100.0 - q), 9))) if q < 100 else 1


def enough_samples(n: int, q: float) -> bool:
    return n >= min_samples(q)


SAMPLE_RULE = ("a percentile Pq needs at least 100 / (100 - q) samples, so that at least one lies beyond it: "
               "P90 needs 10, P95 20, P99 100, P99.9 1000")


def percentile(values, q: float) -> float:
    arr = np.asarray(values, dtype=float)
    return float(np.percentile(arr, q)) if arr.size else float("nan")


class Bootstrap:
    """Bootstrap replicates of several percentiles of one sample (optionally clustered by request)."""

    def __init__(self, values, clusters=None, qs=PERCENTILES, reps: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> None:
        v = np.asarray(values, dtype=float)
        self.qs = tuple(qs)
        self.n = int(v.size)
        order = np.argsort(v, kind="stable")
        self.sorted = v[order]
        if clusters is None:
            owner = np.arange(self.n)
            k = self.n
        else:
            c = np.asarray(clusters)
            _, owner_all = np.unique(c, return_inverse=True)
            owner = owner_all[order]
            k = int(owner_all.max()) + 1 if self.n else 0
        self.k = k
        self.point = {q: percentile(v, q) for q in self.qs}
        self.reps = np.full((reps, len(self.qs)), np.nan)
        if self.n < 2 or k < 2:
            return
        rng = np.random.default_rng(seed)
        s = self.sorted
        qfrac = np.array(self.qs) / 100.0
        for b in range(reps):
            counts = np.bincount(rng.integers(0, k, k), minlength=k)
            cw = np.cumsum(counts[owner])
            total = int(cw[-1])
            if total < 1:
                continue
            pos = qfrac * (total - 1)
            lo = np.floor(pos)
            frac = pos - lo
            i_lo = np.searchsorted(cw, lo, side="right")
            i_hi = np.searchsorted(cw, np.minimum(lo + 1, total - 1), side="right")
            self.reps[b] = s[i_lo] + frac * (s[i_hi] - s[i_lo])

    def ci(self, q: float, level: float = 0.95) -> tuple[float, float] | None:
        j = self.qs.index(q)
        col = self.reps[:, j]
        col = col[~np.isnan(col)]
        if col.size < 10:
            return None
        a = (1 - level) / 2 * 100
        return float(np.percentile(col, a)), float(np.percentile(col, 100 - a))

    def summary(self, level: float = 0.95) -> dict:
        out: dict = {}
        for q in self.qs:
            ci = self.ci(q, level)
            out[pkey(q)] = {
                "value": _f(self.point[q]),
                "ci": [_f(ci[0]), _f(ci[1])] if ci else None,
                # how many samples lie beyond this percentile: below ~5 its estimate rests on a handful of requests
                "samples_beyond": int(round(self.n * (1 - q / 100.0))),
                "min_samples": min_samples(q),
                "enough_samples": enough_samples(self.n, q),
            }
        return out


def describe(values, clusters=None, qs=PERCENTILES, reps: int = DEFAULT_BOOTSTRAP, seed: int = 0,
             level: float = 0.95) -> dict:
    """count, mean, std, min, max and each percentile with its bootstrap CI (seconds in, seconds out)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, "max": None, "percentiles": {}}
    bs = Bootstrap(v, clusters, qs, reps, seed)
    return {"count": int(v.size), "clusters": bs.k, "mean": _f(v.mean()), "std": _f(v.std()),
            "min": _f(v.min()), "max": _f(v.max()), "percentiles": bs.summary(level), "ci_level": level,
            "bootstrap_reps": reps}


def diff_test(a_values, b_values, q: float, a_clusters=None, b_clusters=None, reps: int = DEFAULT_BOOTSTRAP,
              seed: int = 0, level: float = 0.95) -> dict:
    """B minus A at percentile ``q``: the point difference, its bootstrap CI and a two-sided p-value."""
    ba = Bootstrap(a_values, a_clusters, (q,), reps, seed)
    bb = Bootstrap(b_values, b_clusters, (q,), reps, seed + 1)
    pa, pb = ba.point[q], bb.point[q]
    d = bb.reps[:, 0] - ba.reps[:, 0]
    d = d[~np.isnan(d)]
    out = {"a": _f(pa), "b": _f(pb), "delta": _f(pb - pa), "rel": _f((pb - pa) / pa) if pa else None,
           "ci": None, "p_value": None, "significant": False}
    if d.size >= 10:
        alpha = (1 - level) / 2 * 100
        lo, hi = float(np.percentile(d, alpha)), float(np.percentile(d, 100 - alpha))
        # two-sided bootstrap p-value: how often the resampled difference lands on the other side of zero
        p = 2 * min(float(np.mean(d <= 0)), float(np.mean(d >= 0)))
        out.update(ci=[lo, hi], p_value=min(1.0, p), significant=bool(lo > 0 or hi < 0))
    return out


# A failed request in an SLO verdict: a value above every threshold (finite, so that the bootstrap's interpolation
# between order statistics stays defined; ``math.inf`` would give inf - inf = nan there).
MISS = 1e300


def with_misses(values, clusters, misses: int) -> tuple[list[float], list | None]:
    """``values`` plus ``misses`` failed requests, each a miss of any threshold (``MISS``) in its own cluster."""
    vals = list(values) + [MISS] * misses
    if clusters is None:
        return vals, None
    first = max((int(c) for c in clusters), default=-1) + 1
    return vals, list(clusters) + list(range(first, first + misses))


# No latency comes near this; a percentile interpolated even a sliver of the way towards a ``MISS`` lands above it.
_MISSED_ABOVE = 1e100


def missed(x: float | None) -> bool:
    """True when a percentile landed on (or between a completed request and) a failed one: it has no latency."""
    return x is not None and x >= _MISSED_ABOVE


def _f(x) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if np.isnan(x) else x
