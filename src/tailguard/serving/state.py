"""What the server holds while it runs: the backend, metrics, store, admission queue, and recent records."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from tailguard.backends.base import Backend
from tailguard.backends.local import LocalBackend, LocalEngine, as_backend
from tailguard.backends.upstream.autoscale import LoadSample, ReplicaAutoscaler
from tailguard.backends.upstream.pool import UpstreamPool
from tailguard.backends.upstream.provider import ProcessProvider, ProviderScaler, ReplicaLedger
from tailguard.backends.upstream.proxy import UpstreamBackend
from tailguard.observe.gateway_metrics import GatewayMetrics
from tailguard.observe.metrics import ServerMetrics
from tailguard.observe.resources import ResourceSampler
from tailguard.observe.store import RequestStore
from tailguard.observe.timeline import Outcome, Timeline
from tailguard.policy.decision import TrafficPolicy
from tailguard.policy.fleet_state import LocalState, RedisState, SharedState
from tailguard.policy.identity import Keys
from tailguard.policy.lanes import Lanes
from tailguard.policy.tenants import Tenants
from tailguard.serving.admission import Admission
from tailguard.serving.client_relay import RelayFlusher
from tailguard.serving.config import ServerConfig
from tailguard.serving.next_turn import NextTurn
from tailguard.serving.responses import TokenText
from tailguard.serving.spec_audit import SpeculationAudit
from tailguard.slo.actions import SLORecord

if TYPE_CHECKING:
    from tailguard.observe.tracing import RequestTracer
    from tailguard.serving.batch_cap import BatchCapDriver
    from tailguard.slo.config import AutoscaleConfig
    from tailguard.slo.monitor import SLOMonitor

log = logging.getLogger("tailguard.server")


@dataclass
class ServerState:
    config: ServerConfig
    engine: Backend | None = None
    upstream: UpstreamBackend | None = None  # the backend, when it is upstream replicas
    metrics: ServerMetrics | None = None
    store: RequestStore | None = None
    admission: Admission = field(init=False)
    keys: Keys = field(init=False)
    ready: bool = False
    load_error: str | None = None
    model_names: list[str] = field(default_factory=list)
    snapshot: dict[str, Any] = field(default_factory=dict)
    token_text: TokenText | None = None
    # Keyed by (request id, owner): clients may reuse each other's ids, and none may push another's record out.
    recent: OrderedDict[tuple[str, str | None], Timeline] = field(default_factory=OrderedDict)
    recent_capacity: int = 4096
    active_ids: set[str] = field(default_factory=set)
    # Long prompts are tokenized on a worker thread one at a time: a flood of them queues for one core.
    long_tokenize: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    started_unix: float = field(default_factory=time.time)
    slo: SLOMonitor | None = None  # when the monitor is enabled
    lanes: Lanes | None = None  # lanes and reserved capacity, when enabled (keys, lanes or upstreams configured)
    gateway_metrics: GatewayMetrics | None = None
    audit: SpeculationAudit | None = None  # when the embedded engine speculates
    machine: ResourceSampler | None = None  # CPU and memory (and the accelerator's) every 100 ms (O2)
    tracer: RequestTracer | None = None  # when tracing is configured (started and stopped by the lifespan)
    shared: SharedState = field(default_factory=LocalState)  # rate limits and lane budgets: in-process or Redis
    relay_flusher: RelayFlusher = field(default_factory=RelayFlusher)  # the gateway's direct relay (one loop's)
    closing: NextTurn[Timeline] = field(init=False)  # finished requests whose records close a turn later
    batch_cap: BatchCapDriver | None = None  # batch_cap mode 'forecast': sets the engine's caps ahead of load
    policy: TrafficPolicy = field(init=False)  # lanes, rate limits, the SLO monitor's verdicts (rebuilt on attach)
    ledger: ReplicaLedger | None = None  # a gateway's replica-seconds (every replica, configured or started)
    provider: ProcessProvider | None = None  # starts and stops replicas for the SLO monitor (scale_out.provider)
    autoscaler: ReplicaAutoscaler | None = None  # the provider following the backlog (provider.autoscale)

    def __post_init__(self) -> None:
        self.admission = Admission(self.config.max_queue)
        self.closing = NextTurn(self._close_later)
        self.keys = Keys(self.config.client_keys, self.config.admin_key, Tenants.load(self.config.keys_file))
        self.policy = self._policy()

    def _policy(self) -> TrafficPolicy:
        return TrafficPolicy(self.lanes, self.shared, self.slo, self.gateway_metrics,
                             default_lane=self.config.default_lane, trust_lane_header=self.config.trust_lane_header)

    @property
    def model_label(self) -> str:
        return self.engine.model_name if self.engine is not None else self.config.model

    def attach(self, engine: Backend | LocalEngine) -> None:
        """Serve from ``engine``: a backend, or an engine of this process (put behind ``LocalBackend``)."""
        backend = self.engine = as_backend(engine)
        upstream = self.upstream = backend if isinstance(backend, UpstreamBackend) else None
        pool = upstream.pool if upstream is not None else None
        self.model_names = self.config.model_names(backend.model_name)
        self.token_text = TokenText(backend.tokenizer) if backend.tokenizer is not None else None
        if self.config.lanes_enabled:
            cap = self.config.capacity
            limit = cap.upstream_queue_limit
            gate = (lambda admitted: pool.queue_full(limit, admitted)) if pool is not None and limit is not None \
                else None
            fleet = self.shared if isinstance(self.shared, RedisState) else None
            self.lanes = Lanes(self.config.lane_configs(), cap.max_concurrent or backend.capacity(), cap,
                               fleet=fleet, upstream_full=gate, backend_preempts=backend.preempts())
            if pool is not None and gate is not None:  # a new read of the upstream queues may open the gate
                pool.on_queue = self.lanes.poke
            self._pause_for_reserved(backend)
            if self.metrics is not None:
                self.gateway_metrics = GatewayMetrics(self.metrics.registry, self.metrics.model)
                if upstream is not None:  # over upstream replicas: count each attempt per replica
                    upstream.on_attempt = self.gateway_metrics.attempt
        if self.metrics is not None and self.machine is None:
            self.machine = ResourceSampler(self.metrics.registry, self.metrics.model)
            self.machine.start()
        if backend.speculates() and self.metrics is not None and self.config.speculative_audit > 0:
            self.audit = SpeculationAudit(self.config.speculative_audit, self.metrics.registry, self.metrics.model,
                                          self._emit_audit)
        if pool is not None and self.slo is not None:
            # The scale-out hook is told the replica set it would grow (or shrink).
            self.slo.actions.context = lambda: {"replicas": pool.describe()}
        if pool is not None:
            self._replicas(pool)
        elif self.config.slo.actions.scale_out.provider is not None:
            log.warning("slo.actions.scale_out.provider is set, but this server has no upstream replicas: a replica "
                        "provider works on a gateway (upstreams) only, so no replica will be started")
        if self.config.batch_cap.mode == "forecast" and self.batch_cap is None:
            from tailguard.serving.batch_cap import BatchCapDriver

            registry = self.metrics.registry if self.metrics is not None else None
            target = backend.engine if isinstance(backend, LocalBackend) else backend  # whose caps it sets
            self.batch_cap = driver = BatchCapDriver(self.config.batch_cap, target, registry, self.model_label)
            if self.slo is not None:  # the scale-out hook learns the fleet the forecast load needs
                self.slo.actions.context = lambda: {"capacity": driver.capacity_estimate()}
        self.policy = self._policy()

    def _replicas(self, pool: UpstreamPool) -> None:
        """A gateway's replica-seconds, and the replica provider where the SLO monitor's scale-out has one: its steps
        run on this event loop (attach is called on it), the monitor reaches it through a scaler."""
        if self.ledger is not None and self.ledger.pool is pool:
            return
        cfg = self.config.slo.actions.scale_out.provider
        provider = None
        if cfg is not None and self.slo is None:
            log.warning("slo.actions.scale_out.provider is set, but the SLO monitor is off: no replica will be started")
        elif cfg is not None and self.slo is not None:
            provider = self.provider = ProcessProvider(cfg, pool, on_change=self.capacity_changed)
            slo = self.slo
            scaler = slo.actions.scaler = ProviderScaler(provider, asyncio.get_running_loop(),
                                                         fires=lambda: slo.fires)
            provider.keep_minimum()
            if cfg.autoscale is not None:
                self.autoscaler = self._autoscaler(cfg.autoscale, provider, pool)
                scaler.on_close.append(self.autoscaler.close)
        self.ledger = ReplicaLedger(pool, provider)
        if self.metrics is not None:
            metrics = self.metrics
            self.ledger.register(metrics.registry, lambda: metrics.model)

    def _autoscaler(self, cfg: AutoscaleConfig, provider: ProcessProvider, pool: UpstreamPool) -> ReplicaAutoscaler:
        """The provider following this gateway's backlog: its lanes' waits and the replicas' queues."""
        slo = self.slo
        assert slo is not None

        def sample() -> LoadSample:
            lanes = self.lanes
            serving = [r for r in pool.replicas if r.available]
            mine = [r for r in provider.replicas() if r.state == "serving"]
            newest = mine[-1] if len(mine) > provider.min_replicas else None
            removable = next((r.cfg.max_concurrent for r in serving if newest is not None and r.url == newest.url),
                             None)
            return LoadSample(oldest_wait_s=lanes.oldest_wait() if lanes is not None else 0.0,
                              gateway_waiting=lanes.waiting() if lanes is not None else 0,
                              upstream_waiting=sum(r.queue_estimate() for r in serving),
                              busy=sum(r.busy for r in pool.replicas), capacity=pool.capacity,
                              replicas=len(serving), removable_capacity=removable,
                              can_add=len(provider.replicas()) < provider.max_replicas)

        def fires() -> bool:
            return slo.fires

        autoscaler = ReplicaAutoscaler(cfg, provider, sample, hold=lambda: slo.actions.scale_out is not None,
                                       on_step=slo.actions.provider_step, fires=fires)
        autoscaler.start()
        return autoscaler

    def _emit_audit(self, rec: SLORecord) -> None:
        if self.slo is not None:
            self.slo.records.emit(rec)  # its sinks include the store; GET /v1/alerts shows it
        elif self.store is not None:
            self.store.put_alert(rec.to_dict())

    def capacity_changed(self) -> None:
        """Replicas came or went: the lanes' capacity (unless configured) and whether the backend preempts follow."""
        if self.lanes is None or self.engine is None:
            return
        cap = self.lanes.capacity
        if self.config.capacity.max_concurrent is None:
            cap = self.engine.capacity()
        preempts = self.engine.preempts()
        if cap != self.lanes.capacity or preempts != self.lanes.backend_preempts:
            self.lanes.backend_preempts = preempts
            self.lanes.set_capacity(cap)  # the fleet's rule carries what may be lent

    def _pause_for_reserved(self, backend: Backend) -> None:
        """Embedded engine with a reserved lane: other lanes' sequences pause while a reserved-lane request is in the
        engine (``capacity.reserved_background_seqs``), unless ``--max-background-seqs`` was given."""
        keep = self.config.capacity.reserved_background_seqs
        reserved = [lane.priority for lane in self.config.lane_configs().values() if lane.reserved]
        if isinstance(backend, LocalBackend) and keep is not None and reserved:
            backend.protect_priority(keep, max(reserved))

    def engine_error(self) -> BaseException | None:
        """The backend's fatal error, when it has died."""
        return self.engine.error if self.engine is not None else None

    def sample(self) -> None:
        """One snapshot of engine and server state into the gauges (and every other tick into the store)."""
        eng = self.engine
        if eng is None:
            return
        s = eng.stats()
        adm = self.admission
        self.snapshot = {
            "running": s.running, "waiting": s.waiting, "kv_blocks_used": s.kv_blocks_used,
            "kv_blocks_total": s.kv_blocks_total, "server_queue": adm.depth, "in_flight": adm.in_flight,
            "sampled_at": time.time(),
        }
        if self.metrics is not None:
            self.metrics.sample(s.running, s.waiting, s.kv_blocks_total, s.kv_blocks_used, s.num_preemptions,
                                adm.depth, adm.in_flight, adm.capacity)
        pool = self.upstream.pool if self.upstream is not None else None
        if self.provider is not None:
            self.provider.reap()  # a started replica that exited on its own leaves the pool
        if self.ledger is not None:
            self.ledger.sync()
        if pool is not None:  # upstream replicas: their model names as their health checks find them
            names = self.config.model_names(eng.model_name) + [r.model for r in pool.replicas if r.model]
            self.model_names = list(dict.fromkeys(names))
        if self.machine is not None:
            self.snapshot["machine"] = self.machine.export()
        if self.lanes is not None:
            self.capacity_changed()
            self.lanes.tick()  # tokens_per_s: auto closes its windows of saturated time here too
            self.snapshot["lanes"] = self.lanes.snapshot()
        if self.gateway_metrics is not None:
            sample_gateway(self.gateway_metrics, self.lanes, pool)

    def store_sample(self) -> None:
        snap = self.snapshot
        if self.store is not None and snap:
            machine = snap.get("machine") or {}  # the machine sampler's window (O2), when it runs
            self.store.put_sample(snap["sampled_at"], snap["running"], snap["waiting"], snap["server_queue"],
                                  snap["kv_blocks_used"], snap["kv_blocks_total"], machine.get("cpu_cores_mean"),
                                  machine.get("rss_bytes_max"))

    def resources(self) -> dict[str, Any]:
        """The resource snapshot a request carries: the latest sample plus exact server counters now."""
        snap = dict(self.snapshot)
        snap["server_queue"] = self.admission.depth
        snap["in_flight"] = self.admission.in_flight
        return snap

    def close_record_soon(self, tl: Timeline) -> None:
        """``close_record`` and the request's end in ``in_flight``, two event-loop turns later: after the work the
        current turn made ready (a new request's first step, a first token), which the record's metrics, SLO windows
        and store row (~0.3 ms in the gateway at 256 streams) would otherwise hold up. Measured: added P99 TTFT +2.19
        -> +1.06 ms (CHANGELOG.md, 2026-12-04, the direct relay). Whatever reads what records feed flushes first
        (``state_of``, the lifespan's end), so nothing is seen half-done."""
        self.closing.add(tl)

    def _close_later(self, tl: Timeline) -> None:
        try:
            self.close_record(tl)
        finally:
            self.admission.in_flight -= 1  # last: "nothing in flight" means every record reached the store's queue

    def flush_closes(self) -> None:
        """Close every record waiting for its turn, now."""
        self.closing.flush()

    def close_record(self, tl: Timeline) -> None:
        """The single exit of every request: metrics, SLO windows, store and the recent-records cache, once."""
        if not tl.finalized:
            tl.finalize(500, Outcome.ERROR)
        try:
            if self.metrics is not None:
                self.metrics.observe(tl)
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            log.exception("metrics: could not observe request %s", tl.request_id)
        if self.slo is not None:
            self.slo.record(tl)  # never raises
        if self.batch_cap is not None and tl.status == 200:
            self.batch_cap.observe(tl.num_prompt_tokens, tl.num_output_tokens)
        if self.tracer is not None:
            try:
                self.tracer.finish(tl)  # queues the spans; the exporter's thread sends them
            except Exception:  # noqa: BLE001 - tracing must never fail a request
                log.exception("tracing: could not trace request %s", tl.request_id)
        if self.store is not None:
            self.store.put(tl)
            settled = getattr(self.store, "settled", None)
            if settled:
                self._forget_settled(settled)
        key = (tl.request_id, tl.owner)
        self.recent[key] = tl
        self.recent.move_to_end(key)
        while len(self.recent) > self.recent_capacity:
            self.recent.popitem(last=False)

    def _forget_settled(self, settled: deque[tuple[str, str | None, float]]) -> None:
        """Drop from the recent cache the records the store has written: from then on the store answers for them.
        The cache only bridges the writer's lag; kept whole (4,096 finished timelines, ~35,000 objects) it made each
        of the collector's full collections in tailguard serve scan them: 95-280 ms pauses at 256 streams."""
        recent = self.recent
        while settled:
            rid, owner, received = settled.popleft()  # appended by the store's writer: deque ends are thread-safe
            tl = recent.get((rid, owner))
            if tl is not None and tl.received_unix == received:  # not a newer request that reused the id
                del recent[(rid, owner)]


