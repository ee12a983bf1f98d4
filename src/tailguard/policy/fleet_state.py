"""State several gateways share: tenant rate limits and lane budgets, in-process or through Redis.

One interface, two implementations:

- :class:`LocalState` (the default): each gateway keeps its own buckets and counts, as a single gateway always did;
- :class:`RedisState` (``redis_url`` / ``--redis URL``): every gateway of a fleet takes from the same buckets and the
  same lane budgets, in Lua scripts that Redis runs atomically, on Redis's clock (``TIME``), so that N gateways
  together hold a tenant's limit and a lane's fleet-wide in-flight budget (the VIP reserve is a fleet reserve).

A lane slot taken through Redis is a *lease*: a member of the lane's sorted set scored by its expiry. The gateway
renews the leases it holds every ``lease_ttl_s / 3``; a gateway that dies stops renewing, and its slots come back to
the fleet when they expire.

Redis unreachable at run time: the gateway fails open to its in-process state (its own buckets, its own counts), with
one log line per outage and ``tailguard_fleet_fallbacks_total`` counting the decisions taken locally. Every call has
a bounded timeout, and after a failure Redis is left alone for ``retry_s`` so that requests do not each wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from tailguard.policy.tenants import RateLimited, Tenant

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("tailguard.fleet")
T = TypeVar("T")


class SharedUnavailable(Exception):
    """The shared store cannot be reached now: decide with the in-process state."""


@dataclass(frozen=True)
class LaneRule:
    """What the fleet-wide admission rule needs to know about the lanes (see ``tailguard.policy.lanes``)."""

    capacity: int
    general: int
    burst: int
    lendable: int  # what other lanes may borrow of the reserve while it is idle (0: the reserve is not lent)
    lanes: tuple[tuple[str, bool, bool], ...]  # (name, holds the reserve, may burst), every lane


class LocalState:
    """In-process: the tenant's own buckets; lanes decide with their own counts (``fleet`` is False)."""

    fleet = False
    gateway_id = "local"

    async def charge(self, tenant: Tenant, tokens: int) -> bool:
        """Take one request and ``tokens`` from the tenant's buckets or raise ``RateLimited``. Returns whether the
        charge went to the shared store (a refund must go to the same place)."""
        tenant.charge(tokens)
        return False

    def refund(self, tenant: Tenant, tokens: int, shared: bool) -> None:
        tenant.refund(tokens)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


# --- Lua: run by Redis as one atomic step --------------------------------------------------------------------------

# KEYS[1] the request bucket, KEYS[2] the token bucket (hashes: level, updated).
# ARGV: request rate, request capacity, token rate, token capacity, tokens wanted, key TTL in ms (rate 0: no bucket).
# Returns {0, "0"} when taken, else {1 or 2 (which bucket refused), seconds until it would fit}.
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, rate, cap)
  local v = redis.call('HMGET', key, 'level', 'updated')
  local lv, up = tonumber(v[1]), tonumber(v[2])
  if lv == nil or up == nil then return cap end
  return math.min(cap, lv + math.max(0, now - up) * rate)
end
local rr, rc, tr, tc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local amount, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local rl, tl
if rr > 0 then
  rl = level(KEYS[1], rr, rc)
  if rl < 1 then return {1, tostring((1 - rl) / rr)} end
end
if tr > 0 then
  amount = math.min(amount, tc)
  tl = level(KEYS[2], tr, tc)
  if tl < amount then return {2, tostring((amount - tl) / tr)} end
end
if rr > 0 then
  redis.call('HSET', KEYS[1], 'level', tostring(rl - 1), 'updated', tostring(now))
  redis.call('PEXPIRE', KEYS[1], ttl)
