"""SLO profiles (requirement S1), their verdicts, goodput, and the golden-rule advisories (S5).

Built in, from the seed:

* ``baseline``: E2E P50 <= 450 ms, P95 <= 1.2 s, P99 <= 2 s; errors < 0.5%.
* ``advanced``: baseline, plus TTFT P99 <= 350 ms (mobile <= 300 ms, VIP <= 200 ms, for requests whose business
  type is ``mobile`` or ``vip``); long-context decay: P99 E2E of prompts >= 64K tokens at most 40% above that of
  prompts < 8K; degraded answers < 2% (where the server marks them).
* ``strict``: advanced, plus finance Q&A E2E P99 <= 1.5 s and medical report generation E2E P95 <= 3 s (for
  requests of business type ``finance`` / ``medical``; a run with no business types is held to the finance bound
  as a whole).

The seed does not say which latency its baseline percentiles are of; we read them as E2E (the request's latency as
the user waits for it) and say so. Custom profiles come from YAML (see ``load_profiles``).

A verdict compares the point estimate with the threshold and says whether the bootstrap CI agrees: "pass" with the
whole CI under the threshold is certain; a CI that straddles it is "uncertain" (more requests would settle it).
Goodput: completed requests per second that met every per-request bound of the profile. A failed, cut-off or
refused (429) request is a miss everywhere: it enters each percentile objective in its scope above any threshold, and
it is never good for goodput (while still counting in goodput's denominator).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tailguard.bench.metrics import RequestMetrics
from tailguard.bench.stats import Bootstrap, missed, with_misses

METRICS = ("ttft", "itl", "tpot", "e2e")


@dataclass
class Objective:
    metric: str  # ttft | itl | tpot | e2e
    percentile: float
    threshold: float  # seconds
    label: str = ""
    business_types: tuple[str, ...] = ()  # only requests of these business types; () = all
    all_if_unlabelled: bool = False  # no request has a business type: apply to the whole run

    def describe(self) -> str:
        scope = f" [{'/'.join(self.business_types)}]" if self.business_types else ""
        return self.label or f"{self.metric.upper()} P{self.percentile:g} <= {_fmt_s(self.threshold)}{scope}"


@dataclass
class RequestBound:
    """A per-request bound for goodput: ``metric <= threshold`` (optionally only for some business types)."""

    metric: str
    threshold: float
    business_types: tuple[str, ...] = ()
    all_if_unlabelled: bool = False


@dataclass
class LongContextRule:
    long_min_tokens: int = 65536
    short_max_tokens: int = 8192
    max_increase: float = 0.40  # P99 of long at most 40% above P99 of short
    metric: str = "e2e"


@dataclass
class SLOProfile:
    name: str
    description: str = ""
    objectives: list[Objective] = field(default_factory=list)
    max_error_rate: float | None = None
    request_bounds: list[RequestBound] = field(default_factory=list)
    long_context: LongContextRule | None = None
    max_degraded_rate: float | None = None

    def to_dict(self) -> dict:
        return {
            "name": self.name, "description": self.description, "max_error_rate": self.max_error_rate,
            "objectives": [{"metric": o.metric, "percentile": o.percentile, "threshold_s": o.threshold,
                            "business_types": list(o.business_types), "label": o.describe()} for o in self.objectives],
            "request_bounds": [{"metric": b.metric, "threshold_s": b.threshold,
                                "business_types": list(b.business_types)} for b in self.request_bounds],
            "long_context": None if self.long_context is None else vars(self.long_context),
            "max_degraded_rate": self.max_degraded_rate,
        }


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:g} ms" if x < 1 else f"{x:g} s"


def _baseline() -> SLOProfile:
    return SLOProfile(
        "baseline", "seed baseline: E2E P50 <= 450 ms, P95 <= 1.2 s, P99 <= 2 s, errors < 0.5%",
        objectives=[Objective("e2e", 50, 0.45), Objective("e2e", 95, 1.2), Objective("e2e", 99, 2.0)],
        max_error_rate=0.005, request_bounds=[RequestBound("e2e", 2.0)],
    )


def _advanced() -> SLOProfile:
    p = _baseline()
    p.name = "advanced"
    p.description = ("seed advanced: baseline + TTFT <= 350 ms (mobile 300 ms, VIP 200 ms), long-context decay "
                     "<= 40% at 64K, degraded answers < 2%")
    p.objectives += [Objective("ttft", 99, 0.35), Objective("ttft", 99, 0.30, business_types=("mobile",)),
                     Objective("ttft", 99, 0.20, business_types=("vip",))]
    p.request_bounds += [RequestBound("ttft", 0.35), RequestBound("ttft", 0.30, ("mobile",)),
                         RequestBound("ttft", 0.20, ("vip",))]
    p.long_context = LongContextRule()
    p.max_degraded_rate = 0.02
    return p


def _strict() -> SLOProfile:
    p = _advanced()
    p.name = "strict"
    p.description = ("seed strict scenarios: advanced + finance Q&A E2E P99 <= 1.5 s, medical report generation "
                     "E2E P95 <= 3 s")
    p.objectives += [Objective("e2e", 99, 1.5, "finance Q&A: E2E P99 <= 1.5 s", ("finance",), True),
                     Objective("e2e", 95, 3.0, "medical reports: E2E P95 <= 3 s", ("medical",))]
    p.request_bounds += [RequestBound("e2e", 1.5, ("finance",), True)]
    return p


BUILTIN = {"baseline": _baseline, "advanced": _advanced, "strict": _strict}

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
    """One profile from a mapping (the YAML shape below); ``extends`` starts from a built-in.

    ::

        name: chat-eu
        extends: baseline            # optional
        description: EU chat tier
        max_error_rate: 0.01
        objectives:
          - {metric: ttft, percentile: 99, threshold: 500ms}
          - {metric: e2e, percentile: 95, threshold: 1.5s, business_types: [vip]}
        request_bounds:              # per-request bounds that define goodput
          - {metric: e2e, threshold: 2s}
        long_context: {long_min_tokens: 32768, short_max_tokens: 4096, max_increase: 0.5}
    """
    if "name" not in d:
        raise ValueError("a profile needs a name")
    base = d.get("extends")
    if base:
        if base not in BUILTIN:
            raise ValueError(f"extends: unknown built-in profile {base!r}")
        p = BUILTIN[base]()
        p.name = str(d["name"])
    else:
        p = SLOProfile(str(d["name"]))
    p.description = str(d.get("description", p.description))
    if "max_error_rate" in d:
        p.max_error_rate = None if d["max_error_rate"] is None else float(d["max_error_rate"])
    for o in d.get("objectives", ()) or ():
        metric = str(o.get("metric", "")).lower()
        if metric not in METRICS:
            raise ValueError(f"objective metric must be one of {', '.join(METRICS)}: {o}")
        pct = float(str(o.get("percentile", o.get("p", ""))).lstrip("pP") or "nan")
        if not 0 < pct < 100:
            raise ValueError(f"objective percentile must be in (0, 100): {o}")
        p.objectives.append(Objective(metric, pct, _threshold(o), str(o.get("label", "")), _bt(o),
                                      bool(o.get("all_if_unlabelled", False))))
    for b in d.get("request_bounds", ()) or ():
        metric = str(b.get("metric", "")).lower()
        if metric not in METRICS:
            raise ValueError(f"request bound metric must be one of {', '.join(METRICS)}: {b}")
        p.request_bounds.append(RequestBound(metric, _threshold(b), _bt(b), bool(b.get("all_if_unlabelled", False))))
    if d.get("long_context"):
        p.long_context = LongContextRule(**d["long_context"])
    if "max_degraded_rate" in d:
        p.max_degraded_rate = d["max_degraded_rate"]
    if not p.objectives and p.max_error_rate is None:
        raise ValueError(f"profile {p.name!r} has no objectives")
    return p


def from_monitor_profile(mp) -> SLOProfile:
    """The bench's view of a live monitor profile (``tailguard.slo.profiles.SLOProfile``, the YAML that
    ``tailguard serve`` reads), so one profiles file serves both. The bench judges TTFT, ITL, TPOT and E2E by
    business type; objectives on other metrics or on lanes, clients, regions or peak hours are named in the
    description as not judged here. Goodput bounds: per metric and scope, the threshold of its highest percentile."""
    from tailguard.slo.profiles import LATENCY_METRICS, Metric

    p = SLOProfile(mp.name, mp.description)
    skipped: list[str] = []
    top: dict[tuple[str, tuple[str, ...]], tuple[float, float]] = {}
    for o in mp.objectives:
        bts = tuple(b.lower() for b in (o.where.business_types or mp.applies_to.business_types))
        if any(sel.lanes or sel.clients or sel.regions or sel.peak_only or sel.min_input_tokens is not None
               or sel.max_input_tokens is not None for sel in (o.where, mp.applies_to)):
            skipped.append(o.label)
        elif o.metric in LATENCY_METRICS and o.metric.value in METRICS and o.percentile is not None:
            p.objectives.append(Objective(o.metric.value, o.percentile, o.threshold, business_types=bts))
            key = (o.metric.value, bts)
            if key not in top or o.percentile > top[key][0]:
                top[key] = (o.percentile, o.threshold)
        elif o.metric is Metric.ERROR_RATE:
            p.max_error_rate = o.threshold
        elif o.metric is Metric.DEGRADATION_RATE:
            p.max_degraded_rate = o.threshold
        elif o.metric is Metric.LONG_CONTEXT_DECAY and o.of.value in METRICS:
            p.long_context = LongContextRule(o.long_min_tokens, o.short_max_tokens, o.threshold, o.of.value)
        else:
            skipped.append(o.label)
    p.request_bounds = [RequestBound(metric, threshold, bts) for (metric, bts), (_, threshold) in top.items()]
    if skipped:
        p.description = f"{p.description} (not judged by the bench: {', '.join(skipped)})".strip()
    if not p.objectives and p.max_error_rate is None:
        raise ValueError(f"profile {p.name!r}: none of its objectives can be judged by the bench ({', '.join(skipped)})")
    return p


def _is_monitor_format(doc: Any) -> bool:
    """``profiles: {name: {...}}`` (a mapping of named profiles, as ``tailguard serve`` reads) rather than the
    bench's own ``profiles: [...]`` or single-profile shape."""
    return isinstance(doc, dict) and isinstance(doc.get("profiles"), dict)


