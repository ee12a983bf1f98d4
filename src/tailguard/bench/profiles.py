"""SLO verdicts of a bench run, goodput, and the golden-rule advisories.

The profiles are the live monitor's (:mod:`tailguard.slo.profiles`): one model, one set of built-ins, one YAML file
for ``tailguard serve`` and ``tailguard bench``. Built in:

* ``baseline``: E2E P50 <= 450 ms, P95 <= 1.2 s, P99 <= 2 s; errors < 0.5%.
* ``advanced``: baseline, plus TTFT P99 <= 350 ms (mobile clients <= 300 ms and the VIP lane <= 200 ms, which a
  bench run cannot tell apart: not judged here); long-context decay: P99 E2E of prompts >= 64K tokens at most 40%
  above that of prompts < 8K; degraded answers < 2% (where the server marks them; a run counts as peak time).
* ``strict``: advanced, plus finance Q&A E2E P99 <= 1.5 s and medical report generation E2E P95 <= 3 s (for
  requests of business type ``finance`` / ``medical``; a run with no business types is held to the finance bound
  as a whole).

The baseline's percentiles do not say which latency they are of; we read them as E2E (the request's latency as
the user waits for it) and say so. The bench judges TTFT, ITL, TPOT and E2E objectives that select on business
type only, the error and degradation rates and the long-context decay; it names the objectives it cannot judge.
Custom profiles come from YAML (see ``load_profiles``): the monitor's shape, or the bench's own shape
(:func:`profile_from_dict`), read into the same model.

A verdict compares the point estimate with the threshold and says whether the bootstrap CI agrees: "pass" with the
whole CI under the threshold is certain; a CI that straddles it is "uncertain" (more requests would settle it).
Where the objective's sample is the one the percentile table describes (every measured request, none failed), the
verdict reuses that table's value and CI (``shared``), so that one figure has one CI wherever it is shown.
Goodput: completed requests per second that met every per-request bound of the profile (its ``request_bounds``,
or by default each judged metric's highest-percentile threshold per business type). A failed, cut-off or refused
(429) request is a miss everywhere: it enters each percentile objective in its scope above any threshold, and it is
never good for goodput (while still counting in goodput's denominator).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tailguard.bench.metrics import RequestMetrics
from tailguard.bench.stats import (
    SAMPLE_RULE,
    Bootstrap,
    enough_samples,
    min_samples,
    missed,
    pkey,
    with_misses,
)
from tailguard.slo.profiles import (
    BUILTIN_PROFILES,
    Metric,
    Objective,
    RequestBound,
    Selector,
    SLOProfile,
    get_profile,
    parse_profiles,
)

__all__ = [
    "BUILTIN",
    "METRICS",
    "Objective",
    "RequestBound",
    "SLOProfile",
    "bench_bounds",
    "describe",
    "evaluate",
    "from_monitor_profile",
    "golden_rules",
    "judged_objectives",
    "load_profiles",
    "meets_bounds",
    "parse_seconds",
    "plain_objective",
    "plain_words",
    "profile_from_dict",
    "slowest",
]

METRICS = ("ttft", "itl", "tpot", "e2e")

# The bench's built-in names (its default --profiles); every built-in of the monitor is accepted by name too.
BUILTIN: dict[str, Callable[[], SLOProfile]] = {
    name: (lambda name=name: get_profile(name)) for name in ("baseline", "advanced", "strict")
}


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:g} ms" if x < 1 else f"{x:g} s"


def describe(p: SLOProfile, o: Objective) -> str:
    """A bench check's name, e.g. ``E2E P99 <= 2 s [finance]``."""
    if o.name:
        return o.name
    bts = p.business_types_of(o)
    scope = f" [{'/'.join(bts)}]" if bts else ""
    return f"{o.metric.value.upper()} P{o.percentile:g} <= {_fmt_s(o.threshold)}{scope}"


