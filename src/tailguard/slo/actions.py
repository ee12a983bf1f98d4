"""Actions: what each tier does, how it is undone, and the record of every step.

- **yellow** (and above) -> scale out: a webhook POST and/or a command with the JSON request on stdin, asking for
  ``replicas_pct`` (10%) more replicas; once per escalation (green -> yellow), and a matching scale-in request
  (``replicas_delta_pct`` negative) when the monitor is back to green. A gateway with a replica provider
  (``scale_out.provider``) also starts and stops replicas itself: the server hands the engine a :class:`Scaler`
  (this floor never imports what starts replicas), called with the same request, and each replica it starts or
  stops becomes a ``hook`` record with ``target: provider``.
- **orange** (and above) -> shed: :meth:`ActionEngine.shed_for` answers with the refusal (status, ``Retry-After``)
  for non-core business types, lanes and tenants (protected lanes and tenants never); the server answers 429 or 503.
- **red** -> degrade: :meth:`ActionEngine.degradation_for` returns a :class:`Degradation` for traffic of the red
  scope, minus protected lanes and tenants (shedding goes on, since red implies orange). By default it says "truncate: cap max_tokens at N"; a canned
  template answer only where ``degrade.mode: template`` asks for one. The server applies it and marks the response
  and the record degraded.

Every action is undone when its tier clears. In dry-run mode nothing changes (no hook call, no shedding, no
degradation); only the records say what would have happened. Every alert and action becomes one typed
:class:`SLORecord`, built by :meth:`SLORecord.start` / :meth:`SLORecord.end` only; :class:`RecordLog` hands its dict
form to the sinks (the server's request store persists them). Everything is counted in Prometheus metrics
(:class:`SLOMetrics`).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from tailguard.slo.config import TIERS, ActionsConfig, ScaleOutConfig
from tailguard.slo.profiles import Selector

log = logging.getLogger("tailguard.slo")

__all__ = ["ActionEngine", "Degradation", "HookRunner", "RecordLog", "RecordSink", "SLOMetrics", "SLORecord", "Scaler",
           "new_id"]

RecordSink = Callable[[dict[str, Any]], None]


def new_id() -> str:
    return uuid.uuid4().hex[:16]


RecordKind = Literal["alert", "action", "hook", "advisory", "objective", "audit"]


@dataclass(frozen=True, slots=True)
class SLORecord:
    """One alert, action, hook call, advisory or objective change: the monitor's only record type.

    Records are events. ``start`` opens one (an alert raised, an action started); ``end`` closes it with a second
    record that repeats its ``id`` and ``started_at`` and sets ``ended_at``. ``figures`` are the numbers that
    triggered it, ``details`` what was done; ``alert_id`` links an action to the alert that caused it.
    """

    id: str
    kind: RecordKind
    name: str
    event: str
    scope: str
    tier: str | None
    at: float
    started_at: float | None
    ended_at: float | None
    figures: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    alert_id: str | None = None

    @classmethod
    def start(cls, kind: RecordKind, name: str, event: str, scope: str, tier: str | None, at: float, *,
              figures: dict[str, Any] | None = None, details: dict[str, Any] | None = None, dry_run: bool = False,
              alert_id: str | None = None, started_at: float | None = None) -> SLORecord:
        return cls(new_id(), kind, name, event, scope, tier, at, at if started_at is None else started_at, None,
                   dict(figures or {}), dict(details or {}), dry_run, alert_id)

    def end(self, event: str, at: float, *, tier: str | None = None, figures: dict[str, Any] | None = None,
            details: dict[str, Any] | None = None, dry_run: bool | None = None) -> SLORecord:
        """The record that closes this one: same id, kind, name, scope, start and alert."""
        return replace(self, event=event, at=at, ended_at=at, tier=self.tier if tier is None else tier,
                       figures=dict(figures or {}), details=dict(details or {}),
                       dry_run=self.dry_run if dry_run is None else dry_run)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form the sinks, the store and ``GET /v1/alerts`` carry."""
        return {"id": self.id, "kind": self.kind, "name": self.name, "event": self.event, "scope": self.scope,
                "tier": self.tier, "at": self.at, "started_at": self.started_at, "ended_at": self.ended_at,
                "figures": self.figures, "details": self.details, "dry_run": self.dry_run, "alert_id": self.alert_id}


