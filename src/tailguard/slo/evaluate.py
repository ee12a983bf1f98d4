"""Evaluation (run every few seconds): SLO status per profile, tiers with hysteresis, golden-rule advisories,
hotspots, and the long-context and per-region views.

Everything here is computation over :class:`~tailguard.slo.windows.SlidingWindows`; nothing acts. The monitor turns
tier transitions into actions (:mod:`tailguard.slo.actions`).

Golden rules are **advisories**. The rules say P99 > 3 x P50 means "plan improvements now" and P99 > 1.5 x P95
means "plan improvements within a day". Both fire on healthy lognormal traffic: with log-sigma s, P99/P50 is
exp(2.326 s) (> 3 once s > 0.47) and P99/P95 is exp(0.681 s) (> 1.5 once s > 0.60), and LLM end-to-end latency,
which grows with the output length, often has s in 0.5-1. So they are reported, recorded and exported, never paged
on, and their ratios are configurable (``golden_rules`` in the config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tailguard.slo.config import (
    TIERS,
    GoldenRulesConfig,
    HotspotConfig,
    MonitorConfig,
    TierMetric,
    TierPolicy,
)
from tailguard.slo.profiles import RATE_METRICS, Metric, Objective, Selector, SLOProfile
from tailguard.slo.windows import STAGES, Key, SlidingWindows, WindowStats

__all__ = [
    "AdvisoryTracker",
    "Evaluation",
    "Evaluator",
    "TierTracker",
    "Transition",
    "combine",
    "golden_ratios",
    "hotspots",
]


def combine(a: Selector, b: Selector) -> Selector:
    """The traffic both selectors match (empty field = any)."""

    def both(x: tuple[str, ...], y: tuple[str, ...]) -> tuple[str, ...]:
        if not x:
            return y
        if not y:
            return x
        inter = tuple(v for v in x if v in y)
        return inter or ("\x00none",)  # disjoint: match nothing

    lo = [v for v in (a.min_input_tokens, b.min_input_tokens) if v is not None]
    hi = [v for v in (a.max_input_tokens, b.max_input_tokens) if v is not None]
    mn, mx = (max(lo) if lo else None), (min(hi) if hi else None)
    if mn is not None and mx is not None and mn > mx:
        return Selector(business_types=("\x00none",))  # an impossible token range: match nothing
    return Selector(
        business_types=both(a.business_types, b.business_types), lanes=both(a.lanes, b.lanes),
        not_lanes=tuple(dict.fromkeys((*a.not_lanes, *b.not_lanes))), clients=both(a.clients, b.clients), regions=both(a.regions, b.regions),
        min_input_tokens=mn, max_input_tokens=mx, peak_only=a.peak_only or b.peak_only,
    )


@dataclass
class Transition:
    scope: str
    level: int  # 1 yellow, 2 orange, 3 red
    event: str  # "raised" | "cleared"
    value: float | None
    threshold: float
    samples: int
    metric: str = ""  # the judged metric behind it, e.g. "ttft p99"
    reason: str = ""  # raised: "above_threshold"; cleared: "recovered" | "evidence_aged_out"

    @property
    def tier(self) -> str:
        return TIERS[self.level]


class _Judge:
    """Hysteresis of one judged metric: which levels its own readings hold up."""

    def __init__(self, spec: TierMetric) -> None:
        self.spec = spec
        self.active = [False, False, False, False]  # index 0 unused (green)
        self.value: float | None = None
        self.samples = 0
        self._above = [0, 0, 0, 0]
        self._below = [0, 0, 0, 0]
        # When an evaluation with enough samples last kept each level from clearing (value above its clear line).
        self._evidence_at: list[float | None] = [None, None, None, None]
        self.aged_out = [False, False, False, False]  # the last clear of a level was for want of evidence

    def step(self, value: float | None, samples: int, p: TierPolicy, now: float | None,
             window_s: float | None) -> None:
        self.value, self.samples = value, samples
        if now is not None:  # a caller's clock that went back: age from the step, not from a time still to come
            self._evidence_at = [None if at is None else min(at, now) for at in self._evidence_at]
        if value is None or samples < p.min_samples:
            # Too little data to judge: hold, but never beyond the evidence. Once no evaluation with enough samples
            # has supported a level for a whole window, the requests that raised it have left the window.
            if now is None or window_s is None:
                return
            for lv in (3, 2, 1):
                at = self._evidence_at[lv]
                if self.active[lv] and not any(self.active[lv + 1:]) and (at is None or now - at >= window_s):
                    self.active[lv] = False
                    self.aged_out[lv] = True
                    self._above[lv] = self._below[lv] = 0
            return
        for lv in (1, 2, 3):
            thr = self.spec.threshold(lv)
            if value > thr * p.clear_ratio:
                self._evidence_at[lv] = now
            if value > thr:
                self._above[lv] += 1
                self._below[lv] = 0
            elif value <= thr * p.clear_ratio:
                self._below[lv] += 1
                self._above[lv] = 0
            else:  # inside the hysteresis band: neither raise nor clear
                self._above[lv] = 0
                self._below[lv] = 0
        for lv in (1, 2, 3):
            if not self.active[lv] and self._above[lv] >= p.raise_after:
                for low in range(1, lv + 1):  # a jump straight to red raises yellow and orange too
                    self.active[low] = True
                    self._evidence_at[low] = now
        for lv in (3, 2, 1):
            if self.active[lv] and self._below[lv] >= p.clear_after and not any(self.active[lv + 1:]):
                self.active[lv] = False
                self.aged_out[lv] = False

    def ratio(self, level: int) -> float:
        """How far the last reading is from this level's threshold (1.0: at it); -1 without a reading."""
        return -1.0 if self.value is None else self.value / self.spec.threshold(level)