# Words from the private requirement catalogue that the built-in profiles' descriptions carry; users never read that
# catalogue, so the bench names each thing by what it is.
_INSIDER_PHRASES = (
    (re.compile(r"\bthe seed's baseline\b", re.I), "the baseline SLO profile"),
    (re.compile(r"\bthe seed's advanced tier\b", re.I), "the advanced SLO profile"),
    (re.compile(r"\bthe seed's strict scenarios\b", re.I), "the strict SLO profile"),
    (re.compile(r"\bthe seed's (?:decision |selection )?tree\b", re.I), "the advisor's decision tree"),
    (re.compile(r"\bthe seed's golden rules?\b", re.I), "the golden rules"),
    (re.compile(r"\bthe seed's\s+", re.I), "the built-in "),
    (re.compile(r"\s*\(seed's golden rule\)", re.I), ""),
    (re.compile(r"\bstart the optimization plan now\b", re.I), "plan improvements now"),
    (re.compile(r"\bmake an improvement plan within 24 h\b", re.I), "plan improvements within a day"),
    # requirement codes: "(L1)", "(S1/S2)", ", M2)"
    (re.compile(r"\s*\((?:requirement\s+)?[A-Z][0-9](?:\s*[/,]\s*[A-Z][0-9])*\)"), ""),
    (re.compile(r",\s*[A-Z][0-9]\b(?=\s*[):])"), ""),
)


def plain_words(text: str) -> str:
    """``text`` without catalogue codes and insider names, e.g. "the seed's baseline" -> "the baseline SLO profile"."""
    for pattern, plain in _INSIDER_PHRASES:
        text = pattern.sub(plain, text)
    return text


_METRIC_WORDS = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "E2E", "queue_wait": "queue wait"}


def plain_objective(p: SLOProfile, o: Objective) -> str:
    """An objective in words, whether or not the bench judges it: "TTFT P99 <= 300 ms for mobile clients"."""
    if o.name:
        return o.name
    if not (o.is_latency and o.percentile is not None and o.threshold is not None):
        return o.label.replace("_", " ")
    metric = _METRIC_WORDS.get(o.metric.value, o.metric.value.replace("_", " "))
    w = o.where
    scope = [f"{'/'.join(p.business_types_of(o) or w.business_types)} requests" if w.business_types else "",
             f"{'/'.join(w.clients)} clients" if w.clients else "",
             f"the {'/'.join(w.lanes)} lane" if w.lanes else "",
             f"region {'/'.join(w.regions)}" if w.regions else "",
             "peak hours" if w.peak_only else ""]
    where = ", ".join(x for x in scope if x)
    return f"{metric} P{o.percentile:g} <= {_fmt_s(o.threshold)}" + (f" for {where}" if where else "")


def judged_objectives(p: SLOProfile) -> tuple[list[Objective], list[str]]:
    """The latency objectives the bench judges percentile by percentile (TTFT, ITL, TPOT, E2E, selecting on
    business type only), and the labels of the objectives it cannot judge at all."""
    judged, skipped = [], []
    for o in p.objectives:
        if o.metric is Metric.ERROR_RATE and o.where.is_empty:
            continue  # max_error_rate
        if o.metric is Metric.DEGRADATION_RATE and p.selects_on_business_types_only(o, ignore_peak=True):
            continue  # max_degraded_rate: a load test is peak time
        if o.metric is Metric.LONG_CONTEXT_DECAY and o.where.is_empty and o.of.value in METRICS:
            continue  # long_context
        if o.is_latency and o.metric.value in METRICS and p.selects_on_business_types_only(o):
            judged.append(o)
        else:
            skipped.append(o.label)
    return judged, skipped


def from_monitor_profile(mp: SLOProfile) -> SLOProfile:
    """The profile itself, once checked that the bench can judge something in it (there is one profile model)."""
    judged, _ = judged_objectives(mp)
    if not judged and mp.max_error_rate is None:
        _, skipped = judged_objectives(mp)
        raise ValueError(f"profile {mp.name!r}: none of its objectives can be judged by the bench "
                         f"({', '.join(skipped)})")
    return mp


_UNIT = re.compile(r"^\s*([0-9.]+)\s*(ms|s|us|µs)?\s*$")


def parse_seconds(v: Any) -> float:
    """350 (seconds as a number), "350ms", "1.2s", "200 us" -> seconds."""
    if isinstance(v, (int, float)):
        return float(v)
    m = _UNIT.match(str(v))
    if not m:
        raise ValueError(f"not a duration: {v!r} (use a number of seconds or e.g. '350ms', '1.2s')")
    x = float(m.group(1))
    return x / 1e3 if m.group(2) == "ms" else x / 1e6 if m.group(2) in ("us", "µs") else x


def _threshold(d: dict) -> float:
    if "threshold_ms" in d:
        return float(d["threshold_ms"]) / 1e3
    if "threshold" in d:
        return parse_seconds(d["threshold"])
    if "threshold_s" in d:
        return float(d["threshold_s"])
    raise ValueError(f"objective needs threshold, threshold_ms or threshold_s: {d}")


