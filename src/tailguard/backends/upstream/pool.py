"""Upstream replicas (vLLM, SGLang, llama.cpp's server, another tailguard): health, circuit breakers and routing.

Routing picks, among the replicas that are healthy and whose breaker lets traffic through, the one with the least
outstanding tokens by the power of two choices (two at random, the lighter wins: near-best balance without herding on
one replica). With prefix affinity a request with a session key or a long shared prefix goes to the replica chosen by
rendezvous hashing on that key, so that the replica's prefix cache is reused, unless that replica is much busier than
the rest (bounded load). Where an upstream exposes vLLM-style ``/metrics``, its waiting queue is counted in its load
and feeds the lanes' admission (``queue_full``, the upstream queue gate of ``tailguard.policy.lanes``).

The scraped queue is read at each health check, and every ``queue_scrape_s`` while a replica's queue is (or is
estimated) non-zero. Between two reads it is kept current from what the gateway itself sees: a replica that queues is
full, so each request the gateway sends it since the read joins its queue and each one that finishes lets one waiting
request in; a replica that did not queue, but once showed how many sequences it runs when full (its running gauge
while it queued), queues whatever the gateway sends beyond its free slots (``Replica.queue_estimate``).

Every replica whose ``/metrics`` has gauges we know is also read every ``engine_scrape_s`` (0.5 s), busy or not: its
engine's running and waiting requests and its KV-cache use (``engine_gauges``), which ``/admin/upstreams`` and the
gateway's ``/metrics`` show and, with ``routing.load: engine``, the picker weighs (``Replica.engine_load``). A replica
whose KV cache is at least ``kv_full_ratio`` full counts as full for the queue gate (vLLM preempts there).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import itertools
import logging
import math
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tailguard.backends.upstream.http1 import ConnectionPool
from tailguard.backends.upstream.quarantine import Quarantine

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger("tailguard.gateway")

# The engine gauges we know, per engine: (waiting, running, KV-cache use 0-1). vLLM (0.32 calls its KV gauge
# kv_cache_usage_perc, older versions gpu_cache_usage_perc; both 0-1), SGLang (token_usage: KV tokens in use over its
# pool), llama.cpp's server started with --metrics (requests deferred for want of a free slot, those in its slots,
# kv_cache_usage_ratio where the build still has it) and tailguard's own.
ENGINE_GAUGES: dict[str, tuple[tuple[bytes, ...], tuple[bytes, ...], tuple[bytes, ...]]] = {
    "vllm": ((b"vllm:num_requests_waiting",), (b"vllm:num_requests_running",),
             (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")),
    "sglang": ((b"sglang:num_queue_reqs",), (b"sglang:num_running_reqs",), (b"sglang:token_usage",)),
    "llamacpp": ((b"llamacpp:requests_deferred",), (b"llamacpp:requests_processing",),
                 (b"llamacpp:kv_cache_usage_ratio",)),
    "tailguard": ((b"tailguard_num_requests_waiting",), (b"tailguard_num_requests_running",),
                  (b"tailguard_kv_cache_usage_ratio",)),
}
_ANY_ENGINE = tuple(tuple(n for e in ENGINE_GAUGES.values() for n in e[i]) for i in range(3))


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """What an upstream's /metrics says of its engine; None where it has no gauge we know."""

    waiting: float | None = None  # summed over its label sets (data-parallel engines)
    running: float | None = None  # summed likewise
    kv_usage: float | None = None  # 0-1, the fullest of its label sets (where preemption starts first)

    @property
    def known(self) -> bool:
        return self.waiting is not None or self.running is not None or self.kv_usage is not None


def _samples(text: bytes, names: tuple[bytes, ...]) -> list[float]:
    """The values of the samples of ``names`` (any labels) in a Prometheus text. The names are found with
    ``bytes.find`` rather than parsed: on a real vLLM 0.32 /metrics (51 KB, tests/backends/engine_metrics/vllm.txt)
    one engine's four names take 51 us, a regex over every line 224 us and prometheus_client's
    ``text_string_to_metric_families`` 6,800 us, on the gateway's event loop twice a second per replica."""
    out: list[float] = []
    for name in names:
        key = b"\n" + name
        i = text.find(key)
        while i >= 0:
            j = i + len(key)
            nxt = text[j:j + 1]
            if nxt in (b"{", b" ", b"\t"):  # this name, not a longer one (vllm:num_requests_waiting_by_reason)
                end = text.find(b"\n", j)
                line = text[j:end] if end >= 0 else text[j:]
                if nxt == b"{":
                    line = line[line.rfind(b"}") + 1:]
                parts = line.split()
                try:
                    v = float(parts[0]) if parts else math.nan
                except ValueError:
                    v = math.nan
                if math.isfinite(v):
                    out.append(v)
            i = text.find(key, j)
    return out


