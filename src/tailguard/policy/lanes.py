"""Lanes and reserved capacity (E2): who is admitted to the backend, in what order, and who waits or is refused.

Capacity is a number of concurrent sequences ``C``. It is cut into three parts:

- the reserved share ``R`` (default 20%) belongs to the reserved lane (``vip``). Other lanes may borrow it only while
  that lane is idle (nothing in flight, nothing waiting); when a VIP request arrives it is admitted at once against its
  own share, so for a moment the backend holds more than ``C`` and gives the borrowed room back by priority (the
  embedded engine preempts the lowest-priority running sequence) and by admission order (VIP waiters go first).
  A backend that cannot preempt for an arrival (llama.cpp's server has no priorities; vLLM with
  ``--scheduling-policy priority`` orders its queue by priority but preempts only when its KV cache runs out) can only
  give it back when a borrowed sequence ends, and the VIP request waits in the upstream's queue meanwhile; so by
  default the reserve is lent only on the embedded engine and over replicas that all preempt for priority
  (``CapacityConfig.lend_reserve``, ``UpstreamConfig.preempts``: another tailguard);
- the burst pool ``B`` (default 5%) is used only when the general part is full, by lanes allowed to burst;
- the general part ``G = C - R - B`` is shared; batch gets what the lanes above leave.

Each lane has a bounded queue. Within a lane, tenants are served round-robin (fair queueing), so one tenant's flood
cannot push another tenant's requests back. Each request has a deadline to be admitted: when the measured drain rate
says it cannot make it, it is refused at once with a ``Retry-After`` (before it costs a queue slot), and one that
waits past its deadline is refused then.

Capacity in tokens (optional, ``CapacityConfig.tokens_per_s``): the backend may hold ``tokens_per_s x
token_horizon_s`` tokens of outstanding work. ``tokens_per_s: auto`` measures the rate instead: what the backend
drains while work waits for it (``tailguard.policy.token_rate``); until the first such window there is no token
budget. Each admitted request holds its estimated cost (prompt tokens +
max_tokens, passed to ``acquire`` and given back to ``release``) until it finishes. The token budget is cut like the
sequences (reserved, burst, general; borrowing the reserve only while its lane is idle) and a request must fit both.
A request larger than its lane's whole token share is admitted alone: a reserved-lane request when no reserved
request holds tokens, any other when no non-reserved request does (and the reserved lane holds at most its share);
it holds its full cost, so the rest waits until it finishes. It is never refused for its size. A request that
passes no ``tokens`` (0) is counted in sequences only.

The upstream queue gate (optional, ``upstream_full``, asked with the number of requests this gateway has admitted
and not yet released): over upstream replicas that report their waiting queue (``tailguard.backends.upstream.pool``), while
they together hold more than ``CapacityConfig.upstream_queue_limit`` per replica, the non-reserved lanes admit
nobody new: their requests wait here, in lane order and fairly by tenant,
rather than in the upstream's FIFO; the reserved lane is still admitted up to its reserve. The hook is asked at
each admission decision, and ``poke()`` re-runs the decisions when the figure changes (a new scrape).

In a fleet (several gateways sharing Redis, ``tailguard.policy.fleet_state``), the same rule runs over the fleet's
in-flight counts: a slot is a lease in Redis, taken atomically, and the reserve is a fleet reserve. Queues and
fairness stay per gateway; waiters are admitted by a pump that retries the fleet every ``FLEET_POLL_S`` (and at once
when this gateway releases a slot). Redis unreachable: the gateway falls back to its own counts (fail open). The
token budget and the upstream queue gate are this gateway's own in a fleet (checked before a fleet slot is taken):
give each gateway its share of ``tokens_per_s``, or let ``auto`` measure the share its own requests drain at.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tailguard.policy.token_rate import TokenRateMeter

if TYPE_CHECKING:
    from tailguard.policy.fleet_state import RedisState

# Over upstream replicas every lane keeps time unless its config says otherwise (``LaneConfig.for_upstreams``): a
# replica that stops answering (a hung engine, a stopped process) must not hold a stream silent. The first token's
# deadline leaves room for a long prompt's prefill and the replica's own queue (three misses: 45 s); between tokens,
# three misses of 3 s. Keep-alive comments go out while the first token is pending.
UPSTREAM_TTFT_DEADLINE_S = 15.0
UPSTREAM_ITL_DEADLINE_S = 3.0
UPSTREAM_KEEPALIVE_S = 5.0

# By default a lane's ttft_target_s refuses a request only when the prediction divided by this still misses it:
# replayed (benchmarks/schedule_replay.py) and served (benchmarks/ttft_target.py), predicted / actual TTFT was at most
# 1.19-1.29 for nine requests in ten.
TTFT_PREDICTION_SPREAD = 1.3

FLEET_POLL_S = 0.02  # how often queued requests retry the fleet's budget (slots freed on another gateway)
MIN_DRAIN_SAMPLES = 8  # admissions in the window before the drain rate is trusted to refuse a request at once


class LaneConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    priority: int = Field(1, description="engine priority: lower is served first (and may preempt higher)")
    reserved: bool = Field(False, description="this lane holds the reserved share of the capacity")
    burst: bool = Field(True, description="may use the burst pool when the general part is full")
    sheddable: bool = Field(True, description="the SLO monitor's shed and degrade actions may apply to this lane")
    max_queue: int = Field(256, ge=0, description="requests waiting for admission in this lane; beyond: 429")
    max_queue_wait_s: float = Field(30.0, gt=0, description="deadline to be admitted; beyond: 429 + Retry-After")
    pace_itl_s: float | None = Field(None, gt=0, description="the inter-token budget: after the first token, tokens "
                                                             "held back leave one at a time at most this long after "
                                                             "the last chunk, whether or not more come")
    pace_reserve: int = Field(1, ge=0, le=64, description="with pace_itl_s: tokens of a burst held back to fill the "
                                                          "silence after it (one per budget), so that a bursty "
                                                          "engine's gaps stay within the budget; the rest of a burst "
                                                          "leaves at once")
    flush_every: int = Field(1, ge=1, description="send a chunk once this many tokens are pending")
    ttft_deadline_s: float | None = Field(None, gt=0, description="stall watch: the first token's deadline (unset: "
                                                                  "15 s over upstreams, none on the embedded engine; "
                                                                  "null: none)")
    itl_deadline_s: float | None = Field(None, gt=0, description="stall watch: the deadline between two tokens (unset: "
                                                                 "3 s over upstreams, none on the embedded engine; "
                                                                 "null: none)")
    ttft_target_s: float | None = Field(None, gt=0, description="the first token's target: a request whose "
                                                                "predicted time to first token (its wait so far plus "
                                                                "the embedded engine's prediction from its queue and "
                                                                "step times) misses it even allowing for the "
                                                                "prediction's spread is refused at once with 429 + "
                                                                "Retry-After instead of served late (null: none; "
                                                                "not over upstreams, whose queues are their own)")
    ttft_target_margin: float = Field(TTFT_PREDICTION_SPREAD, ge=1.0, description="with ttft_target_s: refuse when "
                                      "the predicted TTFT passes the target times this (the prediction's spread: "
                                      "1.3 refuses only the surely late, and lets served TTFT pass the target by up "
                                      "to as much; 1.0 refuses whatever is predicted late, some that would have made "
                                      "it included)")
    stall_misses: int = Field(3, ge=1, description="consecutive missed deadlines that switch to a degraded answer")
    keepalive_s: float | None = Field(None, gt=0, description="SSE comment every so often while the first token "
                                                              "is pending (keeps proxies from cutting long TTFTs; "
                                                              "unset: 5 s over upstreams; null: none)")
    degrade_text: str = Field("[the answer was cut short: the service is overloaded; please retry]",
                              description="appended to a stream that stalled, marked as degraded")
    stall_fallback: Literal["replica", "template"] = Field(
        "replica", description="after a stall behind upstreams: continue the answer on another replica (else, and "
                               "on the embedded engine, end it with degrade_text)")

    @property
    def watches(self) -> bool:
        return bool(self.ttft_deadline_s or self.itl_deadline_s or self.keepalive_s)

    def for_upstreams(self) -> LaneConfig:
        """This lane over upstream replicas: the stall watch's settings it leaves unset take the upstream defaults
        (one set explicitly, to null included, stays as it is)."""
        defaults = {"ttft_deadline_s": UPSTREAM_TTFT_DEADLINE_S, "itl_deadline_s": UPSTREAM_ITL_DEADLINE_S,
                    "keepalive_s": UPSTREAM_KEEPALIVE_S}
        unset = {k: v for k, v in defaults.items() if k not in self.model_fields_set}
        return self.model_copy(update=unset) if unset else self


def default_lanes() -> dict[str, LaneConfig]:
    return {
        "vip": LaneConfig(priority=0, reserved=True, sheddable=False, max_queue_wait_s=10.0),
        "standard": LaneConfig(priority=1),
        "batch": LaneConfig(priority=2, burst=False, max_queue=1024, max_queue_wait_s=120.0),
    }


class CapacityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_concurrent: int | None = Field(None, ge=1, description="sequences in flight at the backend; None: the "
                                                                "embedded engine's max_num_seqs, or 64 per replica")
    reserved_share: float = Field(0.2, ge=0, lt=1)
    burst_share: float = Field(0.05, ge=0, lt=1)
    drain_window_s: float = Field(10.0, gt=0, description="window of the drain rate behind Retry-After, and of "
                                                          "saturated time per sample of tokens_per_s: auto")
    tokens_per_s: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(
        None, description="the backend's token rate; with token_horizon_s it bounds the tokens of outstanding work; "
                          "auto: measured while work waits for the backend; None: off")
    token_horizon_s: float = Field(10.0, gt=0, description="seconds of work the backend may hold: the token budget "
                                                           "is tokens_per_s x token_horizon_s")
    lend_reserve: bool | None = Field(None, description="other lanes may borrow the reserve while its lane is idle; "
                                      "None: where the backend preempts for priority (the embedded engine, replicas "
                                      "that all have preempts: true), not over other upstreams")
    reserved_background_seqs: int | None = Field(
        0, ge=0, description="embedded engine: while a request of the reserved lane runs or waits, at most this many "
                             "sequences of other lanes take each step (the rest pause, their KV kept); a CPU step "
                             "costs in proportion to its batch, so this keeps VIP streams at an idle server's pace. "
                             "None: no pause; an explicit --max-background-seqs replaces it")
    upstream_queue_limit: float | None = Field(2.0, ge=0, description="upstream replicas: while the replicas that "
                                               "report a waiting queue hold more than this many per replica, only "
                                               "the reserved lane is admitted (others wait here); None: off")

    @property
    def token_budget(self) -> int | None:
        """The configured budget (None: off, or measured at run time with ``auto``)."""
        rate = self.tokens_per_s
        return None if rate is None or rate == "auto" else self.budget_for(rate)

    def budget_for(self, tokens_per_s: float) -> int:
        return max(1, int(tokens_per_s * self.token_horizon_s))


class Overloaded(Exception):
    """The request cannot be admitted in time: answer 429 with ``retry_after``."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = int(min(60, max(1, math.ceil(retry_after))))