def _bt(d: dict) -> tuple[str, ...]:
    v = d.get("business_types", d.get("business_type", ()))
    return (v,) if isinstance(v, str) else tuple(v or ())


def profile_from_dict(d: dict) -> SLOProfile:
    """One profile from the bench's own YAML shape, read into the shared model; ``extends`` starts from a built-in
    and an objective with the label of an inherited one replaces it.

    ::

        name: chat-eu
        extends: baseline            # optional
        description: EU chat tier
        max_error_rate: 0.01
        objectives:
          - {metric: ttft, percentile: 99, threshold: 500ms}
          - {metric: e2e, percentile: 95, threshold: 1.5s, business_types: [vip]}
        request_bounds:              # per-request bounds that define goodput (default: from the objectives)
          - {metric: e2e, threshold: 2s}
        long_context: {long_min_tokens: 32768, short_max_tokens: 4096, max_increase: 0.5}
    """
    if "name" not in d:
        raise ValueError("a profile needs a name")
    base_name = d.get("extends")
    objs: dict[str, Objective] = {}
    description, bounds = "", None
    if base_name:
        if base_name not in BUILTIN and base_name not in BUILTIN_PROFILES:
            raise ValueError(f"extends: unknown built-in profile {base_name!r}")
        base = get_profile(str(base_name))
        objs = {o.label: o for o in base.objectives}
        description, bounds = base.description, base.request_bounds

    def put(o: Objective) -> None:
        objs[o.label] = o

    def drop(metric: Metric) -> None:
        for label in [k for k, o in objs.items() if o.metric is metric]:
            del objs[label]

    if "max_error_rate" in d:
        drop(Metric.ERROR_RATE)
        if d["max_error_rate"] is not None:
            put(Objective(metric=Metric.ERROR_RATE, threshold=float(d["max_error_rate"]), comparison="<"))
    for o in d.get("objectives", ()) or ():
        metric = str(o.get("metric", "")).lower()
        if metric not in METRICS:
            raise ValueError(f"objective metric must be one of {', '.join(METRICS)}: {o}")
        pct = float(str(o.get("percentile", o.get("p", ""))).lstrip("pP") or "nan")
        if not 0 < pct < 100:
            raise ValueError(f"objective percentile must be in (0, 100): {o}")
        put(Objective(metric=Metric(metric), percentile=pct, threshold=_threshold(o),
                      where=Selector(business_types=tuple(b.lower() for b in _bt(o))),
                      name=str(o["label"]) if o.get("label") else None,
                      all_if_unlabelled=bool(o.get("all_if_unlabelled", False))))
    if d.get("request_bounds"):
        derived = bounds if bounds is not None else (get_profile(str(base_name)).goodput_bounds() if base_name
                                                     else ())
        extra = []
        for b in d["request_bounds"]:
            metric = str(b.get("metric", "")).lower()
            if metric not in METRICS:
                raise ValueError(f"request bound metric must be one of {', '.join(METRICS)}: {b}")
            extra.append(RequestBound(metric=Metric(metric), threshold=_threshold(b), business_types=_bt(b),
                                      all_if_unlabelled=bool(b.get("all_if_unlabelled", False))))
        bounds = (*derived, *extra)
    if d.get("long_context"):
        lc = dict(d["long_context"])
        drop(Metric.LONG_CONTEXT_DECAY)
        put(Objective(metric=Metric.LONG_CONTEXT_DECAY, percentile=99, threshold=lc.pop("max_increase", 0.40),
                      of=Metric(lc.pop("metric", "e2e")), **lc))
    if "max_degraded_rate" in d:
        drop(Metric.DEGRADATION_RATE)
        if d["max_degraded_rate"] is not None:
            put(Objective(metric=Metric.DEGRADATION_RATE, threshold=float(d["max_degraded_rate"]), comparison="<"))
    if not objs:
        raise ValueError(f"profile {d['name']!r} has no objectives")
    return SLOProfile(name=str(d["name"]), description=str(d.get("description", description)),
                      objectives=tuple(objs.values()), request_bounds=bounds)


def _is_monitor_format(doc: Any) -> bool:
    """``profiles: {name: {...}}`` (a mapping of named profiles, as ``tailguard serve`` reads) rather than the
    bench's own ``profiles: [...]`` or single-profile shape."""
    return isinstance(doc, dict) and isinstance(doc.get("profiles"), dict)