def engine_gauges(metrics_text: bytes, kind: str | None = None) -> EngineGauges:
    """The engine gauges in an upstream's /metrics: those of engine ``kind`` (``HEALTH_PATHS``' names), or of any
    engine we know when the kind is not one of them."""
    names = ENGINE_GAUGES.get(kind or "", _ANY_ENGINE)
    text = b"\n" + metrics_text  # a sample on the first line is found like the others
    waiting, running, kv = (_samples(text, n) for n in names)
    return EngineGauges(sum(waiting) if waiting else None, sum(running) if running else None,
                        min(1.0, max(0.0, max(kv))) if kv else None)


def queue_gauges(metrics_text: bytes, kind: str | None = None) -> tuple[float | None, float | None]:
    """(waiting, running) summed over an upstream's /metrics samples; None where it has no gauge we know (running
    counts only beside a waiting gauge: without a queue figure the pair means nothing to the gate)."""
    g = engine_gauges(metrics_text, kind)
    if g.waiting is None:
        return None, None
    return g.waiting, g.running


# Where each engine kind says whether it can serve (not merely whether its HTTP server is up: a replica whose engine
# died still lists its models). tailguard: /ready (503 while loading or after its engine died); vLLM: /health (500
# once its engine died); SGLang: /health (503 when unhealthy); llama.cpp's server: /health (503 while the model
# loads). "openai", any other OpenAI-compatible server: its model list, the only endpoint they all share.
HEALTH_PATHS = {"tailguard": "/ready", "vllm": "/health", "sglang": "/health", "llamacpp": "/health",
                "openai": "/v1/models"}


def engine_kind(models: Any) -> str:
    """The engine behind a /v1/models answer: the ``owned_by`` each engine writes (tailguard, vllm, sglang, llamacpp),
    else "openai"."""
    data = models.get("data") if isinstance(models, dict) else None
    for m in data if isinstance(data, list) else ():
        owner = m.get("owned_by") if isinstance(m, dict) else None
        if owner in HEALTH_PATHS:
            return owner
    return "openai"


