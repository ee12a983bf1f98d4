"""``tailguard slo rules``: the monitor's logic as Prometheus recording and alerting rules.

Over the histograms and counters of :mod:`tailguard.observe.metrics` (``tailguard_e2e_request_latency_seconds``,
``tailguard_time_to_first_token_seconds``, ``tailguard_requests_total`` ...):

- recording rules: P50/P95/P99 of E2E, TTFT, ITL and queue wait over 5 and 15 minutes (overall and per business
  type), the golden-rule ratios, and per-SLO error ratios over the SRE workbook's windows (5m ... 3d);
- tier alerts ``TailguardLatencyYellow/Orange/Red`` on the monitor's judged metrics and thresholds (by default TTFT
  P99 1.8 / 2.5 / 3 s or TPOT P99 0.25 / 0.4 / 0.6 s) and the same hysteresis: a firing tier keeps firing until
  every judged P99 falls to ``clear_ratio`` x its threshold;
- multiwindow, multi-burn-rate alerts ``TailguardErrorBudgetBurn`` (SRE workbook, ch. 5): burn factors 14.4
  (1h and 5m) and 6 (6h and 30m) page, 3 (1d and 2h) and 1 (3d and 6h) open a ticket.

A latency objective "P99 <= 2 s" is read as "at most 1% of requests slower than 2 s", so its error ratio is
``1 - bucket{le="2.0"} / count``. That needs a bucket edge exactly at the threshold; tailguard's buckets have one at
each of the built-in thresholds, and an objective whose threshold is not an edge is skipped with a note. Burn-rate
alerts are made for tail objectives (P90 and above) and error-rate objectives; objectives that select on labels the
metrics do not carry (lane, client, region, context length, peak hours) stay with the live monitor.

:func:`build_rules_tests` writes a ``promtool test rules`` file for the rules it describes, so CI checks both.
Alertmanager should inhibit lower tiers while a higher one fires (see the rules' comments).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tailguard.slo.config import TierMetric, TierPolicy
from tailguard.slo.profiles import LATENCY_METRICS, Metric, Objective, SLOProfile

__all__ = [
    "BURN_WINDOWS",
    "HISTOGRAMS",
    "SLORule",
    "build_rules",
    "build_rules_tests",
    "dump_yaml",
    "slo_rules_from",
]

# Prometheus series of tailguard.observe.metrics (prometheus_client adds _bucket/_count/_sum and _total).
HISTOGRAMS = {
    Metric.E2E: "tailguard_e2e_request_latency_seconds",
    Metric.TTFT: "tailguard_time_to_first_token_seconds",
    Metric.ITL: "tailguard_inter_token_latency_seconds",
    Metric.TPOT: "tailguard_request_time_per_output_token_seconds",
    Metric.QUEUE_WAIT: "tailguard_request_queue_time_seconds",
    Metric.TOKENIZE: "tailguard_request_tokenize_time_seconds",
    Metric.PREFILL: "tailguard_request_prefill_time_seconds",
}
REQUESTS_TOTAL = "tailguard_requests_total"
SHORT = {Metric.E2E: "e2e_latency_seconds", Metric.TTFT: "ttft_seconds", Metric.ITL: "itl_seconds",
         Metric.QUEUE_WAIT: "queue_wait_seconds", Metric.TPOT: "tpot_seconds",
         Metric.TOKENIZE: "tokenize_seconds", Metric.PREFILL: "prefill_seconds"}
# (burn factor, long window, short window, severity, for)
BURN_WINDOWS = (
    (14.4, "1h", "5m", "page", "2m"),
    (6.0, "6h", "30m", "page", "5m"),
    (3.0, "1d", "2h", "ticket", "30m"),
    (1.0, "3d", "6h", "ticket", "1h"),
)
RATIO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
TIER_NAMES = ("Yellow", "Orange", "Red")
TIER_ACTIONS = (
    "scale out by 10% (tailguard's monitor asks its scale hook)",
    "shed non-core business types and lanes (429/503 with Retry-After)",
    "degrade affected traffic (cap max_tokens by default; a template only where configured)",
)
TIER_SEVERITY = ("warning", "critical", "critical")


def _default_buckets() -> tuple[float, ...]:
    try:
        from tailguard.observe.metrics import LATENCY_BUCKETS

        return tuple(LATENCY_BUCKETS)
    except Exception:  # noqa: BLE001 - the observe package may be absent in a slim install
        return (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3,
                0.35, 0.4, 0.45, 0.5, 0.6, 0.75, 1.0, 1.2, 1.5, 1.8, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0,
                30.0, 60.0, 120.0)


def le(v: float) -> str:
    """The ``le`` label value prometheus_client writes for a bucket edge (Go float formatting: 2 -> "2.0")."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(v)