def load_profiles(names: list[str]) -> list[SLOProfile]:
    """Built-in names and YAML files: the bench's shape (one profile, or ``profiles: [...]``) or the live monitor's
    (``profiles: {name: {...}}``, see docs/slo.md), so that one file serves ``serve`` and ``bench``."""
    out: list[SLOProfile] = []
    for n in names:
        path = Path(n)
        if not path.is_file():
            try:
                out.append(get_profile(n))
            except KeyError:
                raise ValueError(f"unknown SLO profile {n!r}: use {', '.join(BUILTIN_PROFILES)} or a YAML "
                                 "file") from None
            continue
        import yaml

        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        if _is_monitor_format(doc):
            out.extend(from_monitor_profile(mp) for mp in parse_profiles(doc, str(path)).values())
            continue
        items = doc.get("profiles") if isinstance(doc, dict) and "profiles" in doc else [doc]
        for item in items:
            if not isinstance(item, dict):
                raise ValueError(f"{path}: a profile must be a mapping")
            out.append(profile_from_dict(item))
    return out


# --- evaluation -----------------------------------------------------------------------------------------------

def _in_scope(m: RequestMetrics, bts: tuple[str, ...], all_if_unlabelled: bool, unlabelled_run: bool) -> bool:
    if not bts:
        return True
    if all_if_unlabelled and unlabelled_run:
        return True
    return (m.business_type or "").lower() in bts


def _values(rows: list[RequestMetrics], metric: str) -> tuple[list[float], list[int] | None]:
    if metric == "itl":
        vals, owner = [], []
        for m in rows:
            vals.extend(m.itl)
            owner.extend([m.index] * len(m.itl))
        return vals, owner
    return [getattr(m, metric) for m in rows if getattr(m, metric) is not None], None


def bench_bounds(p: SLOProfile) -> tuple[RequestBound, ...]:
    """The per-request bounds of goodput, on the metrics a bench request carries."""
    return tuple(b for b in p.goodput_bounds(judged_objectives(p)[0]) if b.metric.value in METRICS)


def meets_bounds(m: RequestMetrics, p: SLOProfile, unlabelled_run: bool,
                 bounds: tuple[RequestBound, ...] | None = None) -> bool:
    if not m.ok:
        return False
    for b in bench_bounds(p) if bounds is None else bounds:
        if not _in_scope(m, tuple(x.lower() for x in b.business_types), b.all_if_unlabelled, unlabelled_run):
            continue
        v = (max(m.itl) if m.itl else 0.0) if b.metric is Metric.ITL else getattr(m, b.metric.value)
        if v is None or v > b.threshold:
            return False
    return True


def _shared_percentile(shared: dict | None, metric: str, q: float, n_values: int) -> dict | None:
    """The percentile table's entry for this figure, when it describes exactly the objective's sample."""
    if not shared:
        return None
    d = shared.get(metric) or {}
    entry = (d.get("percentiles") or {}).get(pkey(q))
    # the same count of the same requests' values: the table's sample is every completed request, so is this one
    if entry is None or d.get("count") != n_values or d.get("failures_at_timeout"):
        return None
    return entry


