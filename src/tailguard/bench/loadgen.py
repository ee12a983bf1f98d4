"""The load generator: closed-loop concurrency or open-loop arrivals, measured from each request's intended send time.

Open loop: request *i* is meant to leave at ``t0 + offset[i]`` whatever happened to the others; its latencies are
measured from that instant, so if the bench or the server falls behind, the wait shows up in the numbers instead of
silently stretching the schedule (no coordinated omission). Closed loop: N workers, each sends its next request the
moment its previous one finished and its body is built; that instant is the intended send time, and the request
starts in the same event-loop step (no bench work between the two).

The bench watches itself: the lag between intended and actual send, the event loop's own lag and the process's CPU
use. When they show that the bench, not the server, set the pace, the run says so.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailguard.bench.client import Endpoint, RequestResult, send

perf = time.perf_counter


@dataclass
class LoadPlan:
    mode: str = "closed"  # "closed" (concurrency) or "open" (offsets)
    concurrency: int = 1
    offsets: np.ndarray | None = None  # open loop: intended send offsets (seconds from the start)
    num_requests: int | None = None
    duration: float | None = None
    warmup_requests: int = 0
    warmup_seconds: float = 0.0
    max_inflight: int = 10_000
    drain_timeout: float | None = None  # after the last send; None: the request timeout
    spin: float = 0.0005  # the last part of each wait before a send is spent polling the loop (sharper sends)

    def describe(self) -> dict:
        d: dict[str, Any] = {"mode": self.mode, "num_requests": self.num_requests, "duration_s": self.duration,
                             "warmup_requests": self.warmup_requests, "warmup_seconds": self.warmup_seconds,
                             "max_inflight": self.max_inflight}
        if self.mode == "closed":
            d["concurrency"] = self.concurrency
        return d


@dataclass
class RequestOptions:
    model: str
    stream: bool = True
    fixed_output: bool = True  # ask for exactly max_tokens: ignore_eos + min_tokens
    include_usage: bool = True
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: exact tokens per chunk
    temperature: float | None = 0.0
    extra_body: dict = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    business_type_header: str = "X-Business-Type"
    user_header: str = "X-User-ID"
    # traffic class -> the headers its requests carry on top of ``headers`` (its API key as a bearer token)
    class_headers: dict[str, dict[str, str]] = field(default_factory=dict)

    def body(self, spec, chat: bool) -> dict:
        b: dict[str, Any] = {"model": self.model, "max_tokens": spec.max_tokens, "stream": self.stream}
        if chat:
            b["messages"] = spec.messages if spec.messages is not None else [{"role": "user", "content": spec.prompt}]
        else:
            b["prompt"] = spec.prompt if spec.prompt is not None else spec.text()
        if self.stream and self.include_usage:
            so: dict[str, Any] = {"include_usage": True}
            if self.continuous_usage:
                so["continuous_usage_stats"] = True
            b["stream_options"] = so
        if self.fixed_output:
            b["ignore_eos"] = True
            b["min_tokens"] = spec.max_tokens
        if self.temperature is not None:
            b["temperature"] = self.temperature
        if spec.user:
            b["user"] = spec.user
        b.update(self.extra_body)
        return b

    def request_headers(self, spec, request_id: str) -> dict[str, str]:
        h = {"Content-Type": "application/json", "X-Request-ID": request_id, **self.headers}
        extra = self.class_headers.get(getattr(spec, "traffic_class", None)) if self.class_headers else None
        if extra:
            if any(k.lower() == "authorization" for k in extra):  # the class's key replaces the run's
                h = {k: v for k, v in h.items() if k.lower() != "authorization"}
            h.update(extra)
        if spec.business_type:
            h[self.business_type_header] = str(spec.business_type)
        if spec.user:
            h[self.user_header] = str(spec.user)
        return h


@dataclass
class LoadOutcome:
    results: list[RequestResult]
    t0: float  # perf_counter of offset 0
    started_unix: float
    finished: float  # perf_counter when the last request ended (or was cut)
    send_lag: np.ndarray
    loop_lag: np.ndarray
    cpu_seconds: float
    wall_seconds: float
    inflight_waits: int
    capabilities: dict = field(default_factory=dict)


class _Progress:
    """Counts what the progress display shows; updated from the loop, read by a periodic callback."""

    def __init__(self) -> None:
        self.sent = 0
        self.done = 0
        self.errors = 0
        self.recent_ttft: list[float] = []
        self.recent_e2e: list[float] = []

    def finished(self, res: RequestResult) -> None:
        self.done += 1
        if not res.ok:
            self.errors += 1
            return
        if res.first_token_at is not None:
            self.recent_ttft.append(res.first_token_at - res.intended)
        self.recent_e2e.append(res.end - res.intended)
        if len(self.recent_e2e) > 2000:
            del self.recent_e2e[:1000]
            del self.recent_ttft[:1000]


async def probe(transport, ep: Endpoint, opts: RequestOptions, spec) -> dict:
    """One unmeasured request that finds what the server accepts; relaxes the options it refuses.

    Fixed output lengths (``ignore_eos``/``min_tokens``) and ``stream_options`` are extensions that some servers
    refuse with 400/422; the probe drops them one by one and says which were dropped.
    """
    notes: list[str] = []
    caps = {"fixed_output": opts.fixed_output, "include_usage": opts.include_usage,
            "continuous_usage": opts.continuous_usage}
    for attempt in range(4):
        res = RequestResult(-1, f"probe-{attempt}-{int(time.time() * 1000) % 10**8}", spec, perf())
        body = json.dumps(opts.body(spec, ep.chat)).encode()
        await send(transport, ep, body, opts.request_headers(spec, res.request_id), res, opts.stream)
        if res.ok:
            caps["ok"] = True
            caps["server_request_id_header"] = res.server_request_id is not None
            caps["timeline_in_stream"] = res.tailguard is not None
            caps["server_timing_header"] = res.server_timing is not None
            caps["notes"] = notes
            return caps
        if res.status not in (400, 422):
            caps["ok"] = False
            caps["error"] = res.error
            caps["notes"] = notes
            return caps
        if opts.continuous_usage:
            opts.continuous_usage = caps["continuous_usage"] = False
            notes.append("the server refused stream_options.continuous_usage_stats: tokens per chunk are inferred")
        elif opts.fixed_output:
            opts.fixed_output = caps["fixed_output"] = False
            notes.append("the server refused ignore_eos/min_tokens: output lengths are not fixed, "
                         "they end where the model stops (max_tokens is only a cap)")
        elif opts.include_usage and opts.stream:
            opts.include_usage = caps["include_usage"] = False
            notes.append("the server refused stream_options.include_usage: token counts are local recounts")
        else:
            break
    caps["ok"] = False
    caps["error"] = res.error
    caps["notes"] = notes
    return caps


async def run_load(transport, ep: Endpoint, workload, plan: LoadPlan, opts: RequestOptions, run_id: str,
                   on_tick: Callable[[_Progress, float], None] | None = None,
                   capabilities: dict | None = None) -> LoadOutcome:
    loop = asyncio.get_running_loop()
    results: list[RequestResult] = []
    prog = _Progress()
    sem = asyncio.Semaphore(plan.max_inflight)
    inflight_waits = 0
    loop_lags: list[float] = []
    stop_monitor = asyncio.Event()
    chat = ep.chat

    def build(i: int) -> tuple[bytes, dict, Any, str]:
        spec = workload.spec(i)
        rid = f"{run_id}-{i:06d}"
        return json.dumps(opts.body(spec, chat)).encode(), opts.request_headers(spec, rid), spec, rid

    def is_warmup(i: int, offset: float) -> bool:
        return i < plan.warmup_requests or offset < plan.warmup_seconds

    async def monitor() -> None:
        period = 0.02
        while not stop_monitor.is_set():
            t = perf()
            await asyncio.sleep(period)
            loop_lags.append(max(0.0, perf() - t - period))

    async def ticker() -> None:
        while not stop_monitor.is_set():
            await asyncio.sleep(0.25)
            if on_tick is not None:
                on_tick(prog, perf() - t0)

    async def one(res: RequestResult, body: bytes, headers: dict) -> None:
        try:
            await send(transport, ep, body, headers, res, opts.stream)
        finally:
            prog.finished(res)
            sem.release()

    mon = loop.create_task(monitor())
    tick = loop.create_task(ticker())
    # The event loop's own thread: a saturated loop is what makes the bench the bottleneck, and process time would
    # also count a server or engine running in this process (the demo, tests).
    cpu0 = time.thread_time()
    started_unix = time.time()
    t0 = perf() + 0.01
    tasks: list[asyncio.Task] = []
    sending_over: asyncio.Event | None = None  # a closed loop's: set once its workers send no more

    if plan.mode == "open":
        offsets = plan.offsets if plan.offsets is not None else np.zeros(0)
        n = len(offsets) if plan.num_requests is None else min(plan.num_requests, len(offsets))
        spin = plan.spin
        build_cost = 0.0  # a running estimate of one build's time
        for i in range(n):
            off = float(offsets[i])
            if plan.duration is not None and off >= plan.duration:
                break
            target = t0 + off
            # Build each body shortly before its send time, not right after the previous send: work queued behind
            # a request that was just launched holds its bytes back (its task has not started yet, and aiohttp
            # writes the body from a task of its own on Python < 3.12), and that wait counts as its latency (about
            # 1 ms for a long-context prompt). The lead leaves room for the build and the spin before the send.
            delay = target - (spin + 2 * build_cost + 0.001) - perf()
            if delay > 0:
                await asyncio.sleep(delay)
            b0 = perf()
            body, headers, spec, rid = build(i)
            build_cost = 0.8 * build_cost + 0.2 * (perf() - b0) if i else perf() - b0
            delay = target - perf()
            if delay > spin:
                await asyncio.sleep(delay - spin)
            while perf() < target:
                await asyncio.sleep(0)
            if sem.locked():
                inflight_waits += 1
            await sem.acquire()
            res = RequestResult(i, rid, spec, target, is_warmup(i, off))
            results.append(res)
            prog.sent += 1
            tasks.append(loop.create_task(one(res, body, headers)))
    else:
        counter = 0
        limit = plan.num_requests
        sending_over = asyncio.Event()
        deadline = t0 + plan.duration if plan.duration is not None else None

        async def worker() -> None:
            try:
                await send_until_done()
            finally:
                sending_over.set()  # the run's end: its drain timeout counts from here, not from the start

        async def send_until_done() -> None:
            nonlocal counter
            while True:
                if limit is not None and counter >= limit:
                    return
                i = counter
                counter += 1
                # The body is built before the intended send time is taken, and the request then starts in this
                # same loop step: no task to schedule and no yield in between. When several streams end at once
                # (a closed loop keeps them in step), every hop between the intended time and the send queued this
                # request behind the others' work, about 0.5 ms of TTFT at 8 streams; and building the next body
                # while this one was in flight ran before aiohttp's body writer (a task of its own on Python < 3.12),
                # holding the request back by the build time (about 1 ms for a long-context prompt).
                body, headers, spec, rid = build(i)
                intended = perf()
                if deadline is not None and intended >= deadline:
                    return
                res = RequestResult(i, rid, spec, intended, is_warmup(i, intended - t0))
                results.append(res)
                prog.sent += 1
                await sem.acquire()
                await one(res, body, headers)
                # Let the other streams run before this one builds its next request (a transport that answers
                # without waiting must not starve them); nothing is being timed here.
                await asyncio.sleep(0)

        while perf() < t0:
            await asyncio.sleep(0)
        tasks = [loop.create_task(worker()) for _ in range(plan.concurrency)]

    if tasks:
        if sending_over is not None:  # closed loop: the workers send until the count or the duration is reached
            await sending_over.wait()
        drain = plan.drain_timeout if plan.drain_timeout is not None else ep.timeout + 5
        done, pending = await asyncio.wait(tasks, timeout=drain)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    finished = perf()
    for res in results:  # requests cut by the drain timeout
        if res.end is None and res.error is None:
            res.error = "cancelled at the end of the run (drain timeout)"
    cpu = time.thread_time() - cpu0
    stop_monitor.set()
    await asyncio.gather(mon, tick, return_exceptions=True)
    if on_tick is not None:
        on_tick(prog, perf() - t0)
    lags = np.array([r.sent - r.intended for r in results if r.sent is not None], dtype=float)
    results.sort(key=lambda r: r.index)
    return LoadOutcome(results=results, t0=t0, started_unix=started_unix, finished=finished, send_lag=lags,
                       loop_lag=np.array(loop_lags, dtype=float), cpu_seconds=cpu, wall_seconds=finished - t0,
                       inflight_waits=inflight_waits, capabilities=dict(capabilities or {}))
