"""The gateway's Prometheus metrics: lanes (queue depth, admitted, refused, lane wait), tenants (rate limited),
streams (stalls, interruptions, degraded, stall fallbacks) and upstream replicas (requests, errors, outstanding tokens,
TTFT, connections, and what their engines report: running requests, queue, KV-cache use)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tailguard.observe.metrics import LATENCY_BUCKETS


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        r = registry
        self.model = model
        lane = ["model", "lane"]
        rep = ["model", "replica"]
        self.lane_waiting = Gauge("tailguard_lane_waiting_requests", "Requests waiting for admission, per lane.",
                                  lane, registry=r)
        self.lane_in_use = Gauge("tailguard_lane_in_use_sequences", "Admitted sequences in flight, per lane.", lane,
                                 registry=r)
        self.lane_capacity = Gauge("tailguard_lane_capacity_sequences",
                                   "Capacity split: total, reserved, burst and general sequences.",
                                   ["model", "part"], registry=r)
        self.lane_tokens = Gauge("tailguard_lane_in_use_tokens", "Estimated tokens (prompt + max_tokens) held by "
                                 "admitted requests, per lane (with a token budget).", lane, registry=r)
        self.lane_token_capacity = Gauge("tailguard_lane_capacity_tokens", "Token budget split: total, reserved, "
                                         "burst and general tokens (with a token budget).", ["model", "part"],
                                         registry=r)
        self.token_rate = Gauge("tailguard_lane_token_rate", "The backend's token rate measured while work waits "
                                "for it (capacity.tokens_per_s: auto; estimated tokens a second).", ["model"],
                                registry=r)
        self.upstream_gate = Gauge("tailguard_upstream_queue_gate_closed", "1 while the upstream replicas queue "
                                   "more than the limit and only the reserved lane is admitted.", ["model"],
                                   registry=r)
        self.lane_refused = Counter("tailguard_lane_refused_requests",
                                    "Requests refused with 429 by the lanes (queue full or deadline).", lane, registry=r)
        self.ttft_refused = Counter("tailguard_lane_ttft_refused_requests",
                                    "Requests refused with 429 at admission because their predicted time to first "
                                    "token passed the lane's ttft_target_s.", lane, registry=r)
        self.lane_wait = Histogram("tailguard_lane_wait_seconds", "Time a request waited for its lane to admit it.",
                                   lane, buckets=LATENCY_BUCKETS, registry=r)
        self.rate_limited = Counter("tailguard_tenant_rate_limited_requests",
                                    "Requests refused by a tenant's request or token rate limit.",
                                    ["model", "tenant"], registry=r)
        self.lane_claims_ignored = Counter("tailguard_lane_header_ignored_requests",
                                           "Requests whose X-Lane header was ignored (lanes come from the API key).",
                                           ["model"], registry=r)
        self.stalls = Counter("tailguard_stream_stall_misses", "Missed TTFT or inter-token deadlines.",
                              ["model", "lane", "kind"], registry=r)
        self.degraded = Counter("tailguard_stream_degraded_requests",
                                "Streams switched to a degraded answer after consecutive stalls.", lane, registry=r)
        self.fallbacks = Counter("tailguard_stream_fallbacks",
                                 "Stalled streams sent on to another replica, by how that ended: ok, stalled (again), "
                                 "failed, no_replica, interrupted, not_continuable.", [*lane, "outcome"], registry=r)
        self.interrupted = Counter("tailguard_stream_interrupted_requests",
                                   "Streams that ended with an error after their first token.", lane, registry=r)
        self.streams = Counter("tailguard_streams_started", "Streams that sent their first token.", lane, registry=r)
        self.up_requests = Counter("tailguard_upstream_requests", "Requests sent to an upstream replica, by outcome.",
                                   [*rep, "outcome"], registry=r)
        self.up_stalls = Counter("tailguard_upstream_stalled_requests",
                                 "Streams at a replica that the stall watch gave up on (then sent to another replica).",
                                 rep, registry=r)
        self.up_ttft = Histogram("tailguard_upstream_time_to_first_token_seconds",
                                 "From sending to an upstream replica to its first token.", rep,
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.up_outstanding = Gauge("tailguard_upstream_outstanding_tokens",
                                    "Prompt and output tokens in flight at a replica (the routing load).", rep,
                                    registry=r)
        self.up_in_flight = Gauge("tailguard_upstream_requests_in_flight", "Requests in flight at a replica.", rep,
                                  registry=r)
        self.up_waiting = Gauge("tailguard_upstream_queue_requests",
                                "The replica's own waiting queue, from its /metrics (vLLM, SGLang, llama.cpp, "
                                "tailguard).", rep, registry=r)
        # The replica's engine as its own /metrics says (vLLM, SGLang, llama.cpp, tailguard: read every
        # routing.engine_scrape_s); absent for a replica without such gauges.
        self.up_running = Gauge("tailguard_upstream_running_requests",
                                "Requests the replica's engine is running, from its /metrics (vLLM, SGLang, "
                                "llama.cpp, tailguard).", rep, registry=r)
        self.up_kv = Gauge("tailguard_upstream_kv_cache_usage_ratio",
                           "The replica's KV-cache use (0-1), from its /metrics (vLLM's kv_cache_usage_perc, "
                           "SGLang's token_usage, llama.cpp's kv_cache_usage_ratio, tailguard's).", rep, registry=r)
        self.up_healthy = Gauge("tailguard_upstream_healthy", "1 when the replica passes its health check and its "
                                                              "breaker is closed.", rep, registry=r)
        self.up_breaker_open = Counter("tailguard_upstream_breaker_opened", "Times a replica's breaker opened.", rep,
                                       registry=r)
        self.up_conns_opened = Counter("tailguard_upstream_connections_opened",
                                       "Connections opened to a replica for streams: ahead of need (spares) or on "
                                       "demand (a request waited for the connect).", [*rep, "kind"], registry=r)
        self.up_conns_idle = Gauge("tailguard_upstream_connections_idle", "Idle connections open to a replica.",
                                   rep, registry=r)
        self.up_resent = Counter("tailguard_upstream_resent_requests",
                                 "Requests sent again on a new connection because the reused one had been closed "
                                 "by the replica before it saw the request.", rep, registry=r)
        self.quarantine = Counter("tailguard_upstream_quarantine_requests",
                                  "Query-of-death guard: requests put in quarantine after replicas failed under them "
                                  "(event=quarantined), and requests refused for it (event=refused).",
                                  ["model", "event"], registry=r)
        self._counted: dict[tuple[Counter, tuple[str, ...]], int] = {}  # totals already added (``_catch_up``)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(self.model, *labels)``, looked up once: ``labels`` validates and locks at every call (~25 us
        in the gateway's request path, several times a request). The label sets are bounded: lanes, replicas,
        outcomes."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(self.model, *labels)
        return c

    def attempt(self, replica: str, outcome: str, ttft: float | None) -> None:
        """One request sent to a replica (``UpstreamBackend.on_attempt``)."""
        self.child(self.up_requests, replica, outcome).inc()
        if ttft is not None:
            self.child(self.up_ttft, replica).observe(ttft)

    def engine_state(self, replica: str, running: float | None, kv_usage: float | None) -> None:
        """What a replica's engine reported at the last read of its /metrics. A figure the replica does not report
        is not exported (no made-up zeros)."""
        if running is not None:
            self.child(self.up_running, replica).set(running)
        if kv_usage is not None:
            self.child(self.up_kv, replica).set(kv_usage)

    def catch_up(self, counter: Counter, labels: tuple[str, ...], total: int) -> None:
        """Bring a counter's child up to a running total kept elsewhere (a replica's breaker, its connection pool)."""
        key = (counter, labels)
        done = self._counted.get(key, 0)
        if total > done:
            counter.labels(*labels).inc(total - done)
            self._counted[key] = total