def evaluate(p: SLOProfile, measured: list[RequestMetrics], window: float, reps: int = 1000, seed: int = 0,
             degraded: int | None = None, shared: dict | None = None) -> dict:
    """The profile's verdict on ``measured``. ``shared``: the run's percentile table (``metrics`` of the results);
    an objective over the same sample takes its value and CI from there instead of bootstrapping again."""
    ok = [m for m in measured if m.ok]
    unlabelled = all(not m.business_type for m in measured)
    checks: list[dict] = []
    judged, not_judged = judged_objectives(p)
    for o in judged:
        assert o.percentile is not None  # a latency objective
        rows = [m for m in measured if _in_scope(m, p.business_types_of(o), o.all_if_unlabelled, unlabelled)]
        good_rows = [m for m in rows if m.ok]
        # a failed, cut-off or refused request in scope is a miss of the objective, not a request that never was
        vals, owner = with_misses(*_values(good_rows, o.metric.value), len(rows) - len(good_rows))
        c = {"objective": describe(p, o), "metric": o.metric.value, "percentile": o.percentile,
             "threshold_s": o.threshold, "requests": len(rows), "failed_in_scope": len(rows) - len(good_rows)}
        if not vals:
            c.update(status="n/a", value_s=None, ci_s=None, note="no requests in scope")
            checks.append(c)
            continue
        whole_run = len(rows) == len(measured) and len(good_rows) == len(rows)
        entry = _shared_percentile(shared, o.metric.value, o.percentile, len(vals)) if whole_run else None
        if entry is not None and entry.get("value") is not None:
            v = entry["value"]
            ci = tuple(entry["ci"]) if entry.get("ci") else None
            c["ci_from"] = "percentile table"
        else:
            bs = Bootstrap(vals, owner, (o.percentile,), reps, seed)
            v = bs.point[o.percentile]
            ci = bs.ci(o.percentile)
        c["samples"] = len(vals)
        c["min_samples"] = min_samples(o.percentile)
        c["enough_samples"] = enough_samples(len(vals), o.percentile)
        passed = v <= o.threshold
        certain = ci is not None and (ci[1] <= o.threshold if passed else ci[0] > o.threshold)
        c.update(status="pass" if passed else "fail", value_s=None if missed(v) else v,
                 ci_s=[None if missed(x) else x for x in ci] if ci else None, certain=bool(certain),
                 headroom=None if missed(v) else (o.threshold - v) / o.threshold)
        if missed(v):
            c["note"] = f"P{o.percentile:g} falls on failed requests ({c['failed_in_scope']} in scope count as misses)"
        elif not certain:
            c["note"] = "the threshold lies inside the confidence interval: more requests would settle it"
        if not c["enough_samples"]:
            few = (f"only {len(vals)} samples: P{o.percentile:g} needs at least {c['min_samples']} for a tail "
                   "estimate (at least one sample beyond it)")
            c["note"] = f"{c['note']}; {few}" if c.get("note") else few
        checks.append(c)
    if p.max_error_rate is not None:
        n = len(measured)
        err = (n - len(ok)) / n if n else float("nan")
        lo, hi = _wilson(n - len(ok), n)
        checks.append({"objective": f"error rate < {p.max_error_rate * 100:g}%", "metric": "error_rate",
                       "threshold": p.max_error_rate, "value": err, "ci": [lo, hi], "requests": n,
                       "status": "n/a" if not n else ("pass" if err < p.max_error_rate else "fail"),
                       "certain": bool(n and (hi < p.max_error_rate if err < p.max_error_rate
                                              else lo >= p.max_error_rate))})
    if p.long_context is not None:
        checks.append(_long_context(p.long_context, ok))
    if p.max_degraded_rate is not None:
        if degraded is None:
            checks.append({"objective": f"degraded answers < {p.max_degraded_rate * 100:g}%", "metric": "degraded",
                           "status": "n/a", "note": "the server does not mark degraded answers"})
        else:
            rate = degraded / len(ok) if ok else 0.0
            checks.append({"objective": f"degraded answers < {p.max_degraded_rate * 100:g}%", "metric": "degraded",
                           "value": rate, "status": "pass" if rate < p.max_degraded_rate else "fail"})
    bounds = bench_bounds(p)
    good = sum(1 for m in ok if meets_bounds(m, p, unlabelled, bounds))
    statuses = [c["status"] for c in checks]
    about = plain_words(p.description)
    not_judged_words = [plain_objective(p, o) for o in p.objectives if o.label in not_judged]
    description = about
    if not_judged:  # said, not silently dropped
        description = f"{description} (not judged by the bench: {', '.join(not_judged)})".strip()
    return {
        "profile": p.name,
        "description": description,
        "about": about,
        "not_judged": not_judged,
        "not_judged_described": not_judged_words,
        "sample_rule": SAMPLE_RULE,
        "pass": "fail" not in statuses and "pass" in statuses,
        "evaluated": sum(1 for s in statuses if s != "n/a"),
        "checks": checks,
        "goodput_rps": good / window if window and window > 0 else None,
        "goodput_ratio": good / len(measured) if measured else None,
        "good_requests": good,
        "failed_requests": len(measured) - len(ok),  # each one a miss: never good, always in the denominator
    }


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def _long_context(rule: Objective, ok: list[RequestMetrics]) -> dict:
    """A long_context_decay objective: P(long) / P(short) - 1 <= threshold."""

    def toks(m: RequestMetrics) -> int:
        return m.prompt_tokens or m.prompt_tokens_local or m.prompt_tokens_target or 0

    metric, pct, max_increase = rule.of.value, rule.percentile or 99.0, rule.threshold
    long_v = [v for m in ok if toks(m) >= rule.long_min_tokens and (v := getattr(m, metric)) is not None]
    short_v = [v for m in ok if 0 < toks(m) < rule.short_max_tokens and (v := getattr(m, metric)) is not None]
    c = {"objective": f"long-context decay: P{pct:g} {metric.upper()} at >= {rule.long_min_tokens // 1024}K tokens "
                      f"<= {1 + max_increase:g} x P{pct:g} below {rule.short_max_tokens // 1024}K",
         "metric": "long_context_decay", "threshold": max_increase}
    if not long_v or not short_v:
        c.update(status="n/a", note=f"needs prompts both >= {rule.long_min_tokens} and < {rule.short_max_tokens} "
                                    "tokens in one run (use --workload long and a mixed length spread)")
        return c
    inc = float(np.percentile(long_v, pct)) / float(np.percentile(short_v, pct)) - 1
    c.update(value=inc, status="pass" if inc <= max_increase else "fail", requests=len(long_v) + len(short_v))
    return c