@dataclass
class _Waiter:
    future: asyncio.Future
    tenant: str
    enqueued: float
    tokens: int = 0  # the estimated cost it will hold once admitted


@dataclass
class LaneState:
    name: str
    cfg: LaneConfig
    in_use: int = 0
    tokens: int = 0  # estimated tokens held by its admitted requests
    admitted: int = 0
    refused: int = 0
    # tenant -> its waiters, in arrival order; tenants in round-robin order (the next to serve first).
    queues: OrderedDict[str, deque[_Waiter]] = field(default_factory=OrderedDict)
    waiting: int = 0
    # The drain rate: (time, seconds) of each gap between admissions from the queue while requests waited (the
    # first from the moment the queue formed). Admissions of requests that never waited measure arrivals, not how
    # fast the lane drains, and idle time between busy spells is no gap.
    gaps: deque[tuple[float, float]] = field(default_factory=deque)
    busy_mark: float | None = None  # the last admission from the queue (or the queue's start) while some wait
    leases: list[str] = field(default_factory=list)  # fleet leases held by this lane's requests ("" = local slot)


class Lanes:
    """Admission by lane against a capacity (sequences, and tokens when configured) split into reserved, burst and
    general parts, gated by the upstream queue when a hook says it is too long."""

    def __init__(self, lanes: dict[str, LaneConfig], capacity: int, cfg: CapacityConfig | None = None,
                 fleet: RedisState | None = None, upstream_full: Callable[[int], bool] | None = None,
                 backend_preempts: bool = True) -> None:
        if not lanes:
            raise ValueError("at least one lane is needed")
        self.cfg = cfg or CapacityConfig()
        self.fleet = fleet  # None: this gateway's counts alone (the single-gateway path)
        # Asked with this gateway's admitted requests in flight (some perhaps not yet sent upstream); True: the
        # upstreams queue too much, only the reserve is admitted.
        self.upstream_full = upstream_full
        # The backend takes lent reserve back at once (preempts for priority): where lend_reserve is not configured,
        # the reserve is lent exactly then. The server updates it as replicas come and go.
        self.backend_preempts = backend_preempts
        self._pump: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._marked: set[str] = set()  # reserved lanes this gateway told the fleet it has waiters in
        self.lanes = {name: LaneState(name, lc) for name, lc in lanes.items()}
        self.order = sorted(self.lanes.values(), key=lambda s: s.cfg.priority)
        # tokens_per_s: auto. The clock times the waits, the drain rate and the meter (tests drive it).
        self.meter = TokenRateMeter(self.cfg.drain_window_s) if self.cfg.tokens_per_s == "auto" else None
        self.clock: Callable[[], float] = time.monotonic
        self.set_capacity(capacity)

    @property
    def lend_reserve(self) -> bool:
        """Other lanes may borrow the idle reserve: as configured, else where the backend preempts."""
        return self.backend_preempts if self.cfg.lend_reserve is None else self.cfg.lend_reserve

    def set_capacity(self, capacity: int) -> None:
        """Total sequences (called again when replicas come and go)."""
        self.capacity = max(1, capacity)
        has_reserved = any(s.cfg.reserved for s in self.lanes.values())
        self.reserved = max(1, round(self.capacity * self.cfg.reserved_share)) if has_reserved and \
            self.cfg.reserved_share > 0 and self.capacity > 1 else 0
        self.burst = round(self.capacity * self.cfg.burst_share)
        self.general = max(1, self.capacity - self.reserved - self.burst)
        self._split_tokens(has_reserved)
        if self.fleet is not None:
            from tailguard.policy.fleet_state import lane_rule

            self.rule = lane_rule(self.capacity, self.general, self.burst,
                                  self.reserved if self.lend_reserve else 0, self.lanes)
        self._dispatch()

    def _split_tokens(self, has_reserved: bool) -> None:
        """The token budget (configured, or measured) cut the way the sequences are."""
        budget = self.cfg.token_budget
        if self.meter is not None and self.meter.rate is not None:
            budget = self.cfg.budget_for(self.meter.rate)
        self.token_budget = budget
        self.reserved_tokens = self.burst_tokens = self.general_tokens = 0
        if budget is not None:
            self.reserved_tokens = round(budget * self.cfg.reserved_share) if has_reserved else 0
            self.burst_tokens = round(budget * self.cfg.burst_share)
            self.general_tokens = max(1, budget - self.reserved_tokens - self.burst_tokens)

    def saturated(self) -> bool:
        """Work waits for the backend: requests queue in a lane, or the upstreams queue past their limit."""
        return any(s.waiting for s in self.order) or self.gate_closed()

    def tick(self, finished_tokens: int = 0) -> None:
        """Feed the token-rate meter (``auto``): at each admission decision, release and sample. A closed window
        sets the new budget and admits whoever fits it."""
        if self.meter is None or not self.meter.observe(self.clock(), self.saturated(), finished_tokens):
            return
        self._split_tokens(any(s.cfg.reserved for s in self.lanes.values()))
        if any(s.waiting for s in self.order):
            self.poke()

    # --- the rule ---------------------------------------------------------------------------------------------------
    def _reserved_busy(self) -> bool:
        return any(s.in_use or s.waiting for s in self.lanes.values() if s.cfg.reserved)

    def _others_in_use(self) -> int:
        return sum(s.in_use for s in self.lanes.values() if not s.cfg.reserved)

    def _fits(self, lane: LaneState, tokens: int = 0) -> bool:
        """Room for one more request of ``lane`` costing ``tokens``: sequences, tokens and the upstream queue."""
        return self._fits_sequences(lane) and self._local_ok(lane, tokens)

    def _local_ok(self, lane: LaneState, tokens: int) -> bool:
        """What this gateway decides alone, also in a fleet: the token budget and the upstream queue gate."""
        return not self._gated(lane) and self._fits_tokens(lane, tokens)

    def _fits_sequences(self, lane: LaneState) -> bool:
        others = self._others_in_use()
        if lane.cfg.reserved:
            mine = sum(s.in_use for s in self.lanes.values() if s.cfg.reserved)
            # Others count only up to what they may hold without the reserve: what they borrowed is given back.
            return mine + min(others, self.general + self.burst) < self.capacity
        limit = self.general + (self.burst if lane.cfg.burst else 0)
        if self.lend_reserve and not self._reserved_busy():
            limit += self.reserved  # borrow the reserve while its owner is idle
        total = others + sum(s.in_use for s in self.lanes.values() if s.cfg.reserved)
        return others < limit and total < self.capacity

    def _fits_tokens(self, lane: LaneState, tokens: int) -> bool:
        """The sequences' rule over the token budget; a request bigger than its lane's share is admitted alone."""
        budget = self.token_budget
        if budget is None or tokens <= 0:
            return True
        mine = sum(s.tokens for s in self.lanes.values() if s.cfg.reserved)
        others = sum(s.tokens for s in self.lanes.values() if not s.cfg.reserved)
        if lane.cfg.reserved:
            return mine == 0 or mine + min(others, self.general_tokens + self.burst_tokens) + tokens <= budget
        limit = self.general_tokens + (self.burst_tokens if lane.cfg.burst else 0)
        if self.lend_reserve and not self._reserved_busy():
            limit += self.reserved_tokens
        if others + tokens <= limit and mine + others + tokens <= budget:
            return True
        # Alone: nothing else outside the reserve holds tokens, and the reserved lane keeps to its share.
        return others == 0 and mine <= self.reserved_tokens

    def gate_closed(self) -> bool:
        """The upstream queue gate holds the non-reserved lanes."""
        return self.upstream_full is not None and self.upstream_full(sum(s.in_use for s in self.lanes.values()))

    def _gated(self, lane: LaneState) -> bool:
        """The upstreams queue too much: nobody new but the reserved lane, up to its reserve (at least one)."""
        if not self.gate_closed():
            return False
        if not lane.cfg.reserved:
            return True
        return sum(s.in_use for s in self.lanes.values() if s.cfg.reserved) >= max(1, self.reserved)

    # --- admission --------------------------------------------------------------------------------------------------
    def lane(self, name: str) -> LaneState:
        try:
            return self.lanes[name]
        except KeyError:
            raise ValueError(f"unknown lane {name!r}; lanes are {', '.join(self.lanes)}") from None

    def drain_rate(self, lane: LaneState, now: float) -> float | None:
        """Admissions from the queue per second of the time requests waited, over the last ``drain_window_s``
        (the gap still open counts: a lane that has stopped draining slows its own estimate); None with fewer than
        ``MIN_DRAIN_SAMPLES`` such admissions."""
        cutoff = now - self.cfg.drain_window_s
        while lane.gaps and lane.gaps[0][0] < cutoff:
            lane.gaps.popleft()
        if len(lane.gaps) < MIN_DRAIN_SAMPLES:
            return None
        busy = sum(gap for _, gap in lane.gaps) + (now - lane.busy_mark if lane.busy_mark is not None else 0.0)
        return len(lane.gaps) / busy if busy > 0 else math.inf

    @staticmethod
    def _ahead(lane: LaneState, tenant: str) -> int:
        """Waiters admitted before a new arrival of ``tenant``: its own, then, in the round-robin over tenants, at
        most one more than its own from each other tenant (one tenant's flood is not ahead of another's request)."""
        own = len(lane.queues.get(tenant, ()))
        return own + sum(min(len(q), own + 1) for t, q in lane.queues.items() if t != tenant)

    def estimated_wait(self, lane: LaneState, now: float, tenant: str = "") -> float | None:
        """Seconds until a new arrival of ``tenant`` in ``lane`` is admitted at the recent drain rate (None: too
        little history to say)."""
        rate = self.drain_rate(lane, now)
        if rate is None:
            return None
        return (self._ahead(lane, tenant) + 1) / rate

    @staticmethod
    def _room_victim(lane: LaneState, tenant: str) -> _Waiter | None:
        """Who gives way when a full lane takes a request of ``tenant``: the newest waiter of the tenant holding the
        most waiters, when that is more than ``tenant``'s own plus one (the queue's bound is shared, its burden is
        not); None when ``tenant`` is the heaviest, or as heavy as any."""
        own = len(lane.queues.get(tenant, ()))
        q = max((q for t, q in lane.queues.items() if t != tenant), key=len, default=None)
        if q is None or len(q) <= own + 1:
            return None
        return next((w for w in reversed(q) if not w.future.done()), None)

    def _give_way(self, lane: LaneState, w: _Waiter, now: float) -> None:
        self._forget(lane, w)
        lane.refused += 1
        wait = self.estimated_wait(lane, now, w.tenant)
        w.future.set_exception(Overloaded(
            f"lane {lane.name!r} is full ({lane.cfg.max_queue} waiting) and most of its waiting requests are this "
            "caller's: the newest of them gives way to another caller's",
            wait if wait is not None else lane.cfg.max_queue_wait_s))

    async def acquire(self, name: str, tenant: str = "", now: float | None = None, tokens: int = 0) -> float:
        """Wait for a slot in lane ``name`` for a request of ``tokens`` estimated tokens (prompt + max_tokens; 0:
        sequences only); returns when admitted (the wait in seconds) or raises ``Overloaded``. The caller gives the
        slot back with ``release(name, tokens)``, the same ``tokens``."""
        lane = self.lane(name)
        now = self.clock() if now is None else now
        tokens = max(0, int(tokens))
        if self.fleet is None:
            if lane.waiting == 0 and self._fits(lane, tokens):
                self._admit(lane, now, tokens)
                return 0.0
        elif lane.waiting == 0 and self._local_ok(lane, tokens) and await self._fleet_take(lane, tokens):
            self._admit(lane, now, tokens)
            return 0.0
        victim = self._room_victim(lane, tenant) if lane.waiting >= lane.cfg.max_queue else None
        if lane.waiting >= lane.cfg.max_queue and victim is None:
            lane.refused += 1
            wait = self.estimated_wait(lane, now, tenant)
            raise Overloaded(f"lane {name!r} is full ({lane.cfg.max_queue} waiting)",
                             wait if wait is not None else lane.cfg.max_queue_wait_s)
        # (The victim's place is not ahead of this request: the round-robin takes at most own + 1 of its tenant's.)
        wait = self.estimated_wait(lane, now, tenant)
        if wait is not None and wait > lane.cfg.max_queue_wait_s and lane.in_use > 0:
            lane.refused += 1  # refused before it costs anything: it would miss its deadline anyway
            raise Overloaded(f"lane {name!r} would admit this request in about {wait:.1f} s, past its "
                             f"{lane.cfg.max_queue_wait_s:g} s deadline", wait)
        if victim is not None:  # only now that this request will take the place
            self._give_way(lane, victim, now)
        w = _Waiter(asyncio.get_running_loop().create_future(), tenant, now, tokens)
        if lane.waiting == 0:
            lane.busy_mark = now  # the queue forms: the first gap runs from here
        lane.queues.setdefault(tenant, deque()).append(w)
        lane.waiting += 1
        self.tick()  # saturated from now on
        if self.fleet is not None:
            self._kick()
        try:
            await asyncio.wait_for(asyncio.shield(w.future), lane.cfg.max_queue_wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if w.future.done() and not w.future.cancelled():
                self.release(name, tokens)  # admitted in the very moment it gave up: hand the slot back
            else:
                w.future.cancel()
                self._forget(lane, w)
            if isinstance(exc, TimeoutError):
                lane.refused += 1
                later = self.estimated_wait(lane, self.clock(), tenant)
                raise Overloaded(f"lane {name!r} did not admit this request within its "
                                 f"{lane.cfg.max_queue_wait_s:g} s deadline", later or lane.cfg.max_queue_wait_s) \
                    from None
            raise
        return self.clock() - now

    def release(self, name: str, tokens: int = 0) -> None:
        """Give back a slot of lane ``name`` and the ``tokens`` it was acquired with."""
        lane = self.lanes[name]
        lane.in_use = max(0, lane.in_use - 1)
        tokens = max(0, int(tokens))
        lane.tokens = max(0, lane.tokens - tokens)
        if self.fleet is None:
            self._dispatch()
            self.tick(tokens)
            return
        self.tick(tokens)
        lease = lane.leases.pop() if lane.leases else ""
        if lease:
            self.fleet.give_slot(name, lease, then=self._kick)  # the pump tries again once Redis has it back
        else:
            self._kick()

    # --- the fleet ----------------------------------------------------------------------------------------------------
    def poke(self) -> None:
        """Something outside the lanes changed (the upstream queue was read again): admit whoever fits now."""
        if not any(s.waiting for s in self.order):
            return
        if self.fleet is None:
            self._dispatch()
        else:
            self._kick()

    async def _fleet_take(self, lane: LaneState, tokens: int = 0) -> bool:
        """A slot for ``lane`` under the fleet's rule (its lease kept with the lane), or False. Redis unreachable:
        this gateway's own counts decide (fail open)."""
        from tailguard.policy.fleet_state import SharedUnavailable

        assert self.fleet is not None
        try:
            lease = await self.fleet.take_slot(lane.name, self.rule)
        except SharedUnavailable:
            if not self._fits(lane, tokens):
                return False
            lease = ""
        if lease is None:
            return False
        lane.leases.append(lease)
        return True

    def _kick(self) -> None:
        """Wake the pump (start it if it is not running)."""
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._pump_loop())

    async def _pump_loop(self) -> None:
        """Admit waiters as the fleet's budget allows, most important lane first, until nobody waits."""
        from tailguard.policy.fleet_state import SharedUnavailable

        assert self.fleet is not None and self._wake is not None
        while True:
            self._wake.clear()
            for lane in self.order:
                while lane.waiting:
                    w = self._peek(lane)
                    if w is None or not self._local_ok(lane, w.tokens) or not await self._fleet_take(lane, w.tokens):
                        break
                    if w.future.done():  # it gave up while Redis answered: hand the slot back, try the next
                        lease = lane.leases.pop()
                        if lease:
                            self.fleet.give_slot(lane.name, lease)
                        continue
                    now = self.clock()
                    self._take(lane, w, now)
                    self._admit(lane, now, w.tokens)
                    w.future.set_result(None)
            waiting_reserved = {s.name for s in self.order if s.cfg.reserved and s.waiting}
            for name in waiting_reserved | self._marked:
                with contextlib.suppress(SharedUnavailable):
                    await self.fleet.mark_waiting(name, name in waiting_reserved)
            self._marked = waiting_reserved
            if not any(s.waiting for s in self.order) and not self._marked:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), FLEET_POLL_S)

    def _admit(self, lane: LaneState, now: float, tokens: int = 0) -> None:
        lane.in_use += 1
        lane.tokens += tokens
        lane.admitted += 1

    def _forget(self, lane: LaneState, w: _Waiter) -> None:
        q = lane.queues.get(w.tenant)
        if q is not None and w in q:
            q.remove(w)
            lane.waiting -= 1
            if not q:
                del lane.queues[w.tenant]
            if not lane.waiting:
                lane.busy_mark = None  # nobody waits: the time until the next queue is no gap

    def _peek(self, lane: LaneState) -> _Waiter | None:
        """The next waiter of ``lane`` (round-robin over its tenants), left in its queue; waiters that gave up
        are dropped on the way."""
        while lane.queues:
            tenant, q = next(iter(lane.queues.items()))
            while q and q[0].future.done():
                q.popleft()
                lane.waiting -= 1
                if not lane.waiting:
                    lane.busy_mark = None
            if q:
                return q[0]
            del lane.queues[tenant]
        return None

    def _take(self, lane: LaneState, w: _Waiter, now: float) -> None:
        """Take ``w`` (the head ``_peek`` gave) out of its queue to admit it; its tenant goes to the back of the
        round. The gap since the last admission from the queue is a drain-rate sample."""
        if lane.busy_mark is not None:
            lane.gaps.append((now, max(0.0, now - lane.busy_mark)))
        q = lane.queues[w.tenant]
        q.remove(w)
        lane.waiting -= 1
        lane.busy_mark = now if lane.waiting else None
        if q:
            lane.queues.move_to_end(w.tenant)
        else:
            del lane.queues[w.tenant]

    def _dispatch(self) -> None:
        """Admit waiters while they fit, most important lane first."""
        if self.fleet is not None:
            return  # the fleet's pump admits (it must ask Redis, which takes an await)
        now = self.clock()
        for lane in self.order:
            while lane.waiting:
                w = self._peek(lane)  # the head waits for room: a large request is not overtaken by small ones
                if w is None or not self._fits(lane, w.tokens):
                    break
                self._take(lane, w, now)
                self._admit(lane, now, w.tokens)
                w.future.set_result(None)

    def waiting(self) -> int:
        return sum(s.waiting for s in self.order)

    def oldest_wait(self, now: float | None = None) -> float:
        """Seconds the longest-waiting request has waited for admission (0 while none waits)."""
        now = self.clock() if now is None else now
        oldest: float | None = None
        for lane in self.order:
            for q in lane.queues.values():
                head = next((w for w in q if not w.future.done()), None)  # one that gave up waits no more
                if head is not None and (oldest is None or head.enqueued < oldest):
                    oldest = head.enqueued
        return 0.0 if oldest is None else max(0.0, now - oldest)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {name: {"in_use": s.in_use, "tokens": s.tokens, "waiting": s.waiting, "admitted": s.admitted,
                       "refused": s.refused} for name, s in self.lanes.items()}