class TierTracker:
    """Tiers of one scope. Each judged metric keeps its own hysteresis; the scope's tier is the worst of them,
    damped: a raised level holds at least ``min_dwell_s``. Levels 1-3 nest: red implies orange implies yellow."""

    def __init__(self, scope: str, policy: TierPolicy) -> None:
        self.scope = scope
        self.policy = policy
        self.judges = [_Judge(j) for j in policy.judge]
        self.active = [False, False, False, False]  # index 0 unused (green)
        self.raised_at: list[float | None] = [None, None, None, None]
        self.last_value: float | None = None
        self.last_samples = 0

    @property
    def tier(self) -> int:
        return max((lv for lv in (1, 2, 3) if self.active[lv]), default=0)

    def worst(self, level: int = 1) -> _Judge:
        """The judged metric nearest to (or furthest above) the level's threshold: the one that decides."""
        return max(self.judges, key=lambda j: (j.active[level], j.ratio(level)))

    def step(self, value: float | None, samples: int, now: float | None = None,
             window_s: float | None = None) -> list[Transition]:
        """Feed one evaluation with the same reading for every judged metric (one-metric policies)."""
        return self.step_all([(value, samples)] * len(self.judges), now, window_s)

    def step_all(self, readings: list[tuple[float | None, int]], now: float | None = None,
                 window_s: float | None = None) -> list[Transition]:
        """Feed one evaluation: ``(value, samples)`` per judged metric, in ``policy.judge`` order. ``now`` and
        ``window_s`` enable ageing and dwell. Returns the transitions (raises low to high, clears high to low)."""
        p = self.policy
        if now is not None:  # a caller's clock that went back: the dwell counts from the step
            self.raised_at = [None if at is None else min(at, now) for at in self.raised_at]
        for j, (value, samples) in zip(self.judges, readings, strict=True):
            j.step(value, samples, p, now, window_s)
        w = self.worst()
        self.last_value, self.last_samples = w.value, w.samples
        out: list[Transition] = []
        for lv in (1, 2, 3):
            if not self.active[lv] and any(j.active[lv] for j in self.judges):
                self.active[lv] = True
                self.raised_at[lv] = now
                j = self.worst(lv)
                out.append(Transition(self.scope, lv, "raised", j.value, j.spec.threshold(lv), j.samples,
                                      j.spec.label, "above_threshold"))
        for lv in (3, 2, 1):
            if not self.active[lv] or any(j.active[lv] for j in self.judges) or any(self.active[lv + 1:]):
                continue
            at = self.raised_at[lv]
            if now is not None and at is not None and now - at < p.min_dwell_s:
                continue  # damped: the level holds its minimum dwell
            self.active[lv] = False
            j = self.worst(lv)
            aged = any(x.aged_out[lv] for x in self.judges)
            out.append(Transition(self.scope, lv, "cleared", j.value, j.spec.threshold(lv), j.samples,
                                  j.spec.label, "evidence_aged_out" if aged else "recovered"))
        return out

    def view(self) -> list[dict[str, Any]]:
        """Each judged metric's last reading, thresholds and own tier (JSON-ready)."""
        return [{"metric": j.spec.metric.value, "percentile": j.spec.percentile, "label": j.spec.label,
                 "value": j.value, "samples": j.samples, "enough_samples": j.samples >= self.policy.min_samples,
                 "thresholds": {"yellow": j.spec.yellow, "orange": j.spec.orange, "red": j.spec.red},
                 "skips_degraded": j.spec.excludes_degraded,
                 "tier": TIERS[max((lv for lv in (1, 2, 3) if j.active[lv]), default=0)]} for j in self.judges]


