"""``tailguard slo grafana``: a Grafana dashboard generated from the metrics tailguard exports and the SLO profiles.

The panels read only series that exist: the metric names are collected at generation time from the server's own
registries (:class:`~tailguard.observe.metrics.ServerMetrics` and the SLO monitor's
:class:`~tailguard.slo.actions.SLOMetrics`), a panel whose metric is not there is left out, and a metric no fixed
panel knows but whose name says it is per-replica load or speculative acceptance gets a panel of its own. Latency
percentiles come from the histograms (``histogram_quantile`` over the rate of ``_bucket``), whose bucket edges sit
at the SLO thresholds; the profiles' objectives are drawn as thresholds on those panels, and the burn-rate SLOs of
``tailguard slo rules`` (same objectives, same error ratios) get an error-budget panel.

The JSON is Grafana's dashboard model (schemaVersion 39): a ``datasource`` variable of type prometheus, ``model``,
``business_type`` and ``scope`` variables, rows, and panels with ``gridPos``, ``datasource`` and PromQL targets.
Import it in Grafana (Dashboards > New > Import) and pick the Prometheus that scrapes tailguard's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tailguard.slo.profiles import Metric, SLOProfile
from tailguard.slo.rules import HISTOGRAMS, le, slo_rules_from

__all__ = ["SCHEMA_VERSION", "MetricInfo", "available_metrics", "build_dashboard", "expand_variables", "le_matcher",
           "panel_queries"]

SCHEMA_VERSION = 39
GRID_WIDTH = 24
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
REQ = 'model=~"$model", business_type=~"$business_type"'  # labels of the per-request series
MODEL = 'model=~"$model"'  # labels of the engine and server gauges
SCOPE = 'scope=~"$scope"'
PERCENTILES = ((0.5, "P50"), (0.95, "P95"), (0.99, "P99"))
# Names that mark a metric no fixed panel reads but that the dashboard should show (the per-replica load
# and speculative acceptance), with the row they go in.
DISCOVERED_SECTIONS = (("replica", "Per-replica load"), ("accept", "Speculative decoding"))
KV_FULL_RATIO = 0.95  # routing.kv_full_ratio's default (backends/upstream/pool.py): a replica this full is full
TIER_MAPPINGS = [{"type": "value", "options": {
    "0": {"text": "green", "color": "green", "index": 0}, "1": {"text": "yellow", "color": "yellow", "index": 1},
    "2": {"text": "orange", "color": "orange", "index": 2}, "3": {"text": "red", "color": "red", "index": 3}}}]


@dataclass(frozen=True)
class MetricInfo:
    """One metric family as Prometheus sees it: its name, type and label names."""

    name: str
    type: str  # "histogram" | "counter" | "gauge" | ...
    labels: tuple[str, ...] = ()

    @property
    def series(self) -> str:
        """The series a query reads: ``_total`` for a counter, ``_bucket`` for a histogram, else the name."""
        return {"counter": f"{self.name}_total", "histogram": f"{self.name}_bucket"}.get(self.type, self.name)


def available_metrics(gateway: bool = False) -> dict[str, MetricInfo]:
    """Every metric family a tailguard server exports, read from fresh instances of its registries; ``gateway``: a
    server over upstream replicas (``--upstream``), which also exports lanes, tenants, streams and replicas."""
    from prometheus_client import CollectorRegistry

    from tailguard.observe.metrics import ServerMetrics
    from tailguard.slo.actions import SLOMetrics

    server = ServerMetrics("model")
    slo_registry = CollectorRegistry(auto_describe=True)
    SLOMetrics(slo_registry)
    registries = [server.registry, slo_registry]
    if gateway:
        from tailguard.observe.gateway_metrics import GatewayMetrics

        registries.append(CollectorRegistry(auto_describe=True))
        GatewayMetrics(registries[-1], "model")
    out: dict[str, MetricInfo] = {}
    for registry in registries:
        # Names and types are public (collect() yields every family, sampled or not); label names are kept on the
        # collectors only, which the registry lists privately: without that list, panels of discovered metrics
        # are not split by label.
        collectors = getattr(registry, "_collector_to_names", None)
        labels = {fam.name: tuple(getattr(c, "_labelnames", ())) for c in (collectors or ()) for fam in c.describe()}
        for fam in registry.collect():
            out[fam.name] = MetricInfo(fam.name, fam.type, labels.get(fam.name, ()))
    if gateway:  # the replicas speculate, if anyone does: a gateway's own engine counters stay at zero
        out = {n: m for n, m in out.items() if "spec_decode" not in n}
    return out


@dataclass
class _Layout:
    """Places panels left to right in rows of 24 columns; a row header takes a line of its own."""

    next_id: int = 1
    x: int = 0
    y: int = 0
    line_h: int = 0
    panels: list[dict[str, Any]] = field(default_factory=list)

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"id": self._id(), "type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": self.y}})
        self.y += 1

    def add(self, panel: dict[str, Any], w: int = 8, h: int = 8) -> None:
        if self.x + w > GRID_WIDTH:
            self._newline()
        panel = {"id": self._id(), **panel, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        self.panels.append(panel)
        self.x += w
        self.line_h = max(self.line_h, h)

    def _newline(self) -> None:
        self.y += self.line_h
        self.x, self.line_h = 0, 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _target(expr: str, legend: str, ref: int) -> dict[str, Any]:
    return {"refId": chr(ord("A") + ref), "expr": expr, "legendFormat": legend, "range": True, "datasource": DS}


def _panel(title: str, targets: Sequence[tuple[str, str]], unit: str, description: str = "",
           kind: str = "timeseries", thresholds: Sequence[float] = (), no_value: str | None = None,
           mappings: list | None = None, extra_defaults: dict[str, Any] | None = None,
           options: dict[str, Any] | None = None, steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if steps is None:
        steps = [{"color": "green", "value": None}]
        colors = ("yellow", "orange", "red")
        for i, t in enumerate(sorted(set(thresholds))):
            steps.append({"color": colors[min(i, len(colors) - 1)] if len(thresholds) > 1 else "red", "value": t})
    defaults: dict[str, Any] = {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}}
    if kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "spanNulls": False,
                              "thresholdsStyle": {"mode": "dashed" if thresholds else "off"}}
    if no_value is not None:
        defaults["noValue"] = no_value  # an event counter is absent until its first event: show 0, not "No data"
    if mappings:
        defaults["mappings"] = mappings
    defaults.update(extra_defaults or {})
    return {
        "type": kind, "title": title, "description": description, "datasource": DS,
        "targets": [_target(expr, legend, i) for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options or ({"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                                "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else {}),
    }


def _quantiles(series: str, matcher: str = REQ) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({series}_bucket{{{matcher}}}[{RATE}])))", name)
            for q, name in PERCENTILES]


def le_matcher(threshold: float) -> str:
    """The ``le`` matcher of the bucket at ``threshold``: prometheus_client writes ``2.0`` and Prometheus 2 keeps it,
    Prometheus 3 normalizes it to ``2``; a regex that takes both works with either."""
    value = le(threshold)
    if value.endswith(".0"):
        return 'le=~"' + value[:-2] + r'(\\.0)?"'
    return f'le="{value}"'


def _error_ratio(matcher: str, window: str) -> str:
    """Server errors over requests that reached the engine (the error-rate objectives' ratio). No error yet reads
    as 0, not as an empty panel; without traffic the denominator leaves it empty, as it should be."""
    total = "tailguard_requests_total"
    return (f'(sum(rate({total}{{{matcher}, outcome="error"}}[{window}])) or vector(0)) / '
            f'sum(rate({total}{{{matcher}, outcome=~"success|error|aborted"}}[{window}]))')


def _objectives(profiles: Iterable[SLOProfile], metric: Metric) -> list[tuple[float, str]]:
    """(threshold, text) of each objective on ``metric`` that holds for all of a profile's traffic."""
    out = []
    for p in profiles:
        for o in p.objectives:
            if o.metric is metric and o.where.is_empty and o.percentile is not None:
                out.append((o.threshold, f"{p.name}: {o.describe()}"))
    return out


class _Builder:
    def __init__(self, metrics: dict[str, MetricInfo], profiles: Sequence[SLOProfile]) -> None:
        self.metrics = metrics
        self.profiles = profiles
        self.layout = _Layout()
        self.used: set[str] = set()
        self.skipped: list[str] = []

    def has(self, *names: str) -> bool:
        missing = [n for n in names if n not in self.metrics]
        if missing:
            self.skipped.append(f"{', '.join(missing)} not exported")
            return False
        self.used.update(names)
        return True

    def add(self, names: Sequence[str], panel: dict[str, Any], w: int = 8, h: int = 8) -> None:
        """Add ``panel`` when every metric it reads exists."""
        if self.has(*names):
            self.layout.add(panel, w, h)

    # --- rows ---------------------------------------------------------------------------------------------------
    def latency(self) -> None:
        self.layout.row("Latency percentiles (from the SLO-aligned histograms)")
        for metric, title in ((Metric.TTFT, "TTFT"), (Metric.ITL, "Inter-token latency"), (Metric.E2E, "E2E latency"),
                              (Metric.TPOT, "Time per output token"), (Metric.QUEUE_WAIT, "Queue wait")):
            name = HISTOGRAMS[metric]
            objs = _objectives(self.profiles, metric)
            desc = f"P50/P95/P99 of {name} over the rate window."
            if objs:
                desc += " Dashed lines: " + "; ".join(text for _, text in objs) + "."
            self.add([name], _panel(f"{title} P50 / P95 / P99", _quantiles(name), "s", desc,
                                    thresholds=[t for t, _ in objs]))
        stages = [(s, f"tailguard_request_{s}_time_seconds") for s in ("tokenize", "queue", "prefill", "decode",
                                                                        "stream")]
        if all(n in self.metrics for _, n in stages):
            targets = [(f"sum(rate({n}_sum{{{REQ}}}[{RATE}])) / sum(rate({n}_count{{{REQ}}}[{RATE}]))", s)
                       for s, n in stages]
            self.add([n for _, n in stages], _panel(
                "Mean time per stage", targets, "s",
                "The five stages add up to E2E for every request (docs/metrics.md); stacked, they show where the "
                "time goes.", extra_defaults={"custom": {"drawStyle": "line", "fillOpacity": 60, "lineWidth": 1,
                                                         "stacking": {"mode": "normal", "group": "A"},
                                                         "thresholdsStyle": {"mode": "off"}}}))

    def traffic(self) -> None:
        self.layout.row("Traffic and errors")
        req = "tailguard_requests"
        self.add([req], _panel("Requests per second by outcome", [
            (f"sum by (outcome) (rate({req}_total{{{REQ}}}[{RATE}]))", "{{outcome}}")], "reqps",
            "Finished requests: success, invalid (4xx), rejected (429/503: queue full, not ready, shed), aborted "
            "(client gone), error (5xx)."))
        budgets = [o.threshold for p in self.profiles for o in p.objectives
                   if o.metric is Metric.ERROR_RATE and o.where.is_empty]
        self.add([req], _panel("Error rate", [
            (_error_ratio(REQ, RATE), "errors / served")],
            "percentunit", "Server errors (5xx) over requests that reached the engine, as the error-rate "
            "objectives count them (0 while there is traffic and no error; empty without traffic).",
            thresholds=budgets))
        self.add(["tailguard_prompt_tokens", "tailguard_generation_tokens"], _panel("Tokens per second", [
            (f"sum(rate(tailguard_prompt_tokens_total{{{REQ}}}[{RATE}]))", "prompt"),
            (f"sum(rate(tailguard_generation_tokens_total{{{REQ}}}[{RATE}]))", "generated")], "short"))

    def queue(self) -> None:
        self.layout.row("Queue and engine")
        self.add(["tailguard_slo_window_latency_seconds"], _panel("Queue wait P99 per scope (lane, client class)", [
            (f'tailguard_slo_window_latency_seconds{{{SCOPE}, metric="queue_wait", percentile="99"}}', "{{scope}}")],
            "s", "The SLO monitor's live window per scope: configure a scope per lane (slo.scopes: "
            "[{name: vip, where: {lanes: [vip]}}]) to see the queue wait of each lane."))
        self.add(["tailguard_server_queue_requests", "tailguard_server_queue_capacity",
                  "tailguard_server_requests_in_flight"], _panel("Server queue", [
                      (f"sum(tailguard_server_queue_requests{{{MODEL}}})", "waiting for a first token"),
                      (f"sum(tailguard_server_queue_capacity{{{MODEL}}})", "capacity (beyond: 429)"),
                      (f"sum(tailguard_server_requests_in_flight{{{MODEL}}})", "in flight")], "short"))
        self.add(["tailguard_num_requests_running", "tailguard_num_requests_waiting"], _panel("Engine batch", [
            (f"sum(tailguard_num_requests_running{{{MODEL}}})", "running"),
            (f"sum(tailguard_num_requests_waiting{{{MODEL}}})", "waiting")], "short"))
        self.add(["tailguard_kv_cache_usage_ratio"], _panel("KV cache in use", [
            (f"max(tailguard_kv_cache_usage_ratio{{{MODEL}}})", "used")], "percentunit"))

    def slo(self) -> None:
        self.layout.row("SLO monitor: tiers, actions, objectives")
        self.add(["tailguard_slo_tier"], _panel("Tier per scope", [
            (f"max by (scope) (tailguard_slo_tier{{{SCOPE}}})", "{{scope}}")], "none",
            "0 green, 1 yellow (scale out), 2 orange (shed non-core traffic), 3 red (degrade).",
            kind="state-timeline", mappings=TIER_MAPPINGS,
            extra_defaults={"min": 0, "max": 3, "color": {"mode": "thresholds"}},
            options={"showValue": "auto", "mergeValues": True, "rowHeight": 0.9},
            steps=[{"color": c, "value": v} for c, v in (("green", None), ("yellow", 1), ("orange", 2), ("red", 3))]),
            w=12)
        self.add(["tailguard_slo_requests_affected"], _panel("Shed and degraded requests", [
            (f"sum by (action, mode) (increase(tailguard_slo_requests_affected_total[{RATE}]))", "{{action}} "
             "{{mode}}")], "short", "Requests the SLO monitor refused (shed) or answered degraded, per rate window.",
            no_value="0"), w=12)
        self.add(["tailguard_requests"], _panel("Refused requests (429 / 503)", [
            (f'sum by (status) (rate(tailguard_requests_total{{{REQ}, outcome="rejected"}}[{RATE}]))',
             "{{status}}")], "reqps", "Queue full, model not ready, or shed by the SLO monitor.", no_value="0"))
        self.add(["tailguard_slo_action_active"], _panel("Actions in effect", [
            (f"max by (action, scope) (tailguard_slo_action_active{{{SCOPE}}})", "{{action}} {{scope}}")], "none",
            no_value="0"))
        names = "|".join(sorted({p.name for p in self.profiles}))
        self.add(["tailguard_slo_objective_met"], _panel("Objectives met (live window)", [
            (f'tailguard_slo_objective_met{{profile=~"{names}"}}', "{{profile}} {{objective}}")], "none",
            "1 met, 0 breached, empty while the window holds too few samples.", kind="stat",
            mappings=[{"type": "value", "options": {"0": {"text": "breached", "color": "red", "index": 0},
                                                    "1": {"text": "met", "color": "green", "index": 1}}}],
            extra_defaults={"color": {"mode": "thresholds"}},
            options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "background", "graphMode": "none", "textMode": "value_and_name"}))

    def gateway(self) -> None:
        """Lanes, tenants, streams and upstream replicas: only on a dashboard for a gateway (``--gateway``)."""
        if "tailguard_lane_in_use_sequences" not in self.metrics:
            return
        self.layout.row("Gateway: lanes, tenants and streams")
        self.add(["tailguard_lane_waiting_requests", "tailguard_lane_in_use_sequences"], _panel(
            "Lanes: waiting and in use", [
                (f"sum by (lane) (tailguard_lane_waiting_requests{{{MODEL}}})", "{{lane}} waiting"),
                (f"sum by (lane) (tailguard_lane_in_use_sequences{{{MODEL}}})", "{{lane}} in use")], "short",
            "Requests waiting for their lane to admit them, and admitted sequences in flight, per lane."))
        self.add(["tailguard_lane_wait_seconds"], _panel("Lane wait P99", [
            (f"histogram_quantile(0.99, sum by (le, lane) (rate(tailguard_lane_wait_seconds_bucket{{{MODEL}}}[{RATE}])))",
             "{{lane}}")], "s", "Time from arrival to admission by the lane (part of the queue stage)."))
        self.add(["tailguard_lane_capacity_sequences"], _panel("Capacity split", [
            (f"max by (part) (tailguard_lane_capacity_sequences{{{MODEL}}})", "{{part}}")], "short",
            "Sequences the replicas take in all, and the reserved (VIP), burst and general shares."))
        self.add(["tailguard_lane_refused_requests", "tailguard_tenant_rate_limited_requests"], _panel(
            "Refused: lanes full or late, tenants over their rate", [
                (f"sum by (lane) (rate(tailguard_lane_refused_requests_total{{{MODEL}}}[{RATE}]))", "lane {{lane}}"),
                (f"sum by (tenant) (rate(tailguard_tenant_rate_limited_requests_total{{{MODEL}}}[{RATE}]))",
                 "tenant {{tenant}}")], "reqps", "429s from the lanes (queue full, deadline) and the rate limits.",
            no_value="0"))
        self.add(["tailguard_stream_stall_misses", "tailguard_stream_degraded_requests"], _panel(
            "Streams: missed deadlines and degraded answers", [
                (f"sum by (kind) (rate(tailguard_stream_stall_misses_total{{{MODEL}}}[{RATE}]))", "missed {{kind}}"),
                (f"sum by (lane) (rate(tailguard_stream_degraded_requests_total{{{MODEL}}}[{RATE}]))",
                 "degraded {{lane}}")], "reqps",
            "TTFT and inter-token deadlines missed, and streams switched to the degraded answer after repeated misses.",
            no_value="0"))
        self.layout.row("Gateway: upstream replicas")
        self.add(["tailguard_upstream_outstanding_tokens"], _panel("Outstanding tokens per replica", [
            (f"sum by (replica) (tailguard_upstream_outstanding_tokens{{{MODEL}}})", "{{replica}}")], "short",
            "Prompt and output tokens in flight at each replica: the load the router balances."))
        self.add(["tailguard_upstream_requests_in_flight", "tailguard_upstream_queue_requests"], _panel(
            "In flight and queued per replica", [
                (f"sum by (replica) (tailguard_upstream_requests_in_flight{{{MODEL}}})", "{{replica}} in flight"),
                (f"sum by (replica) (tailguard_upstream_queue_requests{{{MODEL}}})", "{{replica}} own queue")],
            "short", "The replica's own waiting queue comes from its /metrics (vLLM, SGLang, tailguard)."))
        self.add(["tailguard_upstream_running_requests", "tailguard_upstream_queue_requests"], _panel(
            "Engine running and waiting per replica", [
                (f"sum by (replica) (tailguard_upstream_running_requests{{{MODEL}}})", "{{replica}} running"),
                (f"sum by (replica) (tailguard_upstream_queue_requests{{{MODEL}}})", "{{replica}} waiting")],
            "short", "What each replica's engine says it runs and queues (its /metrics: vLLM, SGLang, llama.cpp, "
            "tailguard), read every routing.engine_scrape_s (0.5 s): the gateway's requests and anyone else's."))
        self.add(["tailguard_upstream_kv_cache_usage_ratio"], _panel("KV cache in use per replica", [
            (f"max by (replica) (tailguard_upstream_kv_cache_usage_ratio{{{MODEL}}})", "{{replica}}")],
            "percentunit", "Each replica's KV-cache use as its engine reports it. At routing.kv_full_ratio (dashed: "
            "its default, 95%) the replica counts as full: the queue gate counts it over its limit and routing.load: "
            "engine sends there last (vLLM preempts running requests when its KV cache runs out).",
            thresholds=[KV_FULL_RATIO], extra_defaults={"min": 0, "max": 1}))
        self.add(["tailguard_upstream_time_to_first_token_seconds"], _panel("Upstream TTFT P99 per replica", [
            ("histogram_quantile(0.99, sum by (le, replica) "
             f"(rate(tailguard_upstream_time_to_first_token_seconds_bucket{{{MODEL}}}[{RATE}])))", "{{replica}}")],
            "s", "From sending to a replica to its first token: the replica's share of TTFT."))
        self.add(["tailguard_upstream_requests"], _panel("Upstream requests by outcome", [
            (f"sum by (replica, outcome) (rate(tailguard_upstream_requests_total{{{MODEL}}}[{RATE}]))",
             "{{replica}} {{outcome}}")], "reqps"))
        self.add(["tailguard_upstream_healthy"], _panel("Healthy replicas", [
            (f"sum(tailguard_upstream_healthy{{{MODEL}}})", "healthy"),
            (f"count(tailguard_upstream_healthy{{{MODEL}}})", "known")], "short",
            "Replicas that pass their health check with a closed breaker, of those the gateway knows."))

    def burn(self) -> None:
        rules, _notes = slo_rules_from(self.profiles)
        if not rules:
            return
        self.layout.row("Error budget burn (the burn-rate SLOs of `tailguard slo rules`)")
        for rule in rules:
            series = HISTOGRAMS.get(rule.metric, "tailguard_requests") if rule.kind == "latency" \
                else "tailguard_requests"
            if not self.has(series):
                continue
            m = f"{REQ}, {rule.matcher}" if rule.matcher else REQ
            targets = [(f"({self._bad_ratio(rule, m, w)}) / {rule.budget:.10g}", f"burn over {w}")
                       for w in ("1h", "5m")]
            self.layout.add(_panel(
                f"Burn rate: {rule.slo}", targets, "none",
                f"{rule.description}. Error budget {rule.budget:.3%}; 1 spends it exactly over the SLO period, "
                "14.4 over 1h and 5m pages (SRE workbook).", thresholds=[1.0, 6.0, 14.4]), 8, 7)

    @staticmethod
    def _bad_ratio(rule: Any, m: str, w: str) -> str:
        if rule.kind == "latency":
            h = HISTOGRAMS[rule.metric]
            return (f"1 - sum(rate({h}_bucket{{{m}, {le_matcher(rule.threshold)}}}[{w}])) / "
                    f"sum(rate({h}_count{{{m}}}[{w}]))")
        return _error_ratio(m, w)

    def discovered(self) -> None:
        """Metrics no fixed panel reads whose names say what they are (per-replica load, acceptance rate)."""
        for keyword, title in DISCOVERED_SECTIONS:
            found = [m for n, m in sorted(self.metrics.items()) if keyword in n and n not in self.used]
            if not found:
                continue
            self.layout.row(title)
            for m in found:
                by = ", ".join(lbl for lbl in m.labels if lbl not in ("le",))
                group = f" by ({by})" if by else ""
                legend = " ".join("{{" + lbl + "}}" for lbl in m.labels if lbl != "le") or m.name
                if m.type == "histogram":
                    targets = [(f"histogram_quantile(0.99, sum by (le{', ' + by if by else ''}) "
                                f"(rate({m.name}_bucket[{RATE}])))", f"P99 {legend}")]
                    unit = "s" if m.name.endswith("_seconds") else "short"
                elif m.type == "counter":
                    targets, unit = [(f"sum{group} (rate({m.name}_total[{RATE}]))", legend)], "short"
                else:
                    unit = "percentunit" if m.name.endswith(("_ratio", "_rate")) else "short"
                    targets = [(f"sum{group} ({m.name})", legend)]
                self.used.add(m.name)
                self.layout.add(_panel(m.name, targets, unit, f"{m.type} {m.name}"))