end
if tr > 0 then
  redis.call('HSET', KEYS[2], 'level', tostring(tl - amount), 'updated', tostring(now))
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return {0, '0'}
"""

# KEYS[1] a bucket; ARGV: rate, capacity, amount given back, key TTL in ms.
_REFUND = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, cap, amount = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 'level', 'updated')
local lv, up = tonumber(v[1]), tonumber(v[2])
if lv == nil or up == nil then return 0 end
lv = math.min(cap, lv + math.max(0, now - up) * rate + amount)
redis.call('HSET', KEYS[1], 'level', tostring(lv), 'updated', tostring(now))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
return 1
"""

# The lanes' admission rule (tailguard.policy.lanes.Lanes._fits) over the fleet's leases.
# KEYS: per lane, its lease set then its waiter set (reserved lanes: gateways with VIP requests waiting).
# ARGV: wanted lane's index (1-based), lease id, lease TTL ms, capacity, general, burst, lendable, then per lane
# "reserved burst" flags as two strings "0"/"1". Returns 1 (lease taken) or 0.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local want, lease, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local cap, general, burst, lendable = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local mine, others, busy = 0, 0, false
local want_res, want_burst = false, false
local n_lanes = #KEYS / 2
for i = 1, n_lanes do
  local is_res, can_burst = ARGV[6 + 2 * i] == '1', ARGV[7 + 2 * i] == '1'
  redis.call('ZREMRANGEBYSCORE', KEYS[2 * i - 1], '-inf', now)
  local n = redis.call('ZCARD', KEYS[2 * i - 1])
  if is_res then
    mine = mine + n
    if n > 0 then busy = true end
    redis.call('ZREMRANGEBYSCORE', KEYS[2 * i], '-inf', now)
    if redis.call('ZCARD', KEYS[2 * i]) > 0 then busy = true end
  else
    others = others + n
  end
  if i == want then want_res, want_burst = is_res, can_burst end
end
local fits
if want_res then
  fits = mine + math.min(others, general + burst) < cap
else
  local limit = general
  if want_burst then limit = limit + burst end
  if not busy then limit = limit + lendable end
  fits = others < limit and others + mine < cap
end
if not fits then return 0 end
redis.call('ZADD', KEYS[2 * want - 1], now + ttl, lease)
redis.call('PEXPIRE', KEYS[2 * want - 1], ttl * 4)
return 1
"""

# KEYS[1] a lane's lease (or waiter) set; ARGV: TTL ms, then members to push forward (only those still there).
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ttl * 4)
return 1
"""