def golden_ratios(stats: WindowStats, metric: str) -> dict[str, float | None]:
    p50, p95, p99 = (stats.quantile(metric, q) for q in (0.5, 0.95, 0.99))
    return {
        "p50": p50, "p95": p95, "p99": p99,
        "p99_over_p50": (p99 / p50) if p99 is not None and p50 else None,
        "p99_over_p95": (p99 / p95) if p99 is not None and p95 else None,
    }


class AdvisoryTracker:
    """Golden-rule advisories of one scope: on above the ratio, off at ``clear_ratio`` x the ratio or below."""

    RULES = (
        ("p99_over_p50", "p99_over_p50", "P99 > {r:g} x P50: plan improvements now (golden rule)"),
        ("p99_over_p95", "p99_over_p95", "P99 > {r:g} x P95: plan improvements within a day (golden rule)"),
    )

    def __init__(self, scope: str, cfg: GoldenRulesConfig) -> None:
        self.scope, self.cfg = scope, cfg
        self.active: dict[str, bool] = {r[0]: False for r in self.RULES}

    def step(self, stats: WindowStats) -> tuple[dict[str, Any], list[tuple[str, str, dict[str, Any]]]]:
        cfg = self.cfg
        ratios = golden_ratios(stats, cfg.metric.value)
        n = stats.n(cfg.metric.value)
        changes: list[tuple[str, str, dict[str, Any]]] = []
        view: dict[str, Any] = {"samples": n, **ratios, "rules": {}}
        for rule, key, text in self.RULES:
            limit = getattr(cfg, rule)
            value = ratios[key]
            was = self.active[rule]
            if cfg.enabled and n >= cfg.min_samples and value is not None:
                if not was and value > limit:
                    self.active[rule] = True
                elif was and value <= limit * cfg.clear_ratio:
                    self.active[rule] = False
            if self.active[rule] != was:
                changes.append((rule, "raised" if self.active[rule] else "cleared",
                                {"ratio": value, "limit": limit, "samples": n, **ratios}))
            view["rules"][rule] = {"active": self.active[rule], "ratio": value, "limit": limit,
                                   "advice": text.format(r=limit)}
        return view, changes


def hotspots(windows: SlidingWindows, stats: WindowStats, cfg: HotspotConfig, window_s: float, now: float,
             selector: Selector | None = None, peak: bool = False) -> dict[str, Any]:
    """Requests slower than exp(mean + sigma x std) of log E2E over the window, each with the stage that dominated
    it: the stage with the largest excess over its window mean. ``slow_stages`` lists the stages above their own
    mean + stage_sigma x std. Candidates are the slowest ``top_per_slot`` requests of each slot."""
    mu, sd = stats.log_mean, stats.log_std
    out: dict[str, Any] = {"threshold_s": None, "log_mean": mu, "log_std": sd, "samples": stats.log_n,
                           "requests": []}
    if mu is None or sd is None or stats.log_n < cfg.min_samples:
        return out
    thr = math.exp(mu + cfg.sigma * sd)
    out["threshold_s"] = thr
    means = stats.stage_means()
    sds = stats.stage_stds()
    for r in windows.slowest(window_s, now, selector, peak):
        if r["e2e"] <= thr:
            break
        if len(out["requests"]) >= cfg.max_reported:
            break
        st = r["stages"] or {}
        dominant, excess, largest = None, -math.inf, None
        slow = []
        for s in STAGES:
            v = st.get(s)
            if v is None:
                continue
            ex = v - means.get(s, 0.0)
            if ex > excess:
                dominant, excess = s, ex
            if largest is None or v > st[largest]:
                largest = s
            if s in sds and v > means[s] + cfg.stage_sigma * sds[s]:
                slow.append(s)
        out["requests"].append({
            "request_id": r["request_id"], "e2e": r["e2e"], "at": r["at"], **r["key"],
            "dominant_stage": dominant, "dominant_excess_s": None if dominant is None else excess,
            "largest_stage": largest, "slow_stages": slow, "stages": st,
            "sigmas": (math.log(r["e2e"]) - mu) / sd if sd > 0 else None,
        })
    return out