@dataclass(frozen=True)
class SLORule:
    """One objective expressible in PromQL: its error-ratio expression and its error budget."""

    slo: str  # label value, e.g. "baseline/e2e_p99"
    profile: str
    objective: str
    kind: str  # "latency" | "errors"
    metric: Metric
    threshold: float
    budget: float  # allowed bad fraction
    matcher: str  # PromQL label matchers inside {...}, may be empty
    description: str

    def ratio_expr(self, window: str) -> str:
        m = self.matcher
        if self.kind == "latency":
            h = HISTOGRAMS[self.metric]
            sep = ", " if m else ""
            good = f'sum(rate({h}_bucket{{{m}{sep}le="{le(self.threshold)}"}}[{window}]))'
            total = f"sum(rate({h}_count{{{m}}}[{window}]))"
            return f"1 - ({good} / {total})"
        sep = ", " if m else ""
        bad = f'sum(rate({REQUESTS_TOTAL}{{{m}{sep}outcome="error"}}[{window}]))'
        served = f'sum(rate({REQUESTS_TOTAL}{{{m}{sep}outcome=~"success|error|aborted"}}[{window}]))'
        return f"{bad} / {served}"


def _matcher(prof: SLOProfile) -> str | None:
    sel = prof.applies_to
    if sel.lanes or sel.not_lanes or sel.clients or sel.regions or sel.min_input_tokens is not None \
            or sel.max_input_tokens is not None or sel.peak_only:
        return None
    if sel.business_types:
        alts = "|".join(sorted(sel.business_types))
        return f'business_type=~"{alts}"'
    return ""


def slo_rules_from(profiles: Iterable[SLOProfile], buckets: Sequence[float] | None = None,
                   min_percentile: float = 90.0) -> tuple[list[SLORule], list[str]]:
    """The objectives that become burn-rate SLOs, and notes on the ones left out (and why)."""
    edges = set(buckets or _default_buckets())
    out: list[SLORule] = []
    notes: list[str] = []
    seen: set[tuple] = set()
    for prof in profiles:
        pm = _matcher(prof)
        for o in prof.objectives:
            name = f"{prof.name}/{o.label}"
            if pm is None or not o.where.is_empty:
                notes.append(f"{name}: selects on labels the metrics do not carry; the live monitor watches it")
                continue
            rule = _rule(prof, o, pm, edges, notes, min_percentile)
            if rule is None:
                continue
            sig = (rule.kind, rule.metric, rule.threshold, rule.budget, rule.matcher)
            if sig in seen:
                notes.append(f"{name}: same as an objective above; not repeated")
                continue
            seen.add(sig)
            out.append(rule)
    return out, notes


def _rule(prof: SLOProfile, o: Objective, matcher: str, edges: set[float], notes: list[str],
          min_percentile: float) -> SLORule | None:
    name = f"{prof.name}/{o.label}"
    if o.metric is Metric.ERROR_RATE:
        return SLORule(name, prof.name, o.label, "errors", o.metric, o.threshold, o.threshold, matcher, o.describe())
    if o.metric not in LATENCY_METRICS or o.metric not in HISTOGRAMS:
        notes.append(f"{name}: {o.metric.value} has no Prometheus histogram; the live monitor watches it")
        return None
    assert o.percentile is not None
    if o.percentile < min_percentile:
        notes.append(f"{name}: P{o.percentile:g} is not a tail objective; recorded, no burn-rate alert")
        return None
    if not any(math.isclose(o.threshold, e, rel_tol=1e-9) for e in edges):
        notes.append(f"{name}: {o.threshold:g} s is not a histogram bucket edge; no burn-rate alert")
        return None
    edge = next(e for e in edges if math.isclose(o.threshold, e, rel_tol=1e-9))
    budget = round(1.0 - o.percentile / 100.0, 10)
    return SLORule(name, prof.name, o.label, "latency", o.metric, edge, budget, matcher, o.describe())