def build_dashboard(profiles: Sequence[SLOProfile], metrics: dict[str, MetricInfo] | None = None,
                    title: str = "tailguard", uid: str = "tailguard") -> tuple[dict[str, Any], list[str]]:
    """The dashboard JSON and notes on what was left out (metrics not exported)."""
    b = _Builder(metrics if metrics is not None else available_metrics(), profiles)
    b.latency()
    b.traffic()
    b.queue()
    b.slo()
    b.gateway()
    b.burn()
    b.discovered()
    templating = {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
        _query_var("model", "label_values(tailguard_requests_total, model)"),
        _query_var("business_type", "label_values(tailguard_requests_total, business_type)"),
        _query_var("scope", "label_values(tailguard_slo_tier, scope)"),
    ]}
    dashboard = {
        "title": title, "uid": uid, "tags": ["tailguard", "llm", "slo"], "timezone": "browser",
        "schemaVersion": SCHEMA_VERSION, "version": 1, "editable": True, "graphTooltip": 1, "liveNow": False,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"}, "timepicker": {}, "fiscalYearStartMonth": 0,
        "description": "Generated by `tailguard slo grafana` for the profiles "
                       + ", ".join(p.name for p in profiles) + ".",
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [], "templating": templating, "panels": b.layout.panels,
    }
    return dashboard, sorted(set(b.skipped))


def _query_var(name: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": name, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query, "refresh": 2,
            "includeAll": True, "allValue": ".*", "multi": True, "current": {"text": "All", "value": "$__all"},
            "sort": 1, "hide": 0, "regex": "", "options": []}


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' nested panels included."""
    out = []

    def walk(panels: Iterable[dict[str, Any]]) -> None:
        for p in panels:
            walk(p.get("panels", ()))
            for t in p.get("targets", ()):
                out.append((p["title"], t["expr"]))

    walk(dashboard["panels"])
    return out


def expand_variables(expr: str, rate_window: str = "1m") -> str:
    """A panel's PromQL as Prometheus reads it with every variable at All (what Grafana sends, for tests and
    ``promtool``): ``$__rate_interval`` becomes ``rate_window``, the label variables match everything."""
    for var in ("model", "business_type", "scope"):
        expr = expr.replace(f"${var}", ".*")
    return expr.replace("$__rate_interval", rate_window)