def _shifted(summary: dict[str, Any], shift: float) -> dict[str, Any]:
    """A window's summary with its edges moved from the windows' steady clock onto the wall clock shown."""
    summary["start"] += shift
    summary["end"] += shift
    return summary


@dataclass
class Evaluation:
    """The result of one evaluation (JSON via ``to_dict``)."""

    at: float
    peak: bool
    window_s: float
    scopes: dict[str, dict[str, Any]] = field(default_factory=dict)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    advisories: dict[str, dict[str, Any]] = field(default_factory=dict)
    hotspots: dict[str, Any] = field(default_factory=dict)
    long_context: dict[str, Any] = field(default_factory=dict)
    regions: dict[str, Any] = field(default_factory=dict)
    transitions: list[Transition] = field(default_factory=list)
    advisory_changes: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)
    objective_changes: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def tier(self) -> int:
        return max((s["tier_level"] for s in self.scopes.values()), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at, "peak": self.peak, "window_s": self.window_s, "tier": TIERS[self.tier],
            "scopes": self.scopes, "profiles": self.profiles, "advisories": self.advisories,
            "hotspots": self.hotspots, "long_context": self.long_context, "regions": self.regions,
            "duration_s": self.duration_s,
        }


class Evaluator:
    """Computes an :class:`Evaluation` from the windows; keeps tier, advisory and objective state between calls."""

    def __init__(self, windows: SlidingWindows, config: MonitorConfig, profiles: list[SLOProfile]) -> None:
        self.w = windows
        self.cfg = config
        self.profiles = profiles
        self.trackers = {s.name: TierTracker(s.name, s.tiers or config.tiers) for s in config.scopes}
        self.scope_where = {s.name: s.where for s in config.scopes}
        self.advisors = {s.name: AdvisoryTracker(s.name, config.golden_rules) for s in config.scopes}
        self.objective_state: dict[tuple[str, str], str] = {}

    # --- objectives ------------------------------------------------------------------------------------------------
    def _objective(self, prof: SLOProfile, o: Objective, window_s: float, now: float, peak: bool,
                   cache: dict[Selector, WindowStats]) -> dict[str, Any]:
        min_n = self.cfg.objective_min_samples
        sel = combine(prof.applies_to, o.where)
        res: dict[str, Any] = {"label": o.label, "metric": o.metric.value, "percentile": o.percentile,
                               "threshold": o.threshold, "comparison": o.comparison, "description": o.describe(),
                               "value": None, "samples": 0, "status": "no_data"}
        if o.where.peak_only and not peak:
            res["status"] = "off_peak"
            return res

        def q(s: Selector) -> WindowStats:
            if s not in cache:
                cache[s] = self.w.query(s, window_s, now, peak=peak)
            return cache[s]

        if o.metric is Metric.LONG_CONTEXT_DECAY:
            long_s = combine(sel, Selector(min_input_tokens=o.long_min_tokens))
            short_s = combine(sel, Selector(max_input_tokens=o.short_max_tokens))
            ls, ss = q(long_s), q(short_s)
            m, qq = o.of.value, o.quantile or 0.99
            nl, ns = ls.n(m), ss.n(m)
            res["samples"] = min(nl, ns)
            res["long"] = {"n": nl, "value": ls.quantile(m, qq)}
            res["short"] = {"n": ns, "value": ss.quantile(m, qq)}
            if nl >= min_n and ns >= min_n and res["short"]["value"]:
                res["value"] = res["long"]["value"] / res["short"]["value"] - 1.0
        elif o.metric in RATE_METRICS:
            st = q(sel)
            res["samples"] = n = st.rate_samples(o.metric.value)
            if n >= min_n:
                res["value"] = st.rate(o.metric.value)
        else:
            st = q(sel)
            n = st.n(o.metric.value)
            res["samples"] = n
            if n >= min_n:
                res["value"] = st.quantile(o.metric.value, o.quantile or 0.99)
        if res["value"] is not None:
            res["status"] = "ok" if o.met_by(res["value"]) else "breach"
        return res

    # --- views -----------------------------------------------------------------------------------------------------
    def _regions(self, window_s: float, now: float, peak: bool, shift: float = 0.0) -> dict[str, Any]:
        # The keys grouped by region in one pass: a selector per region would scan every key once per region.
        by_region: dict[str, list[Key]] = {}
        for k in self.w.known_keys():
            by_region.setdefault(k.region, []).append(k)
        out: dict[str, Any] = {}
        for r in sorted(by_region):
            st = self.w.query(None, window_s, now, metrics=("ttft", "itl", "e2e"), peak=peak, keys=by_region[r])
            out[r] = _shifted(st.summary(("ttft", "itl", "e2e")), shift)
        return out

    def _long_context(self, window_s: float, now: float, peak: bool, shift: float = 0.0) -> dict[str, Any]:
        t = self.cfg.long_context_tokens
        long_st = self.w.query(Selector(min_input_tokens=t + 1), window_s, now, peak=peak)
        short_st = self.w.query(Selector(max_input_tokens=t), window_s, now, peak=peak)
        out = {"threshold_tokens": t, "long": _shifted(long_st.summary(), shift),
               "short": _shifted(short_st.summary(), shift)}
        lp, sp = long_st.quantile("e2e", 0.99), short_st.quantile("e2e", 0.99)
        out["e2e_p99_ratio"] = lp / sp if lp is not None and sp else None
        return out

    # --- the whole thing -------------------------------------------------------------------------------------------
    def evaluate(self, now: float, peak: bool, window_s: float, at: float | None = None) -> Evaluation:
        """Judge the windows at ``now`` (the windows' steady clock, which also ages evidence and times the dwell).
        ``at``: the wall-clock time the evaluation is shown with (default ``now``); the times it reports (window
        edges, hotspots) are shifted onto it."""
        at = now if at is None else at
        shift = at - now
        ev = Evaluation(at=at, peak=peak, window_s=window_s)
        cache: dict[Selector, WindowStats] = {}
        for name, tracker in self.trackers.items():
            sel = self.scope_where[name]
            st = self.w.query(sel, window_s, now, peak=peak)
            cache[sel] = st
            pol = tracker.policy
            clean: WindowStats | None = None
            readings: list[tuple[float | None, int]] = []
            for j in pol.judge:
                src = st
                if j.excludes_degraded:  # judged on the answers no action changed (see TierMetric.skip_degraded)
                    if clean is None:
                        clean = self.w.query(sel, window_s, now, peak=peak, exclude_degraded=True,
                                             metrics=[x.metric.value for x in pol.judge if x.excludes_degraded])
                    src = clean
                m = j.metric.value
                readings.append((src.quantile(m, j.percentile / 100), src.n(m)))
            ev.transitions += tracker.step_all(readings, now, st.window_s)
            w = tracker.worst(max(1, tracker.tier))
            view = _shifted(st.summary(), shift)
            view.update({
                "tier": TIERS[tracker.tier], "tier_level": tracker.tier,
                # The deciding judged metric (the worst against its thresholds); "judged" lists them all.
                "tier_metric": w.spec.label, "tier_value": w.value, "samples": w.samples,
                "thresholds": {"yellow": w.spec.yellow, "orange": w.spec.orange, "red": w.spec.red},
                "judged": tracker.view(), "clear_ratio": pol.clear_ratio, "min_samples": pol.min_samples,
                "min_dwell_s": pol.min_dwell_s, "enough_samples": w.samples >= pol.min_samples,
            })
            ev.scopes[name] = view
            adv_view, changes = self.advisors[name].step(st)
            ev.advisories[name] = adv_view
            ev.advisory_changes += [(name, rule, event, figs) for rule, event, figs in changes]
        for prof in self.profiles:
            objs = [self._objective(prof, o, window_s, now, peak, cache) for o in prof.objectives]
            statuses = {o["status"] for o in objs}
            status = "breach" if "breach" in statuses else "ok" if "ok" in statuses else "no_data"
            ev.profiles[prof.name] = {"status": status, "description": prof.description, "objectives": objs}
            for o in objs:
                k = (prof.name, o["label"])
                before = self.objective_state.get(k, "ok")
                if o["status"] in ("ok", "breach") and o["status"] != before:
                    self.objective_state[k] = o["status"]
                    ev.objective_changes.append((prof.name, o["label"], "raised" if o["status"] == "breach"
                                                 else "cleared", {"value": o["value"], "threshold": o["threshold"],
                                                                  "samples": o["samples"]}))
        first = self.cfg.scopes[0]
        ev.hotspots = hotspots(self.w, cache[first.where], self.cfg.hotspots, window_s, now, first.where, peak)
        if shift:
            for r in ev.hotspots["requests"]:
                r["at"] += shift
        ev.long_context = self._long_context(window_s, now, peak, shift)
        ev.regions = self._regions(window_s, now, peak, shift)
        return ev
