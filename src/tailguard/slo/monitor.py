"""The SLO monitor: one object the server holds.

    monitor = SLOMonitor(MonitorConfig(...), sinks=[store.put_alert], registry=metrics.registry)
    monitor.record(timeline)                 # per finished request: cheap, on the request path
    monitor.evaluate()                       # every eval_interval_s (a background task)
    monitor.shed_for(business_type, lane, tenant)    # -> refusal details | None: per request, before admission
    monitor.degradation_for(business_type, lane, client=..., region=..., input_tokens=..., tenant=...)  # or None
    monitor.snapshot()                       # JSON for the dashboard and GET /v1/alerts
    monitor.alerts()                         # the alert/action records kept in memory

A fleet of gateways (``join_fleet(redis_url)``): each evaluation publishes this gateway's window slots to Redis and
judges the merged view of every gateway's slots, so that every gateway sees the fleet's tier (and sheds or degrades
alike), while one of them, the leader (a Redis key with an expiry, renewed each evaluation), is the one that emits the
alert and action records to the sinks, counts them in the alert metrics and calls the scale hooks: a tier fires once
for the fleet. Redis unreachable: this gateway judges its own windows and acts as its own leader (fail open).

Two clocks: ``clock`` (``time.time`` by default) stamps what people read (alert and action records, the time of an
evaluation, the dashboard's history); ``steady`` places requests in the windows' slots and times the tiers' evidence
and dwell. It never steps back (``steady_time``: the wall clock going forward, the monotonic clock's pace after a step
back until the wall clock catches up), so a wall clock stepped back cannot hold a tier on no evidence. Given a clock of its own and no ``steady`` (tests pass a fake
clock), the monitor judges by that clock, made never to step back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from tailguard.slo.actions import (
    ActionEngine,
    Degradation,
    HookRunner,
    RecordKind,
    RecordLog,
    RecordSink,
    SLOMetrics,
    SLORecord,
)
from tailguard.slo.config import TIERS, MonitorConfig
from tailguard.slo.evaluate import Evaluation, Evaluator
from tailguard.slo.profiles import LATENCY_METRICS, Metric, SLOProfile, get_profile, load_profiles
from tailguard.slo.windows import CORE_METRICS, OPTIONAL_METRICS, PeakDetector, SlidingWindows, steady_for

__all__ = ["SLOMonitor"]

log = logging.getLogger("tailguard.slo")


class SLOMonitor:
    def __init__(
        self,
        config: MonitorConfig | None = None,
        profiles: Iterable[SLOProfile] | None = None,
        sinks: Iterable[RecordSink] = (),
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        hooks: HookRunner | None = None,
        history: int = 720,
        steady: Callable[[], float] | None = None,
    ) -> None:
        self.config = cfg = config or MonitorConfig()
        self.clock = clock
        self.steady = steady or steady_for(clock)
        if profiles is None:
            extra = load_profiles(cfg.profiles_file) if cfg.profiles_file else {}
            profiles = [get_profile(n, extra) for n in cfg.profiles]
        self.profiles: list[SLOProfile] = list(profiles)
        # Which latency metrics need windows: the core four plus any an objective or a tier policy uses.
        needed = set(CORE_METRICS)
        edges = {cfg.long_context_tokens}
        for p in self.profiles:
            for o in p.objectives:
                m = o.of if o.metric is Metric.LONG_CONTEXT_DECAY else o.metric
                if m in LATENCY_METRICS:
                    needed.add(m.value)
                if o.metric is Metric.LONG_CONTEXT_DECAY:
                    edges |= {o.short_max_tokens, o.long_min_tokens - 1}
                for sel in (o.where, p.applies_to):
                    if sel.min_input_tokens is not None:
                        edges.add(sel.min_input_tokens - 1)
                    if sel.max_input_tokens is not None:
                        edges.add(sel.max_input_tokens)
        for sc in cfg.scopes:
            needed |= {j.metric.value for j in (sc.tiers or cfg.tiers).judge}
        metrics = [m for m in (*CORE_METRICS, *OPTIONAL_METRICS) if m in needed]
        self.peak = PeakDetector(
            mode=cfg.peak.mode, hours=cfg.peak.hours, timezone=cfg.peak.timezone,
            enter_ratio=cfg.peak.enter_ratio, exit_ratio=cfg.peak.exit_ratio, min_rps=cfg.peak.min_rps,
            recent_s=cfg.peak_window_s, baseline_half_life_s=cfg.peak.baseline_half_life_s,
            warmup_s=cfg.peak.warmup_s,
        )
        self.windows = SlidingWindows(
            slot_s=cfg.slot_s, max_window_s=cfg.max_window_s, metrics=metrics,
            ctx_edges=sorted(e for e in edges if e > 0), max_keys=cfg.max_keys, clock=self.steady,
            on_slot_closed=self.peak.observe_slot, max_regions=cfg.max_regions,
        )
        self.evaluator = Evaluator(self.windows, cfg, self.profiles)
        self.fleet: FleetView | None = None
        # Sinks hear only the fleet's leader (every record when there is no fleet).
        self.records = RecordLog(cfg.max_records, [self._leader_only(s) for s in sinks])
        self.metrics = SLOMetrics(registry)
        scopes = {s.name: s.where for s in cfg.scopes}
        self.actions = ActionEngine(cfg.actions, scopes, self.records, self.metrics, hooks, clock=clock)
        self._alerts: dict[tuple[str, int], SLORecord] = {}  # active alert records by (scope, level)
        self._advisories: dict[tuple[str, str], SLORecord] = {}
        self._objectives: dict[tuple[str, str], SLORecord] = {}
        self.last: Evaluation | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=history)  # compact time series for the dashboard
        self._eval_lock = threading.RLock()  # snapshot() calls alerts() under it
        self.recorded = 0
        self._t_start: float | None = None

    # --- a fleet ------------------------------------------------------------------------------------------------------
    def join_fleet(self, redis_url: str, gateway_id: str, **kw: Any) -> FleetView:
        """Judge the fleet's merged windows from now on (see the module's docstring)."""
        self.fleet = FleetView(redis_url, gateway_id, self.windows, self.config, **kw)
        self.actions.hooks = _LeaderHooks(self.actions.hooks, self)  # type: ignore[assignment]
        return self.fleet

    @property
    def fires(self) -> bool:
        """Whether this monitor emits records and calls hooks: always alone, only as the leader in a fleet."""
        return self.fleet is None or self.fleet.leader

    def _leader_only(self, sink: RecordSink) -> RecordSink:
        def emit(record: dict[str, Any]) -> None:
            # The fleet's judgement (tiers, actions, advisories) is written once; what one gateway saw on its own
            # (a speculation audit of its engine) is written by that gateway.
            if self.fires or record.get("kind") == "audit" or record.get("name") == "spec_inconsistent":
                sink(record)
        return emit

    # --- request path ----------------------------------------------------------------------------------------------
    def record(self, request: Any, now: float | None = None) -> None:
        """Feed one finished request: a Timeline, a record dict or a :class:`RequestSample`. Never raises."""
        try:
            self.windows.record(request, now)  # queued; applied by the evaluation thread (see SlidingWindows.record)
            self.recorded += 1
            act = getattr(request, "slo_action", None)
            if act:
                self.metrics.affected.labels(act.get("action", "?"), act.get("mode") or act.get("action", "?")).inc()
        except Exception:  # noqa: BLE001 - monitoring must never fail a request
            log.exception("SLO monitor could not record a request")

    def shed_for(self, business_type: str | None, lane: str | None = None,
                 tenant: str | None = None) -> dict[str, Any] | None:
        return self.actions.shed_for(business_type, lane, tenant)

    def degradation_for(self, business_type: str | None = None, lane: str | None = None, client: str | None = None,
                        region: str | None = None, input_tokens: int | None = None,
                        tenant: str | None = None) -> Degradation | None:
        return self.actions.degradation_for(business_type, lane, client, region, input_tokens, tenant)

    # --- periodic ---------------------------------------------------------------------------------------------------
    @property
    def window_s(self) -> float:
        return self.config.peak_window_s if self.peak.peak else self.config.offpeak_window_s

    def evaluate(self, now: float | None = None) -> Evaluation:
        """One evaluation: windows -> tiers, objectives, advisories, views -> records and actions. ``now``: the time
        to judge at and to stamp the records with (tests); by default the steady clock judges and ``clock`` stamps."""
        with self._eval_lock:
            t0 = time.perf_counter()
            if now is None:
                now, wall = self.steady(), self.clock()
            else:
                wall = now
            self.windows.advance(now)
            if self.fleet is not None:
                # The fleet's windows (this gateway's own when Redis cannot be reached).
                self.evaluator.w = self.fleet.exchange(now) or self.windows
            cfg = self.config
            recent = self.windows.requests_in(cfg.peak_window_s, now)
            covered = min(cfg.peak_window_s, max(self.windows.slot_s, now - self._started_at(now)))
            # Configured peak hours are hours of the wall clock; the rest of the judgement runs on the steady one.
            peak = self.peak.update(wall, recent / covered if covered > 0 else 0.0)
            window_s = cfg.peak_window_s if peak else cfg.offpeak_window_s
            ev = self.evaluator.evaluate(now, peak, window_s, at=wall)
            self._emit_alerts(ev, wall)
            tiers = {name: v["tier_level"] for name, v in ev.scopes.items()}
            figures = {name: self._figures(v, ev) for name, v in ev.scopes.items()}
            alert_ids = {k: r.id for k, r in self._alerts.items()}
            self.actions.reconcile(tiers, figures, alert_ids, wall)
            ev.duration_s = time.perf_counter() - t0
            self._export(ev)
            self.last = ev
            first = next(iter(ev.scopes.values()))
            self.history.append({
                "at": wall, "tier": TIERS[ev.tier], "peak": peak, "requests": first["total"],
                "e2e": first["e2e"], "ttft": first["ttft"], "error_rate": first["error_rate"],
            })
            return ev

    def _started_at(self, now: float) -> float:
        if self._t_start is None:
            self._t_start = now
        return self._t_start

    @staticmethod
    def _figures(scope_view: dict[str, Any], ev: Evaluation) -> dict[str, Any]:
        return {
            "tier_metric": scope_view["tier_metric"], "tier_value": scope_view["tier_value"],
            "thresholds": scope_view["thresholds"], "samples": scope_view["samples"],
            "judged": [{k: j[k] for k in ("label", "value", "samples", "tier")} for j in scope_view["judged"]],
            "requests": scope_view["total"], "error_rate": scope_view["error_rate"],
            "e2e": {k: scope_view["e2e"][k] for k in ("p50", "p95", "p99")},
            "ttft": {k: scope_view["ttft"][k] for k in ("p50", "p95", "p99")},
            "window_s": ev.window_s, "peak": ev.peak,
        }

    def _emit_alerts(self, ev: Evaluation, now: float) -> None:
        dry = self.actions.dry_run
        for tr in ev.transitions:
            k = (tr.scope, tr.level)
            figs = self._figures(ev.scopes[tr.scope], ev)
            figs["threshold"] = tr.threshold
            why = {"metric": tr.metric, "reason": tr.reason}
            if tr.event == "raised":
                rec = SLORecord.start("alert", f"tier_{tr.tier}", "raised", tr.scope, tr.tier, now, figures=figs,
                                      details=why, dry_run=dry)
                self._alerts[k] = rec
                if self.fires:  # counted once for the fleet
                    self.metrics.alerts.labels(tr.scope, tr.tier).inc()
                self.metrics.alert_active.labels(tr.scope, tr.tier).set(1)
            else:
                start = self._alerts.pop(k, None)
                if start is None:  # cannot happen with a tracker that raised it; keep the record anyway
                    start = SLORecord.start("alert", f"tier_{tr.tier}", "raised", tr.scope, tr.tier, now,
                                            dry_run=dry)
                rec = start.end("cleared", now, figures=figs, details={"raised_figures": start.figures, **why},
                                dry_run=dry)
                self.metrics.alert_active.labels(tr.scope, tr.tier).set(0)
            self.records.emit(rec)
        for scope, rule, event, figs in ev.advisory_changes:
            self._emit_change(self._advisories, "advisory", scope, rule, event, figs, now, dry,
                              {"advice": ev.advisories[scope]["rules"][rule]["advice"]})
        for prof, label, event, figs in ev.objective_changes:
            self._emit_change(self._objectives, "objective", prof, label, event, figs, now, dry, {})

    def _emit_change(self, active: dict[tuple[str, str], SLORecord], kind: RecordKind, scope: str, name: str,
                     event: str, figs: dict[str, Any], now: float, dry: bool, details: dict[str, Any]) -> None:
        """One advisory or objective record: "raised" opens it in ``active``, "cleared" closes it with its id."""
        k = (scope, name)
        start = active.pop(k, None) if event == "cleared" else None
        if start is not None:
            rec = start.end(event, now, figures=figs, details=details, dry_run=dry)
        else:
            rec = SLORecord.start(kind, name, event, scope, None, now, figures=figs, details=details, dry_run=dry)
            if event == "cleared":
                rec = rec.end(event, now, figures=figs, details=details)
        if event == "raised":
            active[k] = rec
        self.records.emit(rec)

    def _export(self, ev: Evaluation) -> None:
        m = self.metrics
        m.peak.set(1 if ev.peak else 0)
        m.window.set(ev.window_s)
        m.eval_seconds.set(ev.duration_s)
        for name, v in ev.scopes.items():
            m.tier.labels(name).set(v["tier_level"])
            m.requests.labels(name).set(v["total"])
            m.error_ratio.labels(name).set(v["error_rate"] if v["error_rate"] is not None else math.nan)
            ir = v.get("interruption_rate")
            m.interruption_ratio.labels(name).set(ir if ir is not None else math.nan)
            for metric in CORE_METRICS:
                for q in ("p50", "p95", "p99"):
                    val = v[metric][q]
                    m.latency.labels(name, metric, q[1:]).set(val if val is not None else math.nan)
        for scope, adv in ev.advisories.items():
            for rule, r in adv["rules"].items():
                m.advisory.labels(scope, rule).set(1 if r["active"] else 0)
        for prof, p in ev.profiles.items():
            for o in p["objectives"]:
                val = {"ok": 1.0, "breach": 0.0}.get(o["status"], math.nan)
                m.objective.labels(prof, o["label"]).set(val)
        m.hotspots.set(len(ev.hotspots.get("requests", [])))

    # --- reading -----------------------------------------------------------------------------------------------------
    def alerts(self, limit: int | None = 100, kind: str | None = None, active_only: bool = False) -> list[dict]:
        """Recent records, oldest first. ``active_only``: the alerts, actions and advisories in effect now."""
        if active_only:
            with self._eval_lock:
                return self._active()
        return self.records.list(limit, kind)

    def _active(self) -> list[dict]:
        act = self.actions.active()
        recs = [r.to_dict() for r in (*self._alerts.values(), *self._advisories.values(), *self._objectives.values())]
        recs += [r for r in (act["scale_out"], act["shed"], *act["degrade"].values()) if r]
        return sorted(recs, key=lambda r: r["at"])

    def snapshot(self) -> dict[str, Any]:
        """Everything a dashboard or ``GET /v1/alerts`` needs, JSON-ready (call it off the event loop: it waits
        for a running evaluation)."""
        with self._eval_lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        ev = self.last
        return {
            "at": ev.at if ev else None,
            "tier": TIERS[ev.tier] if ev else "green",
            "evaluation": ev.to_dict() if ev else None,
            "peak": self.peak.state(),
            "window_s": self.window_s,
            "profiles": [p.name for p in self.profiles],
            "targets": {p.name: [o.describe() for o in p.objectives] for p in self.profiles},
            "actions": self.actions.active(),
            "active": self.alerts(active_only=True),
            "recent": self.alerts(limit=50),
            "history": list(self.history),
            "recorded": self.recorded,
            "dropped_keys": self.windows.dropped_keys,
            "dropped_samples": self.windows.dropped_samples,
            "bad_samples": self.windows.bad_samples,
        }

    # --- lifecycle ---------------------------------------------------------------------------------------------------
    async def run(self, interval_s: float | None = None, stop: asyncio.Event | None = None) -> None:
        """Evaluate every ``interval_s`` seconds in a worker thread until ``stop`` is set or the task is cancelled."""
        interval = interval_s or self.config.eval_interval_s
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                # In a worker thread: a query merges digests for a few ms, which the event loop should not wait on.
                await asyncio.to_thread(self.evaluate)
            except Exception:  # noqa: BLE001 - one failed evaluation must not end evaluating
                log.exception("SLO evaluation failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        # A cancelled run() leaves its worker thread evaluating: wait for it, so its records reach the sinks (the
        # server closes the store after this) and no hook is submitted after the hook runner has shut down.
        with self._eval_lock:
            self.actions.close()


class _LeaderHooks:
    """The scale hooks of a fleet member: called by the leader only (the others would call them again)."""

    def __init__(self, inner: HookRunner, monitor: SLOMonitor) -> None:
        self.inner = inner
        self.monitor = monitor

    @property
    def configured(self) -> bool:
        return self.inner.configured and self.monitor.fires

    def submit(self, payload: dict[str, Any], done: Callable[[dict[str, Any]], None]) -> None:
        if self.monitor.fires:
            self.inner.submit(payload, done)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# Keeps the leader key while its holder renews it; taken by whoever asks first once it lapses.
_LEAD = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
  return 1
end
return 0
"""