def without_credentials(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return scheme + sep + host.rpartition("@")[2] + slash + path


class UpstreamConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    name: str | None = None
    model: str | None = Field(None, description="the model name to send upstream; None: the first of its /v1/models")
    api_key: SecretStr | None = None
    max_concurrent: int = Field(64, ge=1, description="this replica's share of the gateway's capacity")
    send_priority: bool = Field(False, description="send the lane's priority in the body (vLLM started with "
                                                   "--scheduling-policy priority accepts it; others may refuse it)")
    preempts: bool = Field(False, description="the replica starts a higher-priority arrival at once, preempting "
                                              "lower-priority work when its sequence slots are full (another "
                                              "tailguard serve). vLLM schedules by priority but preempts only when "
                                              "its KV cache runs out: a VIP arrival waits for a free slot there. "
                                              "Needs send_priority")
    kind: str = Field("auto", pattern="^(auto|tailguard|vllm|sglang|llamacpp|openai)$",
                      description="the engine, which says where its health is read (tailguard: /ready; vllm, "
                                  "sglang, llamacpp: /health; openai: /v1/models); auto: told by the owned_by of "
                                  "its /v1/models")
    request_id: str = Field("uuid", pattern="^(uuid|same|off)$",
                            description="X-Request-ID sent upstream: a UUID derived from the gateway's request id "
                                        "(llama-cpp-python's server refuses ids that are not UUIDs), the same id, "
                                        "or none")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = v.rstrip("/")
        # Shown without its credentials: a mistyped scheme must not print the password it carries.
        shown = without_credentials(v) if "://" in v else v.rpartition("@")[2]
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https:// (got {shown!r})")
        if "?" in v or "#" in v:
            raise ValueError(f"an upstream url is a base URL, without a query or a fragment (got {shown!r})")
        return v.removesuffix("/v1")

    @model_validator(mode="after")
    def _preempts_needs_priority(self) -> UpstreamConfig:
        if self.preempts and not self.send_priority:
            raise ValueError("preempts: true needs send_priority: true (the replica preempts by the priority it is "
                             "sent)")
        return self


class RoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: str = Field("least_tokens", pattern="^(least_tokens|prefix)$")
    load: str = Field("tokens", pattern="^(tokens|engine)$",
                      description="what a replica's load is when routing weighs it. tokens: the gateway's own "
                                  "outstanding tokens there plus its engine's waiting queue, two replicas at random "
                                  "and the lighter wins; engine: what its engine reports (/metrics, read every "
                                  "engine_scrape_s and kept current from the gateway's own traffic in between), "
                                  "waiting + running / slots + kv_weight x KV use squared, a replica whose KV "
                                  "cache is kv_full_ratio full last; the least loaded wins")
    prefix_chars: int = Field(512, ge=16, description="prompt characters hashed for prefix affinity")
    affinity_slack: float = Field(1.5, ge=1, description="affinity holds while the replica's load <= slack x mean")
    retries: int = Field(2, ge=0, description="other replicas tried when one fails before the first token")
    health_interval_s: float = Field(2.0, gt=0)
    queue_scrape_s: float = Field(0.25, gt=0, description="while a replica's waiting queue is (or is estimated) "
                                                          "non-zero, its /metrics is read this often (between "
                                                          "health checks)")
    engine_scrape_s: float | None = Field(0.5, gt=0, description="every replica whose /metrics has engine gauges "
                                                                  "we know is read this often, busy or not "
                                                                  "(running, waiting, KV use); null: at health "
                                                                  "checks (and while it queues) only")
    kv_full_ratio: float | None = Field(0.95, gt=0, le=1, description="a replica whose KV cache is this full counts "
                                                                       "as full: the queue gate counts it over its "
                                                                       "limit, and load: engine routes there last "
                                                                       "(vLLM preempts running requests when its KV "
                                                                       "cache runs out); null: off")
    kv_weight: float = Field(2.0, ge=0, description="load: engine: the load a replica's KV use adds, times its "
                                                    "square (2.0: a cache 70% full weighs as one waiting request)")
    connect_timeout_s: float = Field(5.0, gt=0)
    keepalive_s: float = Field(4.0, gt=0, description="an idle upstream connection is closed after this long, before "
                                                      "the upstream's own keep-alive timeout (uvicorn's: 5 s) can "
                                                      "close it under a request")
    spare_connections: int = Field(2, ge=0, description="idle connections kept open per replica ahead of need, so "
                                                         "that a request does not wait for a connect")
    spare_ratio: float = Field(0.1, ge=0, description="... plus this share of the replica's connections in use")
    breaker_failures: int = Field(3, ge=1, description="consecutive failures that open a replica's breaker")
    breaker_cooldown_s: float = Field(10.0, gt=0, description="open breaker: time before one trial request")
    failure_retries: int = Field(1, ge=0, description="retries of a request under which a replica failed (a 5xx "
                                                      "other than 503, the connection cut after it was sent): it "
                                                      "may be what crashed it. Within retries")
    quarantine_after: int = Field(2, ge=0, description="failures of replicas under the same request (by a hash of "
                                                       "its body) after which the gateway refuses it itself for "
                                                       "quarantine_s (422); 0: off")
    quarantine_s: float = Field(300.0, gt=0, description="how long such a request is refused, and how long a "
                                                         "failure under a request is remembered")
    allow_link_local: bool = Field(False, description="POST /admin/upstreams may add a replica at a link-local or "
                                                      "cloud metadata address (169.254.0.0/16, fe80::/10, "
                                                      "metadata.google.internal, ...); refused otherwise")


class CircuitBreaker:
    """Closed -> (N consecutive failures) -> open -> (cooldown) -> half-open: one trial -> closed or open again."""

    def __init__(self, failures: int, cooldown_s: float) -> None:
        self.limit = failures
        self.cooldown = cooldown_s
        self.failures = 0
        self.opened_at: float | None = None
        self.trial = False
        self.opened_total = 0

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if time.monotonic() - self.opened_at >= self.cooldown else "open"

    def allows(self) -> bool:
        st = self.state
        return st == "closed" or (st == "half_open" and not self.trial)

    def begin(self) -> None:
        if self.state == "half_open":
            self.trial = True

    def probe(self) -> None:
        """The replica passes its health check again: an open breaker lets its one trial through now, not after the
        cooldown. The trial, not the health check, closes it (a replica may pass its check and fail every request)."""
        if self.opened_at is not None and self.state == "open":
            self.opened_at = time.monotonic() - self.cooldown

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.trial = False

    def failure(self) -> None:
        self.failures += 1
        self.trial = False
        if self.opened_at is not None or self.failures >= self.limit:
            if self.opened_at is None:
                self.opened_total += 1
            self.opened_at = time.monotonic()


@dataclass
class Replica:
    cfg: UpstreamConfig
    breaker: CircuitBreaker
    conns: ConnectionPool  # the streams' connections (health checks and scrapes use aiohttp's)
    name: str = ""
    model: str | None = None
    healthy: bool = True  # optimistic until the first check says otherwise
    draining: bool = False  # scale-in: no new requests; those in flight finish before it leaves the pool
    kind: str | None = None  # the engine (``HEALTH_PATHS``): configured, or told by its /v1/models
    in_flight: int = 0
    outstanding_tokens: int = 0
    upstream_waiting: float = 0.0  # from its /metrics, when it has them
    reports_queue: bool = False  # its /metrics has a queue gauge we know
    in_flight_at_scrape: int = 0  # the gateway's requests in flight there when upstream_waiting was read
    upstream_running: float | None = None  # its running sequences, from its /metrics, when it has them
    slots: float | None = None  # sequences it runs at once, learned: its running count when it last queued
    slots_reported: bool = False  # ``slots`` is what it says it has (llama.cpp's /slots), not learned
    kv_usage: float | None = None  # its KV cache's use (0-1), from its /metrics, when it has them
    has_metrics: bool | None = None  # its /metrics has engine gauges we know (None: not read yet)
    scraped_at: float | None = None  # monotonic time of the last read of its /metrics
    requests: int = 0
    errors: int = 0
    last_error: str | None = None
    ttft_ewma: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.cfg.url

    @property
    def shown_url(self) -> str:
        """The url without credentials (http://user:pass@host): what names, metrics, traces and the API show."""
        return without_credentials(self.cfg.url)

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining and self.breaker.allows()

    @property
    def busy(self) -> int:
        """Requests at this replica now: attempts in flight, plus any written ahead that no attempt has taken up
        yet (``ConnectionPool.send_now``) and answers whose end is still being read. Drained when 0."""
        return max(self.in_flight, self.conns.in_use)

    def queue_estimate(self) -> float:
        """Its waiting queue now: the last read, plus the requests sent there since, less those finished since
        (while it queues it is full: a new one waits, a finished one lets a waiting one in). A replica that did
        not queue at the last read queues what is sent beyond its free slots, once it has shown how many it runs
        (so a burst between two reads is seen at once)."""
        sent = self.in_flight - self.in_flight_at_scrape
        if self.upstream_waiting > 0:
            return max(0.0, self.upstream_waiting + sent)
        if self.slots is not None and self.upstream_running is not None:
            return max(0.0, self.upstream_running + sent - self.slots)
        return 0.0

    def free_slots(self) -> float | None:
        """Slots it has free now by the same reckoning (None: it has not shown how many it runs)."""
        if self.slots is None or self.upstream_running is None:
            return None
        sent = self.in_flight - self.in_flight_at_scrape
        return max(0.0, self.slots - self.upstream_running - self.upstream_waiting - sent)

    def load(self, tokens_per_waiting: int = 256) -> float:
        return self.outstanding_tokens + self.upstream_waiting * tokens_per_waiting

    def kv_full(self, ratio: float | None) -> bool:
        return ratio is not None and self.kv_usage is not None and self.kv_usage >= ratio

    def engine_load(self, kv_weight: float = 2.0, kv_full_ratio: float | None = 0.95) -> float:
        """Its load as its engine reports it, kept current between reads from the gateway's own traffic: requests
        waiting (each one a whole request's wait), plus the share of its slots running (its reported or learned
        slots, else ``max_concurrent``), plus ``kv_weight`` x its KV use squared; a KV cache ``kv_full_ratio``
        full adds ``KV_FULL_LOAD``, so that it is chosen only when every replica is as full. Without engine
        gauges: the gateway's own requests there against its ``max_concurrent``."""
        slots = max(1.0, self.slots or float(self.cfg.max_concurrent))
        sent = self.in_flight - self.in_flight_at_scrape
        if self.upstream_running is None and not self.reports_queue:
            total, wait = float(self.in_flight), max(0.0, self.in_flight - slots)
        else:
            total = max(0.0, (self.upstream_running or 0.0) + self.upstream_waiting + sent)
            # A replica that queued is full: what is sent since joins its queue; otherwise beyond its free slots.
            wait = max(0.0, self.upstream_waiting + sent) if self.upstream_waiting > 0 else max(0.0, total - slots)
        score = min(wait, total) + (total - min(wait, total)) / slots
        if self.kv_usage is not None:
            score += kv_weight * self.kv_usage ** 2
            if self.kv_full(kv_full_ratio):
                score += KV_FULL_LOAD
        return score

    def headers(self) -> dict[str, str]:
        if self.cfg.api_key is None:
            return {}
        return {"Authorization": f"Bearer {self.cfg.api_key.get_secret_value()}"}


KV_FULL_LOAD = 1000.0  # what a full KV cache adds to ``engine_load``: more than any queue a replica may hold


def _why_not(r: Replica) -> str:
    if not r.healthy:
        return "unhealthy"
    return "draining" if r.draining else "breaker " + r.breaker.state


class NoReplica(Exception):
    pass


class UpstreamForbidden(ValueError):
    """A replica added at run time names an address the gateway must not reach (link-local, cloud metadata)."""


# Cloud metadata services: credentials a gateway must never be made to fetch for whoever can call the admin API.
_METADATA_NAMES = frozenset({"metadata.google.internal", "metadata.goog"})
_METADATA_IPS = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))