# --- golden rules ---------------------------------------------------------------------------------------------

def golden_rules(metrics: dict, names=("e2e", "ttft")) -> list[dict]:
    """P99 > 3 x P50 (plan improvements now) and P99 > 1.5 x P95 (plan improvements within a day), as advisories.

    These ratios fire on healthy lognormal traffic (a lognormal of sigma 0.5 already has P99/P50 = 3.2), so each
    advisory is calibrated: the body of the distribution (P50, P90) is fitted with a lognormal, and the advisory is
    a *warning* only when the observed P99 is also well above what that body predicts (a real tail); otherwise it is
    *info*: the spread is wide but the tail is what such a body implies, and the action says so rather than urging
    a fix of a tail that is not there.
    """
    out = []
    for name in names:
        pc = (metrics.get(name) or {}).get("percentiles") or {}
        try:
            p50, p90, p95, p99 = (pc[k]["value"] for k in ("p50", "p90", "p95", "p99"))
        except (KeyError, TypeError):
            continue
        if not p50 or p50 <= 0 or p90 is None or p99 is None or p95 is None:
            continue
        sigma = math.log(p90 / p50) / 1.2815515655446004 if p90 > p50 else 0.0
        predicted_p99 = p50 * math.exp(2.3263478740408408 * sigma)
        heavy = p99 > 1.25 * predicted_p99
        for ratio, limit, urgency, rule in ((p99 / p50, 3.0, "now", "P99 > 3 x P50"),
                                            (p99 / p95 if p95 else float("nan"), 1.5, "within a day",
                                             "P99 > 1.5 x P95")):
            fired = ratio > limit
            if not fired:
                action = note = None
            elif heavy:  # a real tail: the slowest requests are slower than the typical ones' spread explains
                action = f"Plan improvements {urgency}: find what makes the slowest requests slow"
                note = (f"The tail is heavier than the body predicts: P99 is {(p99 / predicted_p99 - 1) * 100:.0f}% "
                        "above a lognormal fit of P50 and P90.")
            else:  # wide, but no separate tail: urging a tail fix here would contradict the evidence
                action = "No tail to chase: to narrow the spread, make the typical request faster"
                note = ("The ratio is what a lognormal body of this spread implies: the latencies vary widely, "
                        "but the slowest requests are not anomalous.")
            out.append({
                "metric": name, "rule": rule, "ratio": ratio, "limit": limit, "fired": fired,
                "severity": ("warning" if heavy else "info") if fired else "ok",
                "action": action,
                "lognormal_predicted_p99_s": predicted_p99, "observed_p99_s": p99,
                "note": note,
            })
    return out


def slowest(measured: list[RequestMetrics], n: int = 10) -> list[dict]:
    rows = sorted((m for m in measured if m.ok and m.e2e is not None), key=lambda m: m.e2e, reverse=True)[:n]
    return [{"request_id": m.request_id, "server_request_id": m.server_request_id, "e2e_s": m.e2e,
             "ttft_s": m.ttft, "output_tokens": m.output_tokens, "prompt_tokens": m.prompt_tokens or
             m.prompt_tokens_local, "lang": m.lang, "slow_stage": m.slow_stage, "stage_source": m.stage_source,
             "stages_s": m.stages} for m in rows]