def sample_gateway(gm: GatewayMetrics, lanes: Lanes | None, pool: UpstreamPool | None) -> None:
    """The lanes' and the replicas' state into the gateway's gauges (and their running totals into counters)."""
    m = gm.model
    if lanes is not None:
        for name, s in lanes.lanes.items():
            gm.lane_waiting.labels(m, name).set(s.waiting)
            gm.lane_in_use.labels(m, name).set(s.in_use)
        for part, v in (("total", lanes.capacity), ("reserved", lanes.reserved), ("burst", lanes.burst),
                        ("general", lanes.general)):
            gm.lane_capacity.labels(m, part).set(v)
        if lanes.token_budget is not None or lanes.meter is not None:
            for name, s in lanes.lanes.items():
                gm.lane_tokens.labels(m, name).set(s.tokens)
        if lanes.meter is not None and lanes.meter.rate is not None:
            gm.token_rate.labels(m).set(lanes.meter.rate)
        if lanes.token_budget is not None:
            for part, v in (("total", lanes.token_budget), ("reserved", lanes.reserved_tokens),
                            ("burst", lanes.burst_tokens), ("general", lanes.general_tokens)):
                gm.lane_token_capacity.labels(m, part).set(v)
        if lanes.upstream_full is not None:
            gm.upstream_gate.labels(m).set(1 if lanes.gate_closed() else 0)
    if pool is not None:
        for rep in pool.replicas:
            gm.up_outstanding.labels(m, rep.name).set(rep.outstanding_tokens)
            gm.up_in_flight.labels(m, rep.name).set(rep.in_flight)
            gm.up_waiting.labels(m, rep.name).set(rep.upstream_waiting)
            gm.engine_state(rep.name, rep.upstream_running, rep.kv_usage)
            gm.up_healthy.labels(m, rep.name).set(1 if rep.available else 0)
            gm.catch_up(gm.up_breaker_open, (m, rep.name), rep.breaker.opened_total)
            c = rep.conns
            gm.up_conns_idle.labels(m, rep.name).set(len(c.idle))
            gm.catch_up(gm.up_conns_opened, (m, rep.name, "ahead"), c.opened - c.opened_on_demand)
            gm.catch_up(gm.up_conns_opened, (m, rep.name, "on_demand"), c.opened_on_demand)
            gm.catch_up(gm.up_resent, (m, rep.name), c.reconnects)
        q = pool.quarantine
        gm.catch_up(gm.quarantine, (m, "quarantined"), q.quarantined_total)
        gm.catch_up(gm.quarantine, (m, "refused"), q.refused_total)


def state_of(request: Request) -> ServerState:
    """The server's state for a route, with every finished request's record closed (``close_record_soon``)."""
    state: ServerState = request.app.state.tailguard
    if state.closing.pending:
        state.flush_closes()
    return state
