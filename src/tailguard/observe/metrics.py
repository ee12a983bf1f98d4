"""Prometheus metrics in vLLM's naming style (``tailguard_`` for ``vllm:``), fed once per finished request.

Histogram buckets have edges at every built-in SLO threshold (0.2, 0.3, 0.35, 0.45, 1.2, 1.5, 1.8, 2, 2.5, 3 s)
and at the output-pacing targets (80, 100, 120, 150 ms): Prometheus interpolates linearly inside a bucket, so a
threshold that falls inside a wide default bucket makes "share of requests under 2 s" and P99 quietly wrong.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from tailguard.observe.timeline import Outcome, Timeline

SLO_THRESHOLDS = (0.2, 0.3, 0.35, 0.45, 1.2, 1.5, 1.8, 2.0, 2.5, 3.0)
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4,
    0.45, 0.5, 0.6, 0.75, 1.0, 1.2, 1.5, 1.8, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# The client's round-trip time: loopback and a rack (well under 1 ms) to another continent and mobile links (seconds).
RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 1.0, 2.0, 5.0)
# Bytes written for a client but not yet on the wire: none, a few chunks, a full socket buffer, a stalled reader.
BACKLOG_BUCKETS = (0, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216)
CONTENT_TYPE = CONTENT_TYPE_LATEST

_LABEL_RE = re.compile(r"[^A-Za-z0-9_.\-]")


def observe_many(child: Any, values: list[float]) -> None:
    """``child.observe(v)`` for every value (a request's token gaps), with one binary search a value and one locked
    increment a bucket touched, where ``observe`` scans the 38 buckets and takes two locks a value (19 gaps: 14.6 ->
    4.1 us). Uses the child's bucket layout (``_upper_bounds``, ``_buckets``, ``_sum``: prometheus_client's since
    0.4), else ``observe`` one by one."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            child.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)  # the first bound >= v, as observe's ``amount <= bound``
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        buckets[i].inc(n)
    total.inc(sum(values))


def clean_label(value: str | None, default: str = "default", max_len: int = 32) -> str:
    """A label value safe for Prometheus and for cardinality: short, plain characters."""
    if not value:
        return default
    return _LABEL_RE.sub("_", value.strip())[:max_len] or default


class _Series(dict):
    """One business type's metric children, each looked up once, when first used (a series appears in /metrics only
    once it has something to say): ``ser["ttft"]``, or with the metric's further label values,
    ``ser["requests", outcome, status]``."""

    def __init__(self, metrics: ServerMetrics, business_type: str) -> None:
        super().__init__()
        self.metrics, self.labels = metrics, (metrics.model, business_type)

    def __missing__(self, key: str | tuple[str, ...]) -> Any:
        name, *extra = (key,) if isinstance(key, str) else key
        child = self[key] = getattr(self.metrics, name).labels(*self.labels, *extra)
        return child