# KEYS[1] a lane's waiter set; ARGV: gateway id, TTL ms (adds or refreshes this gateway's marker).
_MARK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 4)
return 1
"""


class RedisState:
    """Rate limits and lane budgets shared by every gateway that names the same Redis (and ``prefix``)."""

    fleet = True

    def __init__(self, url: str, *, prefix: str = "tailguard:", gateway_id: str | None = None,
                 timeout_s: float = 0.25, retry_s: float = 2.0, lease_ttl_s: float = 15.0,
                 registry: CollectorRegistry | None = None, client: Any = None) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.prefix = prefix
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.client = client or aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False)
        self._charge = self.client.register_script(_CHARGE)
        self._refund = self.client.register_script(_REFUND)
        self._take = self.client.register_script(_TAKE)
        self._renew = self.client.register_script(_RENEW)
        self._mark = self.client.register_script(_MARK)
        self.held: dict[str, set[str]] = {}  # lane -> the leases this gateway holds (renewed by the heartbeat)
        self._down_until = 0.0  # after a failure, Redis is not asked again before this (monotonic)
        self.down = False
        self.fallbacks = 0
        self._tasks: set[asyncio.Task] = set()
        self._heartbeat: asyncio.Task | None = None
        self._fallback_metric = None
        if registry is not None:
            from prometheus_client import Counter

            self._fallback_metric = Counter(
                "tailguard_fleet_fallbacks", "decisions taken with the in-process state because Redis was "
                "unreachable (fail open)", ["what"], registry=registry)

    # --- plumbing ------------------------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def _call(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis call within ``timeout_s``, or raise ``SharedUnavailable`` (and count the fallback)."""
        if self._down_until and time.monotonic() < self._down_until:
            self._fell_back(what)
            raise SharedUnavailable("Redis is unreachable")
        try:
            out = await asyncio.wait_for(make(), self.timeout_s * 2)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the shared store means: decide locally
            self._down_until = time.monotonic() + self.retry_s
            if not self.down:
                self.down = True
                log.warning("Redis at %s is unreachable (%s: %s): the gateway fails open to its in-process rate "
                            "limits and lane counts until it answers again", _safe_url(self.url), type(exc).__name__,
                            str(exc)[:200])
            self._fell_back(what)
            raise SharedUnavailable(str(exc)) from None
        if self.down:
            self.down = False
            self._down_until = 0.0
            log.warning("Redis at %s answers again: rate limits and lane budgets are shared again",
                        _safe_url(self.url))
        return out

    def _fell_back(self, what: str) -> None:
        self.fallbacks += 1
        if self._fallback_metric is not None:
            self._fallback_metric.labels(what).inc()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- tenants -------------------------------------------------------------------------------------------------
    def _bucket_args(self, tenant: Tenant) -> tuple[list[str], list[Any]]:
        r, t = tenant.requests, tenant.tokens
        keys = [self.key("rate", tenant.name, "requests"), self.key("rate", tenant.name, "tokens")]
        longest = max((b.capacity / b.rate for b in (r, t) if b is not None), default=1.0)
        ttl_ms = int(max(60.0, 4 * longest) * 1000)  # an idle bucket is full again by then: let it expire
        return keys, [r.rate if r else 0, r.capacity if r else 0, t.rate if t else 0, t.capacity if t else 0, ttl_ms]

    async def charge(self, tenant: Tenant, tokens: int) -> bool:
        if tenant.requests is None and tenant.tokens is None:
            return False
        keys, (rr, rc, tr, tc, ttl) = self._bucket_args(tenant)
        try:
            which, wait = await self._call("rate_limit", lambda: self._charge(
                keys=keys, args=[rr, rc, tr, tc, max(0, tokens), ttl]))
        except SharedUnavailable:
            tenant.charge(tokens)  # fail open: this gateway's own buckets
            return False
        which = int(which)
        if which == 0:
            return True
        wait_s = float(wait.decode() if isinstance(wait, bytes) else wait)
        if which == 1:
            raise RateLimited(f"tenant {tenant.name!r} is over its request rate ({rr:g} requests/s)", wait_s)
        raise RateLimited(f"tenant {tenant.name!r} is over its token rate ({tr:g} tokens/s)", wait_s)

    def refund(self, tenant: Tenant, tokens: int, shared: bool) -> None:
        """Give back output tokens never produced (in the background: this runs as a request ends)."""
        if tokens <= 0 or tenant.tokens is None:
            return
        if not shared:
            tenant.refund(tokens)
            return
        keys, (_, _, tr, tc, ttl) = self._bucket_args(tenant)

        async def give() -> None:
            # Unreachable: the shared bucket refills on its own; a lost refund only makes the limit stricter briefly.
            with contextlib.suppress(SharedUnavailable):
                await self._call("refund", lambda: self._refund(keys=[keys[1]], args=[tr, tc, tokens, ttl]))

        self._spawn(give())

    # --- lanes ---------------------------------------------------------------------------------------------------
    def _lane_keys(self, rule: LaneRule) -> list[str]:
        keys = []
        for name, _, _ in rule.lanes:
            keys += [self.key("lane", name, "leases"), self.key("lane", name, "waiting")]
        return keys

    async def take_slot(self, lane: str, rule: LaneRule) -> str | None:
        """A lease on one slot of ``lane`` (fleet-wide rule), None when the fleet has no room for it now, or
        ``SharedUnavailable``."""
        names = [n for n, _, _ in rule.lanes]
        want = names.index(lane) + 1
        lease = f"{self.gateway_id}:{uuid.uuid4().hex[:10]}"
        flags: list[str] = []
        for _, res, burst in rule.lanes:
            flags += ["1" if res else "0", "1" if burst else "0"]
        args: list[str | int] = [want, lease, self.lease_ttl_ms, rule.capacity, rule.general, rule.burst,
                                 rule.lendable, *flags]
        got = await self._call("lane", lambda: self._take(keys=self._lane_keys(rule), args=args))
        if int(got) != 1:
            return None
        self.held.setdefault(lane, set()).add(lease)
        self._ensure_heartbeat()
        return lease

    def give_slot(self, lane: str, lease: str, then: Callable[[], None] | None = None) -> None:
        """Hand a lease back (in the background); ``then`` runs once Redis has it (or gave up)."""
        self.held.get(lane, set()).discard(lease)

        async def give() -> None:
            try:
                await self._call("lane_release", lambda: self.client.zrem(self.key("lane", lane, "leases"), lease))
            except SharedUnavailable:
                pass  # the lease expires on its own
            finally:
                if then is not None:
                    then()

        self._spawn(give())

    async def mark_waiting(self, lane: str, waiting: bool) -> None:
        """Tell the fleet this gateway has requests of reserved lane ``lane`` waiting (the reserve is then busy)."""
        key = self.key("lane", lane, "waiting")
        ttl = min(self.lease_ttl_ms, 2000)
        if waiting:
            await self._call("lane", lambda: self._mark(keys=[key], args=[self.gateway_id, ttl]))
        else:
            await self._call("lane", lambda: self.client.zrem(key, self.gateway_id))

    async def fleet_in_use(self, lanes: list[str]) -> dict[str, int]:
        """Live leases per lane across the fleet (for tests, the dashboard and the benchmark)."""
        now_s, now_us = await self._call("read", lambda: self.client.time())
        now_ms = now_s * 1000 + now_us // 1000
        out = {}
        for name in lanes:
            def count(n: str = name) -> Awaitable[Any]:
                return self.client.zcount(self.key("lane", n, "leases"), now_ms, "+inf")

            out[name] = int(await self._call("read", count))
        return out

    def _ensure_heartbeat(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.ensure_future(self._renew_loop())

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_ms / 3000)
            for lane, leases in list(self.held.items()):
                if not leases:
                    continue
                members = list(leases)

                def renew(ln: str = lane, m: list[str] = members) -> Awaitable[Any]:
                    return self._renew(keys=[self.key("lane", ln, "leases")], args=[self.lease_ttl_ms, *m])

                try:
                    await self._call("lease_renew", renew)
                except SharedUnavailable:
                    break

    # --- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._call("ping", self.client.ping)
            log.info("fleet: gateway %s shares rate limits and lane budgets through Redis at %s", self.gateway_id,
                     _safe_url(self.url))
        except SharedUnavailable:
            pass  # logged; the gateway serves on its own state until Redis answers

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for lane, leases in list(self.held.items()):  # a clean stop gives its slots back at once
            if leases:
                members = list(leases)

                def release(ln: str = lane, m: list[str] = members) -> Awaitable[Any]:
                    return self.client.zrem(self.key("lane", ln, "leases"), *m)

                with contextlib.suppress(SharedUnavailable):
                    await self._call("lane_release", release)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.timeout_s * 4)
        with contextlib.suppress(Exception):  # closing a dead connection must not fail the shutdown
            await asyncio.wait_for(self.client.aclose(), self.timeout_s * 4)


SharedState = LocalState | RedisState


def _safe_url(url: str) -> str:
    """The URL without its password (for logs)."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def open_shared(url: str | None, registry: CollectorRegistry | None = None, **kw: Any) -> SharedState:
    return RedisState(url, registry=registry, **kw) if url else LocalState()


def lane_rule(capacity: int, general: int, burst: int, lendable: int,
              lanes: Mapping[str, Any]) -> LaneRule:
    return LaneRule(capacity, general, burst, lendable,
                    tuple((name, bool(s.cfg.reserved), bool(s.cfg.burst)) for name, s in lanes.items()))