def _quantile_rules(window: str) -> list[dict[str, Any]]:
    rules = []
    for metric in (Metric.E2E, Metric.TTFT, Metric.ITL, Metric.QUEUE_WAIT):
        h = HISTOGRAMS[metric]
        for q in (0.5, 0.95, 0.99):
            p = f"p{int(q * 100)}"
            rules.append({"record": f"tailguard:{SHORT[metric]}:{p}_{window}",
                          "expr": f"histogram_quantile({q}, sum by (le) (rate({h}_bucket[{window}])))"})
            rules.append({"record": f"tailguard_business_type:{SHORT[metric]}:{p}_{window}",
                          "expr": f"histogram_quantile({q}, sum by (le, business_type) (rate({h}_bucket[{window}])))"})
    return rules


def _ratio_name(window: str) -> str:
    return f"tailguard:slo_errors:ratio_rate{window}"


def _fmt(x: float) -> str:
    return f"{x:.10g}"


def _tier_series(j: TierMetric, window: str) -> str:
    return f"tailguard:{SHORT[j.metric]}:p{j.percentile:g}_{window}".replace(".", "_")


def _exportable(tiers: TierPolicy, notes: list[str]) -> list[TierMetric]:
    """The judged metrics Prometheus can compute (those with a histogram); notes on the others."""
    out = []
    for j in tiers.judge:
        if j.metric in HISTOGRAMS:
            out.append(j)
        else:
            notes.append(f"tiers: {j.label} has no Prometheus histogram; the live monitor judges it, the tier "
                         "alerts here do not")
    return out


def _tier_annotations(lv: int, judged: list[TierMetric], tiers: TierPolicy, window: str) -> dict[str, str]:
    above = " or ".join(f"{j.metric.value} P{j.percentile:g} above {_fmt(j.threshold(lv))} s" for j in judged)
    clear = " and ".join(f"{j.metric.value} P{j.percentile:g} <= {_fmt(j.threshold(lv) * tiers.clear_ratio)} s"
                         for j in judged)
    return {
        "summary": f"{above} over {window}",
        "description": f"Tier {TIER_NAMES[lv - 1].lower()}: {TIER_ACTIONS[lv - 1]}. Clears when {clear}.",
    }