def load_profiles(names: list[str]) -> list[SLOProfile]:
    """Built-in names and YAML files: the bench's shape (one profile, or ``profiles: [...]``) or the live monitor's
    (``profiles: {name: {...}}``, see docs/slo.md), so that one file serves ``serve`` and ``bench``."""
    out: list[SLOProfile] = []
    for n in names:
        if n in BUILTIN:
            out.append(BUILTIN[n]())
            continue
        path = Path(n)
        if not path.is_file():
            raise ValueError(f"unknown SLO profile {n!r}: use {', '.join(BUILTIN)} or a YAML file")
        import yaml

        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        if _is_monitor_format(doc):
            from tailguard.slo.profiles import parse_profiles

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


def meets_bounds(m: RequestMetrics, p: SLOProfile, unlabelled_run: bool) -> bool:
    if not m.ok:
        return False
    for b in p.request_bounds:
        if not _in_scope(m, b.business_types, b.all_if_unlabelled, unlabelled_run):
            continue
        v = (max(m.itl) if m.itl else 0.0) if b.metric == "itl" else getattr(m, b.metric)
        if v is None or v > b.threshold:
            return False
    return True


def evaluate(p: SLOProfile, measured: list[RequestMetrics], window: float, reps: int = 1000, seed: int = 0,
             degraded: int | None = None) -> dict:
    ok = [m for m in measured if m.ok]
    unlabelled = all(not m.business_type for m in measured)
    checks: list[dict] = []
    for o in p.objectives:
        rows = [m for m in measured if _in_scope(m, o.business_types, o.all_if_unlabelled, unlabelled)]
        good_rows = [m for m in rows if m.ok]
        # a failed, cut-off or refused request in scope is a miss of the objective, not a request that never was
        vals, owner = with_misses(*_values(good_rows, o.metric), len(rows) - len(good_rows))
        c = {"objective": o.describe(), "metric": o.metric, "percentile": o.percentile, "threshold_s": o.threshold,
             "requests": len(rows), "failed_in_scope": len(rows) - len(good_rows)}
        if not vals:
            c.update(status="n/a", value_s=None, ci_s=None, note="no requests in scope")
            checks.append(c)
            continue
        bs = Bootstrap(vals, owner, (o.percentile,), reps, seed)
        v = bs.point[o.percentile]
        ci = bs.ci(o.percentile)
        passed = v <= o.threshold
        certain = ci is not None and (ci[1] <= o.threshold if passed else ci[0] > o.threshold)
        c.update(status="pass" if passed else "fail", value_s=None if missed(v) else v,
                 ci_s=[None if missed(x) else x for x in ci] if ci else None, certain=bool(certain),
                 headroom=None if missed(v) else (o.threshold - v) / o.threshold)
        if missed(v):
            c["note"] = f"P{o.percentile:g} falls on failed requests ({c['failed_in_scope']} in scope count as misses)"
        elif not certain:
            c["note"] = "the threshold lies inside the confidence interval: more requests would settle it"
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
    good = sum(1 for m in ok if meets_bounds(m, p, unlabelled))
    statuses = [c["status"] for c in checks]
    return {
        "profile": p.name,
        "description": p.description,
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


def _long_context(rule: LongContextRule, ok: list[RequestMetrics]) -> dict:
    def toks(m: RequestMetrics) -> int:
        return m.prompt_tokens or m.prompt_tokens_local or m.prompt_tokens_target or 0

    long_v = [getattr(m, rule.metric) for m in ok if toks(m) >= rule.long_min_tokens]
    short_v = [getattr(m, rule.metric) for m in ok if 0 < toks(m) < rule.short_max_tokens]
    c = {"objective": f"long-context decay: P99 {rule.metric.upper()} at >= {rule.long_min_tokens // 1024}K tokens "
                      f"<= {1 + rule.max_increase:g} x P99 below {rule.short_max_tokens // 1024}K",
         "metric": "long_context_decay", "threshold": rule.max_increase}
    if not long_v or not short_v:
        c.update(status="n/a", note=f"needs prompts both >= {rule.long_min_tokens} and < {rule.short_max_tokens} "
                                    "tokens in one run (use --workload long and a mixed length spread)")
        return c
    inc = float(np.percentile(long_v, 99)) / float(np.percentile(short_v, 99)) - 1
    c.update(value=inc, status="pass" if inc <= rule.max_increase else "fail", requests=len(long_v) + len(short_v))
    return c


# --- golden rules (S5) ---------------------------------------------------------------------------------------

def golden_rules(metrics: dict, names=("e2e", "ttft")) -> list[dict]:
    """P99 > 3 x P50 (start the optimization plan now) and P99 > 1.5 x P95 (plan within 24 h), as advisories.

    These ratios fire on healthy lognormal traffic (a lognormal of sigma 0.5 already has P99/P50 = 3.2), so each
    advisory is calibrated: the body of the distribution (P50, P90) is fitted with a lognormal, and the advisory is
    a *warning* only when the observed P99 is also well above what that body predicts (a real tail); otherwise it is
    *info*: the spread is wide but the tail is what such a body implies.
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
        for ratio, limit, action, rule in ((p99 / p50, 3.0, "start the optimization plan now", "P99 > 3 x P50"),
                                           (p99 / p95 if p95 else float("nan"), 1.5, "make an improvement plan "
                                            "within 24 h", "P99 > 1.5 x P95")):
            fired = ratio > limit
            out.append({
                "metric": name, "rule": rule, "ratio": ratio, "limit": limit, "fired": fired,
                "severity": ("warning" if heavy else "info") if fired else "ok",
                "action": action if fired else None,
                "lognormal_predicted_p99_s": predicted_p99, "observed_p99_s": p99,
                "note": (("the tail is heavier than the body predicts (P99 %.0f%% above a lognormal fit of P50/P90)"
                          % ((p99 / predicted_p99 - 1) * 100)) if heavy else
                         "the ratio is what a lognormal body of this spread implies: wide, not an anomalous tail")
                if fired else None,
            })
    return out


def slowest(measured: list[RequestMetrics], n: int = 10) -> list[dict]:
    rows = sorted((m for m in measured if m.ok and m.e2e is not None), key=lambda m: m.e2e, reverse=True)[:n]
    return [{"request_id": m.request_id, "server_request_id": m.server_request_id, "e2e_s": m.e2e,
             "ttft_s": m.ttft, "output_tokens": m.output_tokens, "prompt_tokens": m.prompt_tokens or
             m.prompt_tokens_local, "lang": m.lang, "slow_stage": m.slow_stage, "stage_source": m.stage_source,
             "stages_s": m.stages} for m in rows]