def _address_problem(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip in _METADATA_IPS:
        return "a cloud metadata address"
    if ip.is_link_local:  # 169.254.0.0/16, fe80::/10
        return "a link-local address"
    return None


async def forbidden_address(url: str) -> str | None:
    """Why ``url``'s host must not be a replica (a link-local or cloud metadata address, by name, literal or what its
    name resolves to), or None. A name that does not resolve is let through: its health check will fail."""
    host = (urlsplit(url).hostname or "").rstrip(".").lower()
    if host in _METADATA_NAMES:
        return f"{host} is a cloud metadata service"
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        pass  # a name: what it resolves to decides (which also catches 2852039166 and other spellings of an address)
    else:
        why = _address_problem(literal)
        return None if why is None else f"{literal} is {why}"
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for info in infos:
        try:
            ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        except ValueError:
            continue
        why = _address_problem(ip)
        if why is not None:
            return f"{host} resolves to {ip}, {why}"
    return None


class UpstreamPool:
    def __init__(self, upstreams: list[UpstreamConfig], routing: RoutingConfig | None = None,
                 rng: random.Random | None = None) -> None:
        if not upstreams:
            raise ValueError("at least one upstream is needed")
        self.routing = routing or RoutingConfig()
        self.replicas: list[Replica] = []
        for u in upstreams:
            self._new(u)
        self.rng = rng or random.Random()
        rt = self.routing
        self.quarantine = Quarantine(rt.quarantine_after, rt.quarantine_s)
        self.session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task | None = None
        self._queue_watch: asyncio.Task | None = None
        self._conn_sweep: asyncio.Task | None = None
        self.on_queue: Callable[[], None] | None = None  # called after each read of a replica's queue (Lanes.poke)

    def _new(self, u: UpstreamConfig) -> Replica:
        name = u.name or without_credentials(u.url).split("://", 1)[1]
        taken = {r.name for r in self.replicas}
        if name in taken:
            # A suffix a URL path can carry (``DELETE /admin/upstreams/{name}``: a "#" would be cut off as a fragment),
            # and one no replica has (after removals, a count could name a replica that is still there).
            name = next(f"{name}-{k}" for k in itertools.count(2) if f"{name}-{k}" not in taken)
        rt = self.routing
        rep = Replica(u, CircuitBreaker(rt.breaker_failures, rt.breaker_cooldown_s),
                      ConnectionPool(u.url, rt.connect_timeout_s, rt.keepalive_s, rt.spare_connections, rt.spare_ratio),
                      name=name, model=u.model, kind=None if u.kind == "auto" else u.kind)
        self.replicas.append(rep)
        return rep

    async def add(self, u: UpstreamConfig) -> Replica:
        """A new replica (scale-out): health-checked before it takes traffic."""
        if any(r.url == u.url for r in self.replicas):
            raise ValueError(f"{without_credentials(u.url)} is already a replica")
        if not self.routing.allow_link_local:
            why = await forbidden_address(u.url)
            if why is not None:
                raise UpstreamForbidden(f"{without_credentials(u.url)} is refused: {why} (routing.allow_link_local "
                                        f"allows it)")
        rep = self._new(u)
        rep.healthy = False
        if self.session is not None:
            await self.check(rep)
        return rep

    async def drain(self, name: str, timeout_s: float, poll_s: float = 0.05) -> tuple[int, int]:
        """Scale-in, first step: route nothing new to replica ``name`` and wait, up to ``timeout_s``, until the
        requests at it have finished. Returns (requests at it when the drain began, requests left: 0 unless the
        timeout cut the wait short). The replica stays in the pool (``remove`` takes it out)."""
        r = next((x for x in self.replicas if x.name == name), None)
        if r is None:
            raise KeyError(name)
        r.draining = True
        began = r.busy
        deadline = time.monotonic() + timeout_s
        while r.busy > 0 and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return began, r.busy

    def remove(self, name: str) -> Replica:
        """Take a replica out of routing (scale-in); its requests in flight finish."""
        for i, r in enumerate(self.replicas):
            if r.name == name:
                if len(self.replicas) == 1:
                    raise ValueError("the last replica cannot be removed")
                r.conns.close()  # its idle connections; those of its requests in flight close as they end
                return self.replicas.pop(i)
        raise KeyError(name)

    def describe(self) -> list[dict]:
        now = time.monotonic()
        rt = self.routing
        return [{"name": r.name, "url": r.shown_url, "model": r.model, "kind": r.kind, "healthy": r.healthy,
                 "draining": r.draining, "breaker": r.breaker.state,
                 "in_flight": r.in_flight, "outstanding_tokens": r.outstanding_tokens,
                 "upstream_waiting": r.upstream_waiting, "max_concurrent": r.cfg.max_concurrent,
                 # What its engine said at the last read of its /metrics (None: no such gauge), how long ago, and
                 # the load routing gives it now (``routing.load``).
                 "upstream_running": r.upstream_running, "kv_cache_usage": r.kv_usage,
                 "kv_full": r.kv_full(rt.kv_full_ratio), "slots": r.slots,
                 "metrics_age_s": None if r.scraped_at is None else round(now - r.scraped_at, 3),
                 "load": round(self.load_of(r), 4),
                 "requests": r.requests, "errors": r.errors, "last_error": r.last_error} for r in self.replicas]

    # --- lifecycle --------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        import aiohttp  # only a gateway needs it: a server of its own engine does not import it

        # No connection cap (the lanes bound the streams); idle connections are dropped after 4 s, before uvicorn's
        # 5 s keep-alive (vLLM's, tailguard's) closes them under a request that reuses one (a 502 before the first
        # token). aiohttp's default keeps them 15 s.
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True, keepalive_timeout=4.0)
        self.session = aiohttp.ClientSession(connector=conn, trust_env=False, auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None,
                                                                           sock_connect=self.routing.connect_timeout_s))
        await self.check_all()
        self._health = asyncio.create_task(self._health_loop())
        self._queue_watch = asyncio.create_task(self._queue_loop())
        self._conn_sweep = asyncio.create_task(self._sweep_loop())

    async def close(self) -> None:
        for task in (self._health, self._queue_watch, self._conn_sweep):
            if task is not None:
                task.cancel()
        for r in self.replicas:
            r.conns.close()
        if self.session is not None:
            await self.session.close()

    async def _sweep_loop(self) -> None:
        """Renew the replicas' spare connections often enough that one is always fresh (a lull must not leave the
        next request only connections past their keep-alive)."""
        while True:
            await asyncio.sleep(self.routing.keepalive_s / 4)
            for r in self.replicas:
                if r.available:
                    r.conns.sweep()

    @property
    def capacity(self) -> int:
        return sum(r.cfg.max_concurrent for r in self.replicas if r.available) or 1

    # --- health -----------------------------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.routing.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - a failed round must not end health checking
                log.exception("upstream health check")

    async def _queue_loop(self) -> None:
        """Read the replicas' /metrics between health checks: every ``engine_scrape_s`` where it has engine gauges,
        and every ``queue_scrape_s`` while it queues (or its KV cache is full), so that the gate reopens sooner."""
        import aiohttp

        rt = self.routing
        timeout = aiohttp.ClientTimeout(total=max(1.0, rt.health_interval_s))
        every = rt.engine_scrape_s
        tick = min(rt.queue_scrape_s, every) if every is not None else rt.queue_scrape_s
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            due = [r for r in self.replicas if r.available and (
                r.upstream_waiting > 0 or r.queue_estimate() > 0 or r.kv_full(rt.kv_full_ratio)
                or (every is not None and r.has_metrics
                    and (r.scraped_at is None or now - r.scraped_at >= every - tick / 2)))]
            if not due:
                continue
            try:
                await asyncio.gather(*(self._scrape(r, timeout) for r in due))
            except Exception:  # noqa: BLE001 - a failed read must not end the watch
                log.exception("upstream queue read")

    def queue_full(self, per_replica: float, admitted: int = 0) -> bool:
        """The replicas that report a queue hold more than ``per_replica`` waiting requests each, together.

        ``admitted``: the requests the gateway has admitted and not yet released. Those not yet sent to a replica
        (a burst admitted in one moment) will queue beyond the replicas' free slots, when every available replica
        has shown how many it runs."""
        avail = [r for r in self.replicas if r.available]
        reps = [r for r in avail if r.reports_queue]
        if not reps:
            return False
        # A replica whose KV cache is full is full whatever its queue says: it counts as just over the limit (a
        # request sent there waits, or makes it preempt), and has no free slot.
        kv_full = self.routing.kv_full_ratio
        queued = sum(max(r.queue_estimate(), per_replica + 1) if r.kv_full(kv_full) else r.queue_estimate()
                     for r in reps)
        unsent = admitted - sum(r.in_flight for r in self.replicas)
        if unsent > 0:
            free = [0.0 if r.kv_full(kv_full) else f for r in avail if (f := r.free_slots()) is not None]
            if len(free) == len(avail):  # every replica says how many slots it has free
                queued += max(0.0, unsent - sum(free))
        return queued > per_replica * len(reps)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def check(self, r: Replica) -> None:
        import aiohttp

        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.routing.health_interval_s))
        was = r.healthy
        try:
            listed = False
            ok = True
            if r.kind is None or r.model is None:  # its model list, until it has told its engine and model
                ok = await self._read_models(r, timeout)
                listed = True
            path = HEALTH_PATHS.get(r.kind or "openai", "/v1/models")
            if ok and not (listed and path == "/v1/models"):
                async with self.session.get(r.url + path, headers=r.headers(), timeout=timeout) as resp:
                    ok = resp.status == 200
                    if not ok:
                        r.last_error = f"health check: {path} answered {resp.status}"
            if ok:
                if r.kind == "llamacpp" and (not r.slots_reported or r.has_metrics is False):
                    await self._read_slots(r, timeout)
                await self._scrape(r, timeout)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            ok = False
            r.last_error = f"health check: {type(exc).__name__}: {exc}"[:300]
        r.healthy = ok
        if ok and not was:
            # Back after a failed check: its trial now, not after the cooldown. A replica that passed its checks all
            # along and failed its requests keeps its breaker open for the cooldown.
            r.breaker.probe()
        if was != ok:
            log.warning("upstream %s is %s", r.name, "healthy" if ok else f"unhealthy ({r.last_error})")

    async def _read_models(self, r: Replica, timeout: Any) -> bool:
        """Its /v1/models: the model to send (unless configured) and, with ``kind: auto``, its engine. False when it
        does not answer 200."""
        assert self.session is not None
        async with self.session.get(r.url + "/v1/models", headers=r.headers(), timeout=timeout) as resp:
            if resp.status != 200:
                r.last_error = f"health check: /v1/models answered {resp.status}"
                return False
            data = await resp.json(content_type=None)
        models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)] \
            if isinstance(data, dict) and isinstance(data.get("data"), list) else []
        if not models:
            # A server still loading lists no model yet (tailguard does so): neither healthy nor known by its
            # owner, or it would be judged by /v1/models alone and sent requests it answers 503.
            r.last_error = "health check: /v1/models lists no model yet"
            return False
        if r.model is None:
            r.model = models[0]
        if r.kind is None:
            r.kind = engine_kind(data)
            log.info("upstream %s is %s: health read from %s", r.name, r.kind, HEALTH_PATHS[r.kind])
        return True

    async def _read_slots(self, r: Replica, timeout: Any) -> None:
        """llama.cpp's server lists its slots at /slots (unless started with --no-slots): how many sequences it runs
        at once, known before it ever queues, and, where it has no /metrics (started without --metrics), how many
        are busy."""
        import aiohttp

        assert self.session is not None
        try:
            async with self.session.get(r.url + "/slots", headers=r.headers(), timeout=timeout) as resp:
                if resp.status != 200:
                    return
                slots = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        if not isinstance(slots, list) or not slots:
            return
        r.slots, r.slots_reported = float(len(slots)), True
        if r.has_metrics is False:
            r.upstream_running = float(sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing")))
            r.in_flight_at_scrape = r.in_flight

    async def _scrape(self, r: Replica, timeout: Any) -> None:
        import aiohttp

        assert self.session is not None
        try:
            async with self.session.get(r.url + "/metrics", headers=r.headers(), timeout=timeout) as resp:
                # No /metrics (llama.cpp's server without --metrics: 501; a plain OpenAI server: 404): nothing known
                # of its engine but what /slots may say.
                body = await resp.read() if resp.status == 200 else b""
        except (aiohttp.ClientError, TimeoutError):
            return
        g = engine_gauges(body, r.kind)
        r.has_metrics = g.known
        if g.known:
            r.scraped_at = time.monotonic()
        if g.running is not None or not r.slots_reported:  # else: llama.cpp's /slots said how many are busy
            r.upstream_running = g.running
        r.kv_usage = g.kv_usage
        r.upstream_waiting = g.waiting or 0.0
        r.reports_queue = g.waiting is not None
        # Its slots: what it runs while it queues (it is full), or more when it runs more without a queue.
        run = r.upstream_running
        if run is not None and r.reports_queue and not r.slots_reported and \
                (r.upstream_waiting > 0 or (r.slots is not None and run > r.slots)):
            r.slots = run
        r.in_flight_at_scrape = r.in_flight
        if self.on_queue is not None:
            try:
                self.on_queue()
            except Exception:  # noqa: BLE001 - admission's hook must not fail a health check
                log.exception("upstream queue hook")

    # --- routing ----------------------------------------------------------------------------------------------------
    def pick(self, affinity_key: str | None = None, exclude: set[str] | None = None) -> Replica:
        pool = [r for r in self.replicas if r.available and (not exclude or r.name not in exclude)]
        if not pool:
            down = "; ".join(f"{r.name}: {_why_not(r)}" for r in self.replicas)
            raise NoReplica(f"no upstream replica is available ({down})")
        if len(pool) == 1:
            return pool[0]
        rt = self.routing
        engine = rt.load == "engine"
        if affinity_key is not None and rt.policy == "prefix":
            best = max(pool, key=lambda r: hashlib.blake2b(f"{r.name}\0{affinity_key}".encode(),
                                                           digest_size=8).digest())
            loads = [self.load_of(r) for r in pool]
            mean = sum(loads) / len(loads)
            # The slack above the mean: 256 tokens, or half a replica's slots of engine load.
            if self.load_of(best) <= rt.affinity_slack * mean + (0.5 if engine else 256) \
                    and not (engine and best.kv_full(rt.kv_full_ratio)):
                return best
        if engine:
            # The least loaded of all: the load moves with each request sent (``engine_load``), so a burst between
            # two reads spreads instead of herding; ties go to the fewer outstanding tokens, then at random.
            return min(pool, key=lambda r: (self.load_of(r), r.outstanding_tokens, self.rng.random()))
        a, b = self.rng.sample(pool, 2)
        return a if a.load() <= b.load() else b

    def load_of(self, r: Replica) -> float:
        """A replica's load as ``routing.load`` weighs it."""
        rt = self.routing
        return r.engine_load(rt.kv_weight, rt.kv_full_ratio) if rt.load == "engine" else r.load()

    def affinity_key(self, session: str | None, prompt: str) -> str | None:
        if self.routing.policy != "prefix":
            return None
        if session:
            return "s:" + session
        return "p:" + prompt[: self.routing.prefix_chars] if prompt else None