def build_rules(profiles: Iterable[SLOProfile], tiers: TierPolicy | None = None, tier_window: str = "5m",
                golden_window: str = "15m", p99_over_p50: float = 3.0, p99_over_p95: float = 1.5,
                buckets: Sequence[float] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The rules file (as a dict ready for YAML) and notes on objectives that could not be expressed."""
    tiers = tiers or TierPolicy()
    profiles = list(profiles)
    slos, notes = slo_rules_from(profiles, buckets)
    judged = _exportable(tiers, notes)
    groups: list[dict[str, Any]] = []

    rec = _quantile_rules("5m") + _quantile_rules("15m")
    have = {r["record"] for r in rec}
    for j in judged:
        series = _tier_series(j, tier_window)
        if series not in have:
            have.add(series)
            rec.append({"record": series, "expr": f"histogram_quantile({j.percentile / 100:g}, sum by (le) "
                                                  f"(rate({HISTOGRAMS[j.metric]}_bucket[{tier_window}])))"})
    e2e = SHORT[Metric.E2E]
    rec += [
        {"record": f"tailguard:{e2e}:p99_over_p50_{golden_window}",
         "expr": f"tailguard:{e2e}:p99_{golden_window} / tailguard:{e2e}:p50_{golden_window}"},
        {"record": f"tailguard:{e2e}:p99_over_p95_{golden_window}",
         "expr": f"tailguard:{e2e}:p99_{golden_window} / tailguard:{e2e}:p95_{golden_window}"},
    ]
    groups.append({"name": "tailguard-slo-recording", "rules": rec})

    ratio_rules = []
    for s in slos:
        for w in RATIO_WINDOWS:
            ratio_rules.append({"record": _ratio_name(w), "expr": s.ratio_expr(w),
                                "labels": {"slo": s.slo, "slo_kind": s.kind}})
    if ratio_rules:
        groups.append({"name": "tailguard-slo-error-ratios", "rules": ratio_rules})

    tier_alerts = []
    for lv in (1, 2, 3) if judged else ():
        name = f"TailguardLatency{TIER_NAMES[lv - 1]}"
        above = " or ".join(f"{_tier_series(j, tier_window)} > {_fmt(j.threshold(lv))}" for j in judged)
        held = " or ".join(f"{_tier_series(j, tier_window)} > {_fmt(j.threshold(lv) * tiers.clear_ratio)}"
                           for j in judged)
        if len(judged) > 1:
            above, held = f"({above})", f"({held})"
        expr = f'{above}\nor\n({held} and on() ALERTS{{alertname="{name}", alertstate="firing"}})'
        tier_alerts.append({
            "alert": name, "expr": expr, "for": "1m",
            "labels": {"severity": TIER_SEVERITY[lv - 1], "tier": TIER_NAMES[lv - 1].lower(),
                       "team": "tailguard"},
            "annotations": _tier_annotations(lv, judged, tiers, tier_window),
        })
    golden = []
    for rule, limit, advice in (("p99_over_p50", p99_over_p50, "plan improvements now"),
                                ("p99_over_p95", p99_over_p95, "plan improvements within a day")):
        golden.append({
            "alert": "TailguardGoldenRule", "expr": f"tailguard:{e2e}:{rule}_{golden_window} > {_fmt(limit)}",
            "for": "30m",
            "labels": {"severity": "info", "rule": rule, "team": "tailguard"},
            "annotations": {
                "summary": f"E2E {rule.replace('_over_', '/').upper()} above {_fmt(limit)}: {advice}",
                "description": ("An advisory, not a page: this ratio exceeds the golden rule's limit on healthy "
                                "lognormal traffic too (P99/P50 > 3 once log-sigma > 0.47; P99/P95 > 1.5 once "
                                "> 0.60)."),
            },
        })
    groups.append({"name": "tailguard-slo-tiers", "rules": tier_alerts + golden})

    burn = []
    for s in slos:
        for factor, long_w, short_w, severity, for_ in BURN_WINDOWS:
            limit = factor * s.budget
            if limit >= 1.0:
                notes.append(f"{s.slo}: burn factor {factor:g} x budget {s.budget:g} >= 1; that alert is omitted")
                continue
            sel = f'{{slo="{s.slo}"}}'
            burn.append({
                "alert": "TailguardErrorBudgetBurn",
                "expr": (f"{_ratio_name(long_w)}{sel} > {_fmt(limit)}\nand\n"
                         f"{_ratio_name(short_w)}{sel} > {_fmt(limit)}"),
                "for": for_,
                "labels": {"slo": s.slo, "severity": severity, "burn_factor": _fmt(factor), "long_window": long_w,
                           "short_window": short_w, "team": "tailguard"},
                "annotations": {
                    "summary": f"{s.slo}: error budget burning at {_fmt(factor)}x",
                    "description": (f"{s.description}: the bad fraction over {long_w} and {short_w} exceeds "
                                    f"{_fmt(factor)} x the budget {s.budget:.4g}."),
                },
            })
    if burn:
        groups.append({"name": "tailguard-slo-burn-rate", "rules": burn})
    return {"groups": groups}, notes


def dump_yaml(doc: dict[str, Any], header: str = "") -> str:
    import yaml

    class _D(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, data: str) -> Any:
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    _D.add_representer(str, _str)
    body = yaml.dump(doc, Dumper=_D, sort_keys=False, width=120, allow_unicode=True)
    return (header + body) if header else body


# --- promtool unit tests -------------------------------------------------------------------------------------------
def _hist_series(metric: Metric, per_min: dict[float, float], minutes: int, labels: str,
                 buckets: Sequence[float], start_from: dict[float, float] | None = None) -> list[dict[str, str]]:
    """Input series of one histogram: ``per_min`` maps an upper bucket edge to requests per minute landing in it."""
    h = HISTOGRAMS[metric]
    edges = [*sorted(buckets), math.inf]
    out = []
    total = sum(per_min.values())
    for e in edges:
        inc = sum(v for k, v in per_min.items() if k <= e)
        lbl = "+Inf" if e == math.inf else le(e)
        out.append({"series": f'{h}_bucket{{{labels}, le="{lbl}"}}', "values": f"0+{_fmt(inc)}x{minutes}"})
    out.append({"series": f"{h}_count{{{labels}}}", "values": f"0+{_fmt(total)}x{minutes}"})
    return out


def _phased(values: list[tuple[float, int]]) -> str:
    """A counter that grows by ``inc`` per minute for ``n`` minutes, phase after phase (promtool notation)."""
    parts, v = [], 0.0
    first = True
    for inc, n in values:
        if first:
            parts.append(f"{_fmt(v)}+{_fmt(inc)}x{n}")
            first = False
        else:
            parts.append(f"{_fmt(v + inc)}+{_fmt(inc)}x{n - 1}")
        v += inc * n
    return " ".join(parts)


def _phased_hist(metric: Metric, phases: list[tuple[dict[float, float], int]], labels: str,
                 buckets: Sequence[float]) -> list[dict[str, str]]:
    h = HISTOGRAMS[metric]
    edges = [*sorted(buckets), math.inf]
    out = []
    for e in edges:
        lbl = "+Inf" if e == math.inf else le(e)
        incs = [(sum(v for k, v in pm.items() if k <= e), n) for pm, n in phases]
        out.append({"series": f'{h}_bucket{{{labels}, le="{lbl}"}}', "values": _phased(incs)})
    out.append({"series": f"{h}_count{{{labels}}}", "values": _phased([(sum(pm.values()), n) for pm, n in phases])})
    return out


def _edge_above(x: float, buckets: Sequence[float]) -> float:
    return min(b for b in buckets if b > x)


def _tier_alert(lv: int, tiers: TierPolicy, tier_window: str) -> dict[str, Any]:
    return {
        "exp_labels": {"severity": TIER_SEVERITY[lv - 1], "tier": TIER_NAMES[lv - 1].lower(), "team": "tailguard"},
        "exp_annotations": _tier_annotations(lv, _exportable(tiers, []), tiers, tier_window),
    }


def build_rules_tests(rules_file: str, profiles: Iterable[SLOProfile], tiers: TierPolicy | None = None,
                      tier_window: str = "5m", buckets: Sequence[float] | None = None) -> dict[str, Any]:
    """A ``promtool test rules`` file for :func:`build_rules` with the same arguments.

    Tests: each tier fires for a latency in its band and not below it; a firing tier holds inside the hysteresis
    band and clears under it; the 14.4x burn alert fires for a fast burn and only the slower ones for a slow burn.
    """
    tiers = tiers or TierPolicy()
    judged = _exportable(tiers, [])
    if not judged or tier_window != "5m":
        raise ValueError("the generated tests cover tiers over 5m on a metric with a histogram")
    first = judged[0]  # the tier tests feed this metric only; the others' series stay absent
    tm = first.metric
    b = tuple(sorted(buckets or _default_buckets()))
    profiles = list(profiles)
    slos, _ = slo_rules_from(profiles, b)
    lab = 'model="m", business_type="chat"'
    series99 = _tier_series(first, tier_window)
    q = first.percentile / 100

    def p_in(edge_hi: float) -> float:
        lo = max(x for x in b if x < edge_hi)
        return lo + (edge_hi - lo) * q  # histogram_quantile interpolates linearly inside the bucket

    tests: list[dict[str, Any]] = []
    names = [f"TailguardLatency{n}" for n in TIER_NAMES]
    # 1) One test per band: all requests just above a tier's threshold -> that tier and those below fire.
    for lv in (0, 1, 2, 3):
        hi = _edge_above(first.threshold(lv) if lv else first.yellow * tiers.clear_ratio * 0.5, b)
        if lv and p_in(hi) <= first.threshold(lv):
            continue
        value = p_in(hi)
        expect_lv = max((x for x in (0, 1, 2, 3) if x == 0 or value > first.threshold(x)), default=0)
        tests.append({
            "name": f"tier band: every request in the bucket ending at {le(hi)} s (P99 = {value:.4g} s)",
            "interval": "1m",
            "input_series": _hist_series(tm, {hi: 100.0}, 12, lab, b),
            # Compared in micro-seconds, rounded: promtool 2.42 compares floats exactly, and PromQL's
            # interpolation need not round the way Python's does (0.7484999999999999 vs 0.7485).
            "promql_expr_test": [{"expr": f"round({series99} * 1e6)", "eval_time": "10m",
                                  "exp_samples": [{"labels": "{}", "value": round(value * 1e6)}]}],
            "alert_rule_test": [{"eval_time": "10m", "alertname": n,
                                 "exp_alerts": [_tier_alert(i + 1, tiers, tier_window)] if i + 1 <= expect_lv else []}
                                for i, n in enumerate(names)],
        })
    # 2) Hysteresis: 20 minutes in the orange band, then 20 in yellow's hysteresis band (above 0.9 x 1.8 s but
    #    under 1.8 s), then fast. Yellow holds in the band, then clears; orange clears as soon as P99 < 2.25 s
    #    (figures for the default TTFT tiers).
    band_hi = next((e for e in b[1:] if first.yellow * tiers.clear_ratio < p_in(e) <= first.yellow), None)
    orange_hi = _edge_above(first.orange, b)
    if band_hi is not None and p_in(orange_hi) > first.orange:
        fast = _edge_above(first.yellow * 0.1, b)
        # Phases of 8 minutes: each 5m rate window below lies inside one phase (short horizons keep promtool fast).
        phases = [({orange_hi: 100.0}, 8), ({band_hi: 100.0}, 8), ({fast: 100.0}, 8)]
        tests.append({
            "name": "tier hysteresis: yellow holds while P99 is between 0.9 x and 1 x its threshold, then clears",
            "interval": "1m",
            "input_series": _phased_hist(tm, phases, lab, b),
            "alert_rule_test": [
                {"eval_time": "7m", "alertname": names[1], "exp_alerts": [_tier_alert(2, tiers, tier_window)]},
                {"eval_time": "7m", "alertname": names[0], "exp_alerts": [_tier_alert(1, tiers, tier_window)]},
                {"eval_time": "15m", "alertname": names[1], "exp_alerts": []},
                {"eval_time": "15m", "alertname": names[0], "exp_alerts": [_tier_alert(1, tiers, tier_window)]},
                {"eval_time": "23m", "alertname": names[0], "exp_alerts": []},
            ],
        })
    # 3) Burn rates: requests split between a fast bucket and one just above the tightest E2E latency SLO. Every
    #    latency SLO over the same series is checked, since they share the alert name.
    lat_slos = [s for s in slos if s.kind == "latency" and s.metric is Metric.E2E and not s.matcher]
    err = next((s for s in slos if s.kind == "errors" and not s.matcher), None)
    if lat_slos:
        tight = min(lat_slos, key=lambda s: s.budget)
        slow_edge = _edge_above(tight.threshold, b)
        ok_edge = max(x for x in b if x <= min(s.threshold for s in lat_slos) * 0.5)
        for bad_frac in (tight.budget * 20, tight.budget * 8):
            if bad_frac >= 1:
                continue
            per = {ok_edge: 1000.0 * (1 - bad_frac), slow_edge: 1000.0 * bad_frac}
            expected = []
            for s in lat_slos:
                bad = sum(v for k, v in per.items() if k > s.threshold) / 1000.0
                expected += _burn_alerts(s, [(f, lw, sw, sev) for f, lw, sw, sev, _ in BURN_WINDOWS
                                             if bad > f * s.budget and f * s.budget < 1])
            tests.append({
                "name": f"burn rate: {bad_frac:.3g} of requests slower than {_fmt(tight.threshold)} s",
                "interval": "1m",
                "input_series": _hist_series(Metric.E2E, per, 70, lab, sorted({s.threshold for s in lat_slos})),
                "alert_rule_test": [{"eval_time": "66m", "alertname": "TailguardErrorBudgetBurn",
                                     "exp_alerts": expected}],
            })
    if err is not None:
        bad_frac = err.budget * 20
        exp = [(f, lw, sw, sev) for f, lw, sw, sev, _ in BURN_WINDOWS if bad_frac > f * err.budget]
        tests.append({
            "name": f"burn rate: {err.slo}, {bad_frac:.3g} of served requests failing",
            "interval": "1m",
            "input_series": [
                {"series": f'{REQUESTS_TOTAL}{{{lab}, outcome="success", status="200"}}',
                 "values": f"0+{_fmt(1000 * (1 - bad_frac))}x70"},
                {"series": f'{REQUESTS_TOTAL}{{{lab}, outcome="error", status="500"}}',
                 "values": f"0+{_fmt(1000 * bad_frac)}x70"},
                {"series": f'{REQUESTS_TOTAL}{{{lab}, outcome="invalid", status="400"}}', "values": "0+500x70"},
            ],
            "alert_rule_test": [{"eval_time": "66m", "alertname": "TailguardErrorBudgetBurn",
                                 "exp_alerts": _burn_alerts(err, exp)}],
        })
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def _burn_alerts(s: SLORule, exp: list[tuple[float, str, str, str]]) -> list[dict[str, Any]]:
    out = []
    for f, lw, sw, sev in exp:
        out.append({
            "exp_labels": {"slo": s.slo, "slo_kind": s.kind, "severity": sev, "burn_factor": _fmt(f),
                           "long_window": lw, "short_window": sw, "team": "tailguard"},
            "exp_annotations": {
                "summary": f"{s.slo}: error budget burning at {_fmt(f)}x",
                "description": (f"{s.description}: the bad fraction over {lw} and {sw} exceeds "
                                f"{_fmt(f)} x the budget {s.budget:.4g}."),
            },
        })
    return out