class RecordLog:
    """Keeps the last ``max_records`` alert/action records and hands each new one to every sink.

    Records are :class:`SLORecord`; the log keeps and hands out their dict form (``SLORecord.to_dict``). A sink
    that raises is logged and skipped, never propagated.
    """

    def __init__(self, max_records: int = 1000, sinks: list[RecordSink] | None = None) -> None:
        self._records: deque[dict[str, Any]] = deque(maxlen=max_records)
        self._sinks: list[RecordSink] = list(sinks or [])
        self._lock = threading.Lock()
        self.sink_errors = 0

    def emit(self, rec: SLORecord) -> dict[str, Any]:
        record = rec.to_dict()
        with self._lock:
            self._records.append(record)
            sinks = list(self._sinks)
        for sink in sinks:
            try:
                sink(record)
            except Exception:  # noqa: BLE001 - a broken sink must not stop the monitor
                self.sink_errors += 1
                log.exception("SLO record sink failed")
        return record

    def list(self, limit: int | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            recs = [r for r in self._records if kind is None or r["kind"] == kind]
        return recs[-limit:] if limit else recs


class SLOMetrics:
    """Prometheus series of the monitor (``tailguard_slo_*``), in the server's registry or a private one."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tier = Gauge("tailguard_slo_tier", "Current tier per scope: 0 green, 1 yellow, 2 orange, 3 red.",
                          ["scope"], registry=r)
        self.alert_active = Gauge("tailguard_slo_alert_active", "1 while the tier alert is active.",
                                  ["scope", "tier"], registry=r)
        self.alerts = Counter("tailguard_slo_alerts", "Tier alerts raised.", ["scope", "tier"], registry=r)
        self.actions = Counter("tailguard_slo_actions", "Actions taken (event: started, undone; dry_run: 0/1).",
                               ["action", "event", "dry_run"], registry=r)
        self.action_active = Gauge("tailguard_slo_action_active", "1 while the action is in effect.",
                                   ["action", "scope"], registry=r)
        self.hook_calls = Counter("tailguard_slo_hook_calls", "Scale hook calls by target and result.",
                                  ["target", "result"], registry=r)
        self.advisory = Gauge("tailguard_slo_advisory_active", "1 while a golden-rule advisory holds.",
                              ["scope", "rule"], registry=r)
        self.objective = Gauge("tailguard_slo_objective_met",
                               "1 objective met, 0 breached, NaN too few samples, over the live window.",
                               ["profile", "objective"], registry=r)
        self.latency = Gauge("tailguard_slo_window_latency_seconds", "Latency percentile over the live window (percentile: 50, 95, 99;"
                             " not 'quantile', which Prometheus reserves for summaries).",
                             ["scope", "metric", "percentile"], registry=r)
        self.requests = Gauge("tailguard_slo_window_requests", "Requests finished in the live window.", ["scope"],
                              registry=r)
        self.interruption_ratio = Gauge(
            "tailguard_slo_window_stream_interruption_ratio",
            "Streams the server ended without [DONE] (the client still there) / streams that began, in the window.",
            ["scope"], registry=r)
        self.error_ratio = Gauge("tailguard_slo_window_error_ratio", "Errors / served requests in the window.",
                                 ["scope"], registry=r)
        self.peak = Gauge("tailguard_slo_peak", "1 at peak (5-minute window), 0 otherwise (15-minute).", registry=r)
        self.window = Gauge("tailguard_slo_window_seconds", "Length of the live window.", registry=r)
        self.eval_seconds = Gauge("tailguard_slo_evaluation_duration_seconds", "Duration of the last evaluation.",
                                  registry=r)
        self.affected = Counter("tailguard_slo_requests_affected",
                                "Requests the monitor acted on: shed (refused) or degraded (template/truncate).",
                                ["action", "mode"], registry=r)
        self.hotspots = Gauge("tailguard_slo_hotspot_requests", "Requests above mean + 2 sigma of log E2E now.",
                              registry=r)


@dataclass(frozen=True)
class Degradation:
    """The decision for one request while red holds its scope: what the server must do, and what it must say.

    ``mode`` is ``"truncate"`` (the default: serve the request, with at most ``max_tokens`` output tokens) or
    ``"template"`` (opt-in: answer with ``template`` and no model call). The server applies :meth:`cap` to the
    request's max_tokens, stores :meth:`slo_action` in the request's record, and shows the degradation in the
    response body (see docs/slo.md, "What a degraded answer looks like").
    """

    mode: Literal["truncate", "template"]
    template: str
    max_tokens: int
    scope: str
    tier: str
    action_id: str
    reason: str

    @property
    def truncates(self) -> bool:
        return self.mode == "truncate"

    @property
    def answers_with_template(self) -> bool:
        return self.mode == "template"

    def cap(self, requested_max_tokens: int) -> int:
        """The max_tokens to serve with: the request's own, capped while truncating."""
        return min(requested_max_tokens, self.max_tokens) if self.truncates else requested_max_tokens

    def describe(self) -> str:
        return f"truncate to {self.max_tokens} tokens" if self.truncates else "answer with the template"

    def slo_action(self) -> dict[str, Any]:
        """The record of this decision for the request (``Timeline.slo_action``)."""
        out: dict[str, Any] = {"action": "degrade", "mode": self.mode, "tier": self.tier, "scope": self.scope,
                               "action_id": self.action_id, "reason": self.reason}
        if self.truncates:
            out["max_tokens"] = self.max_tokens
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Scaler(Protocol):
    """What scales in this process (a gateway's replica provider), handed to :class:`ActionEngine` by the server.

    ``submit`` gets the scale request the hooks get (``action``, ``replicas_delta_pct``, ...) and must not block (it
    is called on the evaluation thread); ``done`` is called with one result per step (a replica started or stopped,
    a failure, a bound that left nothing to do), each a dict with ``ok`` and, optionally, ``event`` (the record's
    event: ``ok``, ``failed`` or ``skipped``) and ``target``. ``close`` stops what it started (the server's end)."""

    def submit(self, payload: dict[str, Any], done: Callable[[dict[str, Any]], None]) -> None: ...

    def close(self) -> None: ...


class HookRunner:
    """Calls the scale-out webhook and/or command. Inline (in the caller) or on one background thread, FIFO, so a
    slow autoscaler never stalls evaluation. ``done(result)`` is called with each call's outcome."""

    def __init__(self, cfg: ScaleOutConfig, inline: bool = False) -> None:
        self.cfg = cfg
        self.inline = inline
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._client = None

    @property
    def configured(self) -> bool:
        return bool(self.cfg.webhook_url or self.cfg.command)

    def submit(self, payload: dict[str, Any], done: Callable[[dict[str, Any]], None]) -> None:
        if self.inline:
            for res in self._call(payload):
                done(res)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tailguard-slo-hooks", daemon=True)
            self._thread.start()
        self._q.put((payload, done))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted call has finished (tests, shutdown)."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        while self._q.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        if self._thread is not None:
            self.flush(self.cfg.timeout_s * 2)
            self._q.put(None)
            self._thread.join(1.0)
            self._thread = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                payload, done = item
                for res in self._call(payload):
                    try:
                        done(res)
                    except Exception:  # noqa: BLE001
                        log.exception("hook result callback failed")
            finally:
                self._q.task_done()

    def _call(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        body = json.dumps(payload, separators=(",", ":")).encode()
        if self.cfg.webhook_url:
            t0 = time.perf_counter()
            res: dict[str, Any] = {"target": "webhook", "url": self.cfg.webhook_url}
            try:
                import httpx

                if self._client is None:
                    self._client = httpx.Client(timeout=self.cfg.timeout_s)
                r = self._client.post(self.cfg.webhook_url, content=body,
                                      headers={"content-type": "application/json", **self.cfg.headers})
                res.update(ok=r.is_success, status=r.status_code)
                if not r.is_success:
                    res["error"] = r.text[:200]
            except Exception as e:  # noqa: BLE001 - report, never raise into the monitor
                res.update(ok=False, status=None, error=f"{type(e).__name__}: {e}"[:300])
            res["duration_s"] = time.perf_counter() - t0
            out.append(res)
        if self.cfg.command:
            t0 = time.perf_counter()
            res = {"target": "command", "command": list(self.cfg.command)}
            try:
                p = subprocess.run(self.cfg.command, input=body, capture_output=True, timeout=self.cfg.timeout_s,
                                   check=False)
                res.update(ok=p.returncode == 0, status=p.returncode)
                if p.returncode != 0:
                    res["error"] = p.stderr.decode(errors="replace")[-300:]
            except Exception as e:  # noqa: BLE001
                res.update(ok=False, status=None, error=f"{type(e).__name__}: {e}"[:300])
            res["duration_s"] = time.perf_counter() - t0
            out.append(res)
        return out


class ActionEngine:
    """Turns tiers into actions and back. ``reconcile`` is called after each evaluation with the tier of every
    scope; ``shed_for`` and ``degradation_for`` are the cheap questions the server asks per request."""

    def __init__(
        self,
        cfg: ActionsConfig,
        scopes: Mapping[str, Selector],
        records: RecordLog,
        metrics: SLOMetrics | None = None,
        hooks: HookRunner | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.scopes = dict(scopes)
        self.records = records
        self.metrics = metrics
        self.hooks = hooks or HookRunner(cfg.scale_out, inline=cfg.inline_hooks)
        self.dry_run = cfg.dry_run
        # What the scale-out hook is told about the deployment (a gateway: its replica set), set by the server.
        self.context: Callable[[], dict[str, Any]] | None = None
        # What starts and stops replicas in this process (a gateway's replica provider), set by the server.
        self.scaler: Scaler | None = None
        self.scale_out: SLORecord | None = None  # the "started" record while in effect
        self.shed: SLORecord | None = None
        self.degrade: dict[str, SLORecord] = {}  # scope -> "started" record
        # Per-request fast path state (rebuilt on change; read without a lock: plain attribute swaps).
        self._shed_on = False
        self._shed_info: dict[str, Any] | None = None
        self._shed_bt = frozenset(cfg.shed.non_core_business_types)
        self._shed_lanes = frozenset(cfg.shed.non_core_lanes)
        self._shed_protected = frozenset(cfg.shed.protected_lanes)
        self._shed_tenants = frozenset(cfg.shed.non_core_tenants)
        self._shed_protected_tenants = frozenset(cfg.shed.protected_tenants)
        self._degrade_scopes: tuple[tuple[Selector, Degradation], ...] = ()
        self._degrade_protected = frozenset(cfg.degrade.protected_lanes)
        self._degrade_protected_tenants = frozenset(cfg.degrade.protected_tenants)
        self._probe_every = cfg.degrade.probe_every
        self._affected = 0  # requests matched by a degradation, for the every-n-th probe

    # --- per-request questions ---------------------------------------------------------------------------------------
    def shed_for(self, business_type: str | None, lane: str | None = None,
                 tenant: str | None = None) -> dict[str, Any] | None:
        """What the server needs to refuse this request while shedding (status, Retry-After, the action's id and
        tier, for the response and the record), or None to let it through. ``tenant``: the API key's tenant (None
        for a request without one); a protected lane or tenant is never shed."""
        info = self._shed_info  # one read: the evaluation thread may swap it meanwhile
        if info is None or lane in self._shed_protected or (tenant is not None and tenant in self._shed_protected_tenants):
            return None
        if business_type in self._shed_bt or lane in self._shed_lanes or (
                tenant is not None and tenant in self._shed_tenants):
            return info
        return None

    def degradation_for(self, business_type: str | None = None, lane: str | None = None, client: str | None = None,
                        region: str | None = None, input_tokens: int | None = None,
                        tenant: str | None = None) -> Degradation | None:
        """The degradation to apply while red holds a scope this request belongs to, else None (always None for a
        protected lane or tenant)."""
        scopes = self._degrade_scopes
        if not scopes or lane in self._degrade_protected or (
                tenant is not None and tenant in self._degrade_protected_tenants):
            return None
        for sel, deg in scopes:
            if sel.matches(business_type=business_type, lane=lane, client=client, region=region,
                           input_tokens=input_tokens):
                self._affected += 1  # the event loop is the only caller: no lock needed
                if self._probe_every and self._affected % self._probe_every == 0:
                    return None  # a probe: served normally so that the window keeps measuring the engine
                return deg
        return None

    # --- records -----------------------------------------------------------------------------------------------------
    def _start(self, name: str, now: float, scope: str, tier: int, figures: dict[str, Any],
               details: dict[str, Any], alert_id: str | None) -> SLORecord:
        return SLORecord.start("action", name, "started", scope, TIERS[tier], now, figures=figures, details=details,
                               dry_run=self.dry_run, alert_id=alert_id)

    def _emit(self, rec: SLORecord) -> SLORecord:
        self.records.emit(rec)
        if self.metrics is not None:
            self.metrics.actions.labels(rec.name, rec.event, "1" if self.dry_run else "0").inc()
            self.metrics.action_active.labels(rec.name, rec.scope).set(
                1 if rec.event == "started" and not self.dry_run else 0)
        return rec

    def _payload(self, action_rec: SLORecord, delta_pct: float, now: float) -> dict[str, Any]:
        payload = {
            "source": "tailguard", "action": "scale_out" if delta_pct > 0 else "scale_in",
            "replicas_delta_pct": delta_pct, "reason": f"tier {action_rec.tier} in scope {action_rec.scope}",
            "action_id": action_rec.id, "alert_id": action_rec.alert_id, "at": now,
            "figures": action_rec.figures,
        }
        if self.context is not None:
            try:
                payload.update(self.context())
            except Exception:  # noqa: BLE001 - the hook goes out without the context rather than not at all
                log.exception("scale-out hook: could not describe the deployment")
        return payload

    def _done(self, action_rec: SLORecord, action: str, now: float) -> Callable[[dict[str, Any]], None]:
        """Each outcome of a hook call or a provider step becomes one ``hook`` record, and a count."""
        def done(res: dict[str, Any]) -> None:
            self._hook_record(action, action_rec.scope, action_rec.tier, now, {}, {**res, "ref": action_rec.id},
                              action_rec.alert_id)
        return done

    def _hook_record(self, action: str, scope: str, tier: str | None, started_at: float, figures: dict[str, Any],
                     res: dict[str, Any], alert_id: str | None) -> None:
        t = self.clock()
        event = res.get("event") or ("ok" if res.get("ok") else "failed")
        self.records.emit(SLORecord(new_id(), "hook", action, event, scope, tier, t, started_at, t, figures, res,
                                    False, alert_id))
        if self.metrics is not None:
            self.metrics.hook_calls.labels(res.get("target", "?"), event).inc()

    def provider_step(self, action: str, figures: dict[str, Any], res: dict[str, Any]) -> None:
        """A step the replica provider took on the gateway's backlog (its autoscaler, not a tier): one ``hook``
        record in scope ``backlog``, with the load that triggered it, counted like the tiers' own."""
        self._hook_record(action, "backlog", None, self.clock(), dict(figures), {**res, "trigger": "backlog"}, None)

    def _scale(self, action_rec: SLORecord, delta_pct: float, now: float) -> None:
        """Ask for the replicas: the hooks (webhook, command) and the replica provider, each told the same. What was
        done goes into the action's details (``hook``, and ``provider`` where there is one)."""
        details = action_rec.details
        payload: dict[str, Any] | None = None
        if self.dry_run:
            details["hook"] = "dry_run"
        elif not self.hooks.configured:
            details["hook"] = "no_hook_configured"
        else:
            payload = self._payload(action_rec, delta_pct, now)
            self.hooks.submit(payload, self._done(action_rec, payload["action"], now))
            details["hook"] = "submitted"
        if self.scaler is not None:
            if self.dry_run:
                details["provider"] = "dry_run"
                return
            payload = payload or self._payload(action_rec, delta_pct, now)
            self.scaler.submit(payload, self._done(action_rec, payload["action"], now))
            details["provider"] = "submitted"

    # --- tiers -> actions --------------------------------------------------------------------------------------------
    def reconcile(self, tiers: Mapping[str, int], figures: Mapping[str, dict[str, Any]],
                  alert_ids: Mapping[tuple[str, int], str], now: float) -> list[dict[str, Any]]:
        """Bring the actions in line with the tiers; returns the records emitted (dict form)."""
        out: list[SLORecord] = []
        top_scope = max(tiers, key=lambda s: tiers[s]) if tiers else "all"
        top = tiers.get(top_scope, 0)
        figs_top = dict(figures.get(top_scope, {}))
        so = self.cfg.scale_out
        # yellow and above: scale out, once per escalation from green
        if top >= 1 and self.scale_out is None:
            rec = self._start("scale_out", now, top_scope, top, figs_top, {"replicas_delta_pct": so.replicas_pct},
                              alert_ids.get((top_scope, 1)))
            self.scale_out = self._emit(rec)
            # After the record, so that it precedes the hook's own record; its details dict is shared, not copied.
            self._scale(rec, so.replicas_pct, now)
            out.append(rec)
        elif top == 0 and self.scale_out is not None:
            rec = self.scale_out.end("undone", now, tier=TIERS[0], figures=figs_top,
                                     details={"replicas_delta_pct": -so.replicas_pct if so.undo else 0})
            self.scale_out = None
            out.append(self._emit(rec))
            if so.undo:
                self._scale(rec, -so.replicas_pct, now)
            else:
                rec.details["hook"] = "undo_disabled"
                if self.scaler is not None:
                    rec.details["provider"] = "undo_disabled"
        # orange and above: shed non-core traffic
        if self.cfg.shed.enabled:
            if top >= 2 and self.shed is None:
                sc = self.cfg.shed
                rec = self._start("shed", now, top_scope, top, figs_top, {
                    "non_core_business_types": sc.non_core_business_types, "non_core_lanes": sc.non_core_lanes,
                    "non_core_tenants": sc.non_core_tenants, "protected_lanes": sc.protected_lanes,
                    "protected_tenants": sc.protected_tenants, "status": sc.status, "retry_after_s": sc.retry_after_s,
                }, alert_ids.get((top_scope, 2)))
                self.shed = self._emit(rec)
                self._shed_on = not self.dry_run
                self._shed_info = None if self.dry_run else {
                    "action": "shed", "mode": "shed", "status": sc.status, "retry_after_s": sc.retry_after_s,
                    "tier": rec.tier, "scope": top_scope, "action_id": rec.id,
                }
                out.append(rec)
            elif top < 2 and self.shed is not None:
                self._shed_on = False
                self._shed_info = None
                out.append(self._emit(self.shed.end("undone", now, tier=TIERS[top], figures=figs_top)))
                self.shed = None
        # red: degrade the red scope's traffic
        if self.cfg.degrade.enabled:
            changed = False
            for scope, lv in tiers.items():
                figs = dict(figures.get(scope, {}))
                if lv >= 3 and scope not in self.degrade:
                    dc = self.cfg.degrade
                    details: dict[str, Any] = {"mode": dc.mode, "protected_lanes": dc.protected_lanes,
                                               "protected_tenants": dc.protected_tenants}
                    details.update({"max_tokens": dc.max_tokens} if dc.mode == "truncate" else {"template": dc.template})
                    rec = self._start("degrade", now, scope, lv, figs, details, alert_ids.get((scope, 3)))
                    self.degrade[scope] = self._emit(rec)
                    changed = True
                    out.append(rec)
                elif lv < 3 and scope in self.degrade:
                    start = self.degrade.pop(scope)
                    out.append(self._emit(start.end("undone", now, tier=TIERS[lv], figures=figs)))
                    changed = True
            if changed:
                self._rebuild_degrade()
        return [r.to_dict() for r in out]

    def _rebuild_degrade(self) -> None:
        self._affected = 0  # probes count from the start of each degradation
        if self.dry_run:
            self._degrade_scopes = ()
            return
        dc = self.cfg.degrade
        # The lanes a scope leaves out of its judgement (the non-core lanes, waiting by design) are degraded with
        # it: red relieves the load, and the least important traffic that was not shed goes short first.
        self._degrade_scopes = tuple(
            (self.scopes.get(scope, Selector()).model_copy(update={"not_lanes": ()}),
             Degradation(mode=dc.mode, template=dc.template, max_tokens=dc.max_tokens, scope=scope, tier="red",
                         action_id=rec.id,
                         reason=f"red: {rec.figures.get('tier_metric', 'latency')} = "
                                f"{_fmt(rec.figures.get('tier_value'))} over {rec.scope}"))
            for scope, rec in self.degrade.items()
        )

    def active(self) -> dict[str, Any]:
        """The actions in effect (their "started" records, dict form)."""
        return {
            "dry_run": self.dry_run,
            "scale_out": self.scale_out.to_dict() if self.scale_out else None,
            "shed": self.shed.to_dict() if self.shed else None,
            "degrade": {scope: r.to_dict() for scope, r in self.degrade.items()},
            "shedding": self._shed_on,
            "degrading": [d.scope for _, d in self._degrade_scopes],
        }

    def close(self) -> None:
        self.hooks.close()
        if self.scaler is not None:
            self.scaler.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.3f}s"
    return str(v)