class FleetView:
    """This gateway's slots out to Redis, every gateway's slots back, merged (runs in the evaluation thread).

    Layout: ``{prefix}slo:gateways`` (sorted set: gateway id -> last publish, steady s), ``{prefix}slo:slots:{id}``
    (hash: slot index -> serialized slot, expiring after the longest window), ``{prefix}slo:leader`` (the leader's
    id, expiring after ``3 x eval_interval_s`` unless renewed).
    """

    def __init__(self, url: str, gateway_id: str, windows: SlidingWindows, config: MonitorConfig, *,
                 prefix: str = "tailguard:", timeout_s: float = 0.5, retry_s: float = 5.0,
                 leader_ttl_s: float | None = None, client: Any = None) -> None:
        import redis

        self.url = url
        self.gateway_id = gateway_id
        self.windows = windows
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_window_s = windows.max_slots * windows.slot_s
        self.leader_ttl_ms = int((leader_ttl_s or 3 * config.eval_interval_s) * 1000)
        self.client = client or redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._lead = self.client.register_script(_LEAD)
        self._sent: dict[int, bytes] = {}  # slot index -> what Redis holds for it (closed slots are sent once)
        self._closed: dict[tuple[str, int], Any] = {}  # (gateway, slot index) -> its closed slot, decoded
        self._merged: dict[int, tuple[frozenset[str], Any]] = {}  # slot index -> (its holders, the merged slot)
        self.leader = False
        self.down = False
        self._down_until = 0.0
        self.gateways = 1  # gateways in the last merged view
        self.failures = 0

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def exchange(self, now: float) -> SlidingWindows | None:
        """Publish, read the others, merge; None (and lead alone) when Redis cannot be reached."""
        if self._down_until and time.monotonic() < self._down_until:
            self.leader = True
            return None
        own = self.windows.export_slots(now)
        try:
            merged = self._exchange(own, now)
        except Exception as exc:  # noqa: BLE001 - the fleet view is optional: judge alone rather than not at all
            self.failures += 1
            self._down_until = time.monotonic() + self.retry_s
            self._sent.clear()
            self._closed.clear()
            self._merged.clear()
            self.leader = True
            if not self.down:
                self.down = True
                log.warning("fleet: Redis at %s is unreachable (%s: %s): this gateway judges its own SLO windows and "
                            "fires its own alerts until it answers again", self.url.split("@")[-1],
                            type(exc).__name__, str(exc)[:200])
            return None
        if self.down:
            self.down = False
            log.warning("fleet: Redis answers again: judging the fleet's merged SLO windows")
        return merged

    def _exchange(self, own: dict[int, bytes], now: float) -> SlidingWindows:
        mine = self.key("slo", "slots", self.gateway_id)
        gateways = self.key("slo", "gateways")
        pipe = self.client.pipeline(transaction=False)
        changed = {i: b for i, b in own.items() if self._sent.get(i) != b}
        if changed:
            pipe.hset(mine, mapping={str(i): b for i, b in changed.items()})
        stale = [str(i) for i in self._sent if i not in own]
        if stale:
            pipe.hdel(mine, *stale)
        pipe.pexpire(mine, int(self.max_window_s * 1000))
        pipe.zadd(gateways, {self.gateway_id: now})
        pipe.zremrangebyscore(gateways, "-inf", now - self.max_window_s)
        pipe.zrangebyscore(gateways, now - self.max_window_s, "+inf")
        res = pipe.execute()
        self._sent = dict(own)
        peers = [g.decode() if isinstance(g, bytes) else g for g in res[-1]]
        peers = [g for g in peers if g != self.gateway_id]
        parts = [(self.gateway_id, self._decoded(self.gateway_id, i, raw)) for i, raw in own.items()]
        if peers:
            # Closed slots never change: only the indices not kept yet (and each peer's open slot) are fetched.
            pipe = self.client.pipeline(transaction=False)
            for g in peers:
                pipe.hkeys(self.key("slo", "slots", g))
            wanted: list[tuple[str, list[int]]] = []
            for g, fields in zip(peers, pipe.execute(), strict=True):
                idx = sorted(int(f) for f in fields)
                parts += [(g, self._closed[(g, i)]) for i in idx if (g, i) in self._closed]
                wanted.append((g, [i for i in idx if (g, i) not in self._closed]))
            pipe = self.client.pipeline(transaction=False)
            for g, idx in wanted:
                if idx:
                    pipe.hmget(self.key("slo", "slots", g), [str(i) for i in idx])
            got = iter(pipe.execute())
            for g, idx in wanted:
                if idx:
                    parts += [(g, self._decoded(g, i, raw)) for i, raw in zip(idx, next(got), strict=True) if raw]
        oldest = int(now // self.windows.slot_s) - self.windows.max_slots
        live = {self.gateway_id, *peers}
        self._closed = {k: v for k, v in self._closed.items() if k[0] in live and k[1] > oldest}
        self.leader = bool(self._lead(keys=[self.key("slo", "leader")], args=[self.gateway_id, self.leader_ttl_ms]))
        self.gateways = len(live)
        return self._ring(parts, oldest)

    def _ring(self, parts: list[Any], oldest: int) -> SlidingWindows:
        """The fleet's ring. A slot closed on every gateway that has it is merged once and kept (with the query
        aggregates it caches), as long as the same gateways hold it."""
        by_index: dict[int, list[tuple[str, Any]]] = {}
        for gateway, slot in parts:
            by_index.setdefault(slot.index, []).append((gateway, slot))
        slots = []
        for index, group in by_index.items():
            holders = frozenset(g for g, _ in group)
            closed = all(sl.closed for _, sl in group)
            kept = self._merged.get(index)
            if closed and kept is not None and kept[0] == holders:
                slots.append(kept[1])
                continue
            merged = self.windows.merge_slots(sl for _, sl in group)
            if closed:
                self._merged[index] = (holders, merged)
            slots.append(merged)
        self._merged = {i: v for i, v in self._merged.items() if i > oldest}
        return self.windows.ring(slots)

    def _decoded(self, gateway: str, index: int, raw: bytes) -> Any:
        """A slot decoded once it is closed (kept), every time while it is open."""
        slot = self._closed.get((gateway, index))
        if slot is None:
            slot = self.windows.decode_slot(raw)
            if slot.closed:
                self._closed[(gateway, index)] = slot
        return slot

    def close(self) -> None:
        try:
            if self.leader:  # hand the lead over at once rather than after its expiry
                pipe = self.client.pipeline(transaction=False)
                pipe.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
                          "return 0", 1, self.key("slo", "leader"), self.gateway_id)
                pipe.execute()
            self.client.close()
        except Exception:  # noqa: BLE001 - closing must not fail the shutdown
            pass