class _ConnectionCollector:
    """Open client connections and the connection guard's refusals, read from the guard at each scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        src = self.metrics.connection_source
        if src is None:
            return
        opened = GaugeMetricFamily("tailguard_server_connections", "Client connections open now.")
        opened.add_metric([], src.open)
        yield opened
        refused = CounterMetricFamily(
            "tailguard_server_connections_refused", "Client connections refused or closed by the connection guard, "
            "by reason: bad_request (400, not valid HTTP/1.1), head_too_large (431), head_timeout and body_timeout "
            "(408), evicted (idle, closed to make room at the cap), over_cap (503), dropped (closed at once past the "
            "cap).", labels=["reason"])
        for reason in ("bad_request", "head_too_large", "head_timeout", "body_timeout", "evicted", "over_cap",
                       "dropped"):
            refused.add_metric([reason], src.counts.get(reason, 0))
        yield refused

    def describe(self) -> Iterable[Any]:
        return []


class ServerMetrics:
    """All series of one server. A private registry per instance, so tests can run several apps in one process."""

    def __init__(self, model: str, business_types: Iterable[str] | None = None, max_business_types: int = 32,
                 max_regions: int = 32) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        # Business type comes from a client header: cap the label set so a client cannot explode cardinality.
        self._allowed = {clean_label(b) for b in business_types} if business_types else None
        self._seen: set[str] = set()
        self._max_business_types = max_business_types
        # Types the SLO configuration names keep their label whatever else clients send (``reserve``).
        self._reserved: set[str] = set()
        # Regions come from a client header too (or the configured networks): the same cap, the rest as "other".
        self._regions: dict[str, Any] = {}
        self._max_regions = max_regions
        r = self.registry
        req = ["model", "business_type"]

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, req, buckets=buckets, registry=r)

        self.ttft = hist("tailguard_time_to_first_token_seconds",
                         "Time to first token: arrival at the server to the first content token leaving it.")
        self.itl = hist("tailguard_inter_token_latency_seconds",
                        "Inter-token latency: each gap between consecutive tokens leaving the server.")
        self.tpot = hist("tailguard_request_time_per_output_token_seconds",
                         "Time per output token per request: (E2E - TTFT) / (output tokens - 1).")
        self.e2e = hist("tailguard_e2e_request_latency_seconds",
                        "End-to-end latency: arrival at the server to the last byte of the response.")
        self.tokenize = hist("tailguard_request_tokenize_time_seconds",
                             "Tokenize stage: arrival to prompt tokens ready (parse, validate, chat template, encode).")
        self.queue = hist("tailguard_request_queue_time_seconds",
                          "Queue stage: prompt tokens ready to first scheduled by the engine.")
        self.prefill = hist("tailguard_request_prefill_time_seconds",
                            "Prefill stage: first scheduled to first token produced.")
        self.decode = hist("tailguard_request_decode_time_seconds",
                           "Decode stage: first token produced to last token produced.")
        self.stream = hist("tailguard_request_stream_time_seconds",
                           "Stream stage: last token produced to the last byte of the response leaving the server.")
        self.prompt_len = hist("tailguard_request_prompt_tokens", "Prompt length of each request in tokens.",
                               TOKEN_BUCKETS)
        self.output_len = hist("tailguard_request_generation_tokens", "Output length of each request in tokens.",
                               TOKEN_BUCKETS)
        # Speculative decoding, per request that speculated: what share of its guesses the target accepted, and how
        # many tokens it got for free; the totals under vLLM's names (spec_decode_num_draft/accepted_tokens).
        self.spec_acceptance = Histogram("tailguard_spec_decode_acceptance_rate",
                                         "Per request: accepted / proposed speculative tokens.", req,
                                         buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
                                         registry=r)
        self.spec_accepted = hist("tailguard_spec_decode_request_accepted_tokens",
                                  "Per request: speculative tokens the target accepted.", TOKEN_BUCKETS)
        self.spec_proposed_total = Counter("tailguard_spec_decode_num_draft_tokens",
                                           "Speculative tokens verified by the target.", req, registry=r)
        self.spec_accepted_total = Counter("tailguard_spec_decode_num_accepted_tokens",
                                           "Speculative tokens the target accepted.", req, registry=r)
        # Prefix caching, as vLLM counts it: prompt tokens looked up, and those the cache served.
        self.prefix_queries = Counter("tailguard_prefix_cache_queries", "Prompt tokens of requests that reached the "
                                      "engine (the prefix cache's lookups).", req, registry=r)
        self.prefix_hits = Counter("tailguard_prefix_cache_hits", "Prompt tokens served by the prefix cache.", req,
                                   registry=r)
        self.requests = Counter("tailguard_requests", "Finished requests by outcome and HTTP status.",
                                [*req, "outcome", "status"], registry=r)
        self.success = Counter("tailguard_request_success", "Completed requests by finish reason.",
                               [*req, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("tailguard_prompt_tokens", "Prompt tokens of admitted requests.", req, registry=r)
        self.generation_tokens = Counter("tailguard_generation_tokens", "Output tokens produced.", req, registry=r)
        # The client connection's quality per request (serving/network.py: the kernel's TCP_INFO, sampled while
        # the answer is written), by region.
        net = ["model", "region"]
        self.client_rtt = Histogram("tailguard_client_rtt_seconds", "Per request: the kernel's smoothed round-trip "
                                    "time to the client at the end of the answer (TCP_INFO).", net,
                                    buckets=RTT_BUCKETS, registry=r)
        self.client_retransmits = Counter("tailguard_client_retransmits", "TCP segments retransmitted to clients "
                                          "while answers were written.", net, registry=r)
        self.client_backlog = Histogram("tailguard_client_send_backlog_bytes", "Per request: the most bytes written "
                                        "for the client but not yet sent (the server's write buffer plus the "
                                        "kernel's unsent bytes) at any sample.", net, buckets=BACKLOG_BUCKETS,
                                        registry=r)
        # The time left out of every latency figure: answers waiting for clients that read slower than they were
        # written (docs/metrics.md). Observed only for the requests that waited.
        self.client_wait = Histogram("tailguard_client_wait_seconds", "Per request that waited: seconds its answer "
                                     "waited for the client to read (left out of every latency figure).", net,
                                     buckets=LATENCY_BUCKETS, registry=r)
        m = ["model"]
        # The process's cycle collector stops the event loop while it runs (tailguard serve runs it on a timer:
        # serving/gc_schedule.py); each full collection's pause, so that a tail it causes can be seen.
        self.gc_pause = Histogram("tailguard_gc_pause_seconds", "Pauses of the server's scheduled full garbage "
                                  "collections (the event loop and the engine's Python work stop meanwhile).", m,
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r)
        self.running = Gauge("tailguard_num_requests_running", "Requests in the engine's running batch.", m,
                             registry=r)
        self.waiting = Gauge("tailguard_num_requests_waiting", "Requests waiting in the engine's queue.", m,
                             registry=r)
        self.admission = Gauge("tailguard_server_queue_requests",
                               "Requests admitted by the server and still waiting for their first token.", m,
                               registry=r)
        self.admission_limit = Gauge("tailguard_server_queue_capacity",
                                     "Bound of the server's waiting queue (beyond it: 429).", m, registry=r)
        self.in_flight = Gauge("tailguard_server_requests_in_flight", "Requests being handled by the server.", m,
                               registry=r)
        self.kv_used = Gauge("tailguard_kv_cache_blocks_used", "KV-cache blocks in use.", m, registry=r)
        self.kv_free = Gauge("tailguard_kv_cache_blocks_free", "KV-cache blocks free.", m, registry=r)
        self.kv_usage = Gauge("tailguard_kv_cache_usage_ratio", "Share of KV-cache blocks in use (0-1).", m,
                              registry=r)
        self.preemptions = Counter("tailguard_num_preemptions", "Requests preempted by the engine.", m, registry=r)
        self.store_errors = Counter("tailguard_store_failed_records",
                                    "Request records the store tried to write and SQLite refused.", m, registry=r)
        self.store_dropped = Counter("tailguard_store_dropped_records",
                                     "Request records never written: the store's backlog was full, the store was "
                                     "closed, or its close deadline passed.", m, registry=r)
        # The connection guard's refusals happen before a request reaches the app (so no record): counted here.
        self.connection_source: Any = None  # an object with ``open`` and ``counts`` (serving/connections.py)
        r.register(_ConnectionCollector(self))
        self._last_preemptions = 0
        self.admission_limit.labels(model).set(0)
        self._series: dict[str, _Series] = {}

    def reserve(self, business_types: Iterable[str]) -> None:
        """Business types that always keep their name (the ones SLO profiles, scopes and shedding select on): made-up
        types sent first must not fold them into "other", where their objectives would see nothing."""
        self._reserved.update(clean_label(b) for b in business_types)

    def business_type(self, raw: str | None) -> str:
        """A request's business type as labels, SLO windows and records know it: the allowlist when configured, else
        the reserved types and the first ``max_business_types`` others seen; the rest are "other"."""
        bt = clean_label(raw)
        if self._allowed is not None:
            return bt if bt in self._allowed or bt == "default" else "other"
        if bt in self._reserved:
            return bt
        if bt not in self._seen:
            if len(self._seen) >= self._max_business_types:
                return "other"
            self._seen.add(bt)
        return bt

    def region(self, raw: str | None) -> str:
        """The region's label value: the first ``max_regions`` seen keep their name, later ones are "other"."""
        rg = clean_label(raw)
        if rg in self._regions or len(self._regions) < self._max_regions or rg == "default":
            return rg
        return "other"

    def _network(self, tl: Timeline, net: dict[str, Any]) -> None:
        region = self.region(tl.region)
        children = self._regions.get(region)
        if children is None:
            m = self.model
            children = self._regions[region] = (self.client_rtt.labels(m, region),
                                                self.client_retransmits.labels(m, region),
                                                self.client_backlog.labels(m, region))
        rtt, retrans, backlog = children
        rtt.observe(net["rtt_ms"]["last"] / 1000.0)
        if net.get("retransmits"):
            retrans.inc(net["retransmits"])
        backlog.observe(net.get("max_backlog_bytes", 0))

    def _series_of(self, business_type: str) -> _Series:
        """The children of one (model, business type): ``labels()`` validates and locks at every call, and a request
        makes about 15 of them (business types are capped, so this cache is too)."""
        ser = self._series.get(business_type)
        if ser is None:
            ser = self._series[business_type] = _Series(self, business_type)
        return ser

    def observe(self, tl: Timeline) -> None:
        """Feed one finished request (called once, by the server, when the record is closed)."""
        s = tl.summary()
        ser = self._series_of(tl.business_type)
        outcome = tl.outcome.value if tl.outcome else "unknown"
        ser["requests", outcome, str(tl.status)].inc()
        if tl.outcome is Outcome.SUCCESS:
            ser["success", tl.finish_reason or "unknown"].inc()
        if tl.network:  # whatever the outcome: the connection is the client's, not the answer's
            self._network(tl, tl.network)
        if tl.client_waits:
            self.client_wait.labels(self.model, self.region(tl.region)).observe(tl.client_wait)
        if tl.outcome in (Outcome.INVALID, Outcome.REJECTED) or tl.synthetic:
            # Never reached the engine (refused, or a degradation template): their latencies would dilute the
            # served distribution.
            return
        # Stage times, TTFT and token gaps are real for every request that reached the engine, aborted ones included
        # (a client that gave up in the queue did wait there); E2E and TPOT describe complete answers only.
        stages = s.stages
        for name in ("tokenize", "queue", "prefill", "decode", "stream"):
            ser[name].observe(stages[name])
        if s.ttft is not None:
            ser["ttft"].observe(s.ttft)
        if s.itl:
            observe_many(ser["itl"], s.itl)
        if tl.outcome is Outcome.SUCCESS:
            ser["e2e"].observe(s.e2e)
            if s.tpot is not None:
                ser["tpot"].observe(s.tpot)
        if tl.num_prompt_tokens:
            ser["prompt_tokens"].inc(tl.num_prompt_tokens)
            ser["prompt_len"].observe(tl.num_prompt_tokens)
        if tl.num_output_tokens:
            ser["generation_tokens"].inc(tl.num_output_tokens)
        ser["output_len"].observe(tl.num_output_tokens)
        if tl.num_prompt_tokens and tl.scheduled is not None:
            ser["prefix_queries"].inc(tl.num_prompt_tokens)
            ser["prefix_hits"].inc(tl.cached_prompt_tokens)
        if tl.spec_proposed:
            ser["spec_acceptance"].observe(tl.spec_accepted / tl.spec_proposed)
            ser["spec_accepted"].observe(tl.spec_accepted)
            ser["spec_proposed_total"].inc(tl.spec_proposed)
            ser["spec_accepted_total"].inc(tl.spec_accepted)

    def sample(self, running: int, waiting: int, kv_total: int, kv_used: int, preemptions: int,
               admission_queue: int, in_flight: int, admission_limit: int) -> None:
        """Set the gauges from one snapshot of engine and server state (called every <= 500 ms)."""
        m = self.model
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_used.labels(m).set(kv_used)
        self.kv_free.labels(m).set(max(0, kv_total - kv_used))
        self.kv_usage.labels(m).set(kv_used / kv_total if kv_total else 0.0)
        self.admission.labels(m).set(admission_queue)
        self.admission_limit.labels(m).set(admission_limit)
        self.in_flight.labels(m).set(in_flight)
        if preemptions > self._last_preemptions:
            self.preemptions.labels(m).inc(preemptions - self._last_preemptions)
        self._last_preemptions = max(self._last_preemptions, preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
