"""The traffic policy's decision for one request, made the same way whatever backend serves it.

In order, as the request arrives: who it is (the API key's tenant, already known), its lane (``choose_lane``),
whether the SLO monitor sheds it (``shed``, before it costs a parse or a tokenize), how the monitor degrades it
(``degrade``: a truncated ``max_tokens`` or a template answer), its engine priority (``priority``), the tenant's
rate limits (``charge``) and the lane's capacity (``admit``). Every step writes what it decided into the request's
timeline (``tl.lane``, ``tl.gateway``, ``tl.slo_action``), so the record says why. ``release`` gives back what the
request held (its lane slot, the output tokens charged but never produced), once, at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tailguard.api_error import APIError
from tailguard.observe.metrics import clean_label
from tailguard.policy.fleet_state import SharedState
from tailguard.policy.lanes import LaneConfig, Lanes, Overloaded
from tailguard.policy.tenants import RateLimited, Tenant

if TYPE_CHECKING:
    from tailguard.observe.gateway_metrics import GatewayMetrics
    from tailguard.observe.timeline import Timeline
    from tailguard.slo.actions import Degradation
    from tailguard.slo.monitor import SLOMonitor


# The longest Retry-After a shed request is told (the config bounds ``shed.retry_after_s`` to a day).
MAX_RETRY_AFTER_S = 86_400


def retry_after_header(seconds: float) -> int:
    """Whole seconds for a Retry-After header: at least 1, at most a day. A figure the config did not validate (an
    infinity, a NaN) must not turn a refusal into a 500."""
    if not math.isfinite(seconds):
        return MAX_RETRY_AFTER_S if seconds > 0 else 1
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds)))


def clean_text(value: str | None, limit: int = 256) -> str | None:
    """A client's string as a record can keep it: cut to ``limit``, lone surrogates (legal JSON escapes, not UTF-8)
    replaced."""
    if not value:
        return None
    return value[:limit].encode("utf-8", "replace").decode("utf-8")


@dataclass(slots=True)
class Decision:
    """What the policy decided for one request, and what the request holds until it ends."""

    tenant: Tenant | None = None  # the API key's tenant (rate limits, lane), None without a key file
    lane: LaneConfig | None = None  # the request's lane, when lanes are on
    priority: int = 0  # the engine priority (lower runs first)
    degradation: Degradation | None = None  # the SLO monitor's degradation, when red holds the request's scope
    max_tokens_cap: int | None = None  # the degradation's limit, when it truncates the answer
    lane_slot: str | None = None  # the lane whose capacity slot the request holds (given back once, at the end)
    lane_tokens: int = 0  # the estimated tokens that slot holds (prompt + max_tokens)
    lane_waited: float = 0.0  # seconds it waited for that slot
    charged: tuple[Tenant, int, bool] | None = None  # (tenant, output tokens charged, charged in the shared store)

    @property
    def tenant_name(self) -> str | None:
        return self.tenant.name if self.tenant is not None else None

    @property
    def sheddable(self) -> bool:
        """The SLO monitor may shed or degrade it: not in a lane that says no (VIP by default)."""
        return self.lane is None or self.lane.sheddable


class TrafficPolicy:
    """The server's policy: lanes, the shared rate-limit state and the SLO monitor's verdicts, with the settings
    that say whom to trust."""

    def __init__(self, lanes: Lanes | None, shared: SharedState, monitor: SLOMonitor | None,
                 metrics: GatewayMetrics | None, *, default_lane: str, trust_lane_header: bool) -> None:
        self.lanes = lanes
        self.shared = shared
        self.monitor = monitor
        self.metrics = metrics
        self.default_lane = default_lane
        self.trust_lane_header = trust_lane_header

    def choose_lane(self, d: Decision, tl: Timeline, claimed: str | None) -> None:
        """The request's lane: its tenant's, else the default lane. A claimed lane header is ignored and recorded,
        unless the operator says the header comes from a trusted proxy in front."""
        lanes = self.lanes
        if lanes is None:
            return
        if d.tenant is not None:
            name = d.tenant.lane
            tl.gateway = {"tenant": d.tenant.name}
        elif self.trust_lane_header and claimed and clean_label(claimed) in lanes.lanes:
            name = clean_label(claimed)
        else:
            name = self.default_lane
        if name not in lanes.lanes:
            raise APIError(500, f"this key's tenant is in lane {name!r}, which is not configured",
                           code="lane_not_configured")
        if claimed and not self.trust_lane_header and clean_label(claimed) != name:
            tl.gateway = {**(tl.gateway or {}), "lane_header_ignored": clean_text(claimed, 64)}
            gm = self.metrics
            if gm is not None:
                gm.lane_claims_ignored.labels(gm.model).inc()
        tl.lane = name
        d.lane = lanes.lanes[name].cfg

    def shed(self, d: Decision, tl: Timeline, business_type: str) -> None:
        """Orange: refuse non-core traffic before it costs a parse, a tokenize or a queue slot. Selected by business
        type, lane and the API key's tenant (never a header's)."""
        mon = self.monitor
        if mon is None or not d.sheddable:
            return
        tenant = d.tenant_name
        shed = mon.shed_for(business_type, tl.lane, tenant)
        if shed is None:
            return
        tl.slo_action = {k: shed[k] for k in ("action", "tier", "scope", "action_id")}
        wait = retry_after_header(shed["retry_after_s"])
        raise APIError(shed["status"], f"the service is shedding non-core traffic (SLO tier {shed['tier']}, "
                                       f"business type {business_type!r}, lane {tl.lane!r}"
                                       f"{f', tenant {tenant!r}' if tenant else ''}); retry in {wait} s",
                       code="slo_shed", headers={"Retry-After": str(wait)})

    def degrade(self, d: Decision, tl: Timeline, business_type: str, num_prompt_tokens: int,
                requested: int) -> int:
        """Red: the degradation for this request (recorded), and the ``max_tokens`` it runs under. Never for a lane
        the monitor may not touch (``sheddable: false``) or a protected tenant."""
        mon = self.monitor
        deg = mon.degradation_for(business_type, tl.lane, tl.client, tl.region, num_prompt_tokens, d.tenant_name) \
            if mon is not None and d.sheddable else None
        d.degradation = deg
        if deg is None:
            return requested
        tl.slo_action = {"action": "degrade", "mode": deg.mode, "tier": deg.tier, "scope": deg.scope,
                         "action_id": deg.action_id, "reason": deg.reason}
        if deg.mode != "truncate":
            return requested
        max_tokens = min(requested, deg.max_tokens)
        d.max_tokens_cap = max_tokens
        tl.slo_action.update(max_tokens=max_tokens, requested_max_tokens=requested)
        return max_tokens

    def priority(self, d: Decision, tl: Timeline, claimed: int | None) -> int:
        """The engine priority: the body's ``priority`` from a trusted proxy (a gateway in front sends its lane's),
        else the lane's (0 without lanes). A claim from anyone else is ignored and recorded."""
        own = d.lane.priority if d.lane is not None else 0
        d.priority = own
        if claimed is None or claimed == own:
            return own
        if self.trust_lane_header:
            d.priority = claimed
            return claimed
        tl.gateway = {**(tl.gateway or {}), "priority_ignored": claimed}
        return own

    async def charge(self, d: Decision, tl: Timeline, max_tokens: int) -> None:
        """Charge the tenant's rate limits (this gateway's, or the fleet's in Redis) with the request's tokens."""
        tenant = d.tenant
        if tenant is None:
            return
        try:
            shared = await self.shared.charge(tenant, tl.num_prompt_tokens + max_tokens)
        except RateLimited as exc:
            gm = self.metrics
            if gm is not None:
                gm.rate_limited.labels(gm.model, tenant.name).inc()
            raise APIError(429, f"{exc.what}; retry in {exc.retry_after} s", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after)}) from None
        d.charged = (tenant, max_tokens, shared)

    async def admit(self, d: Decision, tl: Timeline, tokens: int) -> None:
        """Wait for the lane's capacity (a slot, and ``tokens`` of its token budget), or be refused with a 429."""
        lanes = self.lanes
        if lanes is None or d.lane is None:
            return
        gm = self.metrics
        try:
            waited = await lanes.acquire(tl.lane, d.tenant_name or "", tokens=tokens)
        except Overloaded as exc:
            if gm is not None:
                gm.lane_refused.labels(gm.model, tl.lane).inc()
            raise APIError(429, f"{exc}; retry in {exc.retry_after} s", type="rate_limit_error",
                           code="lane_overloaded", headers={"Retry-After": str(exc.retry_after)}) from None
        d.lane_slot, d.lane_tokens, d.lane_waited = tl.lane, tokens, waited
        tl.gateway = {**(tl.gateway or {}), "lane_wait": round(waited, 6), "lane_tokens": tokens}
        if gm is not None:
            gm.child(gm.lane_wait, tl.lane).observe(waited)

    def refuse_late(self, d: Decision, tl: Timeline, predicted_s: float | None, now: float) -> None:
        """Known early: refuse with a 429 a request whose first token would come past its lane's ``ttft_target_s``
        (the time it has waited until ``now`` plus ``predicted_s``, the backend's prediction from here), when even
        the prediction's spread (the lane's ``ttft_target_margin``) does not bring it inside. Served, it would
        take a place in the engine's queue to answer late, and lengthen the wait of every request behind it."""
        lane = d.lane
        if lane is None or lane.ttft_target_s is None or predicted_s is None:
            return
        waited = now - tl.received
        expected = waited + predicted_s
        tl.gateway = {**(tl.gateway or {}), "predicted_ttft": round(expected, 6)}
        target = lane.ttft_target_s
        if waited + predicted_s / lane.ttft_target_margin <= target:
            return
        gm = self.metrics
        if gm is not None:
            gm.ttft_refused.labels(gm.model, tl.lane).inc()
        wait = max(1, math.ceil(expected - target))  # about when the work ahead of it has drained that much
        raise APIError(429, f"lane {tl.lane!r} is overloaded: the first token is predicted in {expected:.2f} s, past "
                            f"its target of {target:g} s; retry in {wait} s", type="rate_limit_error",
                       code="ttft_target_unreachable", headers={"Retry-After": str(wait)})

    def release(self, d: Decision, output_tokens: int) -> None:
        """Give back what the request held: its lane slot, and the output tokens charged but never produced."""
        if d.lane_slot is not None and self.lanes is not None:
            self.lanes.release(d.lane_slot, d.lane_tokens)
            d.lane_slot = None
        if d.charged is not None:
            tenant, max_out, shared = d.charged
            d.charged = None
            self.shared.refund(tenant, max_out - output_tokens, shared)
