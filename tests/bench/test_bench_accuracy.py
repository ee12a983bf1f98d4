"""Where the bench's clock starts and where its own work goes, and whether the fake server keeps to its script.

A request's latency runs from its intended send time, so any bench work between that instant and the bytes leaving
is counted as the server's. The ordering checks here are exact (a counter of event-loop steps as the clock, or the
order in which bodies are built and requests reach the transport), not timings. The check over sockets compares
ratios measured in one run against the fake server's own send times, with wide margins: the cores are shared.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from tailguard.bench import loadgen
from tailguard.bench.client import Endpoint, RequestResult, _Transport
from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.bench.loadgen import LoadPlan, RequestOptions, run_load
from tailguard.bench.runner import execute
from tailguard.bench.tokens import ApproxTokenizer
from tailguard.bench.workloads import SyntheticWorkload
from tests.bench_helpers import bench_config


class _Steps:
    """A clock that advances once per event-loop step (a task bumps it whenever the loop runs it): two readings are
    equal only if nothing else ran between them."""

    def __init__(self) -> None:
        self.n = 0.0

    def __call__(self) -> float:
        return self.n

    async def run(self) -> None:
        while True:
            self.n += 1
            await asyncio.sleep(0)


class _Logged:
    """The synthetic workload, logging each body it builds."""

    name = "synthetic"

    def __init__(self, log: list) -> None:
        self.inner = SyntheticWorkload(ApproxTokenizer(), input_tokens=16, output_tokens=8)
        self.log = log

    def spec(self, i: int):
        self.log.append(("build", i))
        return self.inner.spec(i)


class _Recording(_Transport):
    """Logs when each request reaches the transport (on ``clock``) and answers after a short real wait."""

    name = "recording"

    def __init__(self, clock, log: list) -> None:
        self.clock = clock
        self.log = log

    async def start(self, max_connections: int, timeout: float) -> None:
        return None

    async def close(self) -> None:
        return None

    async def get_json(self, url, headers=None):
        return 404, None

    async def post(self, url, body, headers, res: RequestResult, stream, chat) -> None:
        res.sent = self.clock()
        self.log.append(("post", res.index))
        await asyncio.sleep(0.002)
        res.status, res.first_token_at, res.end = 200, self.clock(), self.clock()


def _load(transport, workload, plan: LoadPlan, clock: _Steps | None = None):
    async def main():
        ticker = asyncio.get_running_loop().create_task(clock.run()) if clock is not None else None
        try:
            return await run_load(transport, Endpoint("http://127.0.0.1:9"), workload, plan,
                                  RequestOptions(model="fake"), "acc")
        finally:
            if ticker is not None:
                ticker.cancel()

    return asyncio.run(main())


def test_closed_loop_sends_in_the_step_that_takes_its_intended_time(monkeypatch):
    # With the step counter as the load generator's clock, a request whose send started later than its intended
    # time (a task to schedule, a yield to other streams) would show sent > intended.
    clock = _Steps()
    monkeypatch.setattr(loadgen, "perf", clock)
    log: list = []
    out = _load(_Recording(clock, log), _Logged(log), LoadPlan(mode="closed", concurrency=8, num_requests=64), clock)
    assert len(out.results) == 64 and all(r.ok for r in out.results)
    assert all(r.sent == r.intended for r in out.results)
    # and each body is built right before its own send, not while another request is on its way out
    for k, (what, i) in enumerate(log):
        if what == "build":
            assert log[k + 1] == ("post", i), log[k : k + 2]


def test_open_loop_builds_the_next_body_after_the_last_request_left():
    # Request i is launched as a task; a body built before that task reaches the transport delays request i's
    # bytes, and counts as its latency. Every 20 ms a request: there is time to build later.
    log: list = []
    n = 40
    out = _load(_Recording(time.perf_counter, log), _Logged(log),
                LoadPlan(mode="open", offsets=np.arange(n) * 0.02, num_requests=n))
    assert len(out.results) == n
    early = [i for i in range(n - 1) if log.index(("build", i + 1)) < log.index(("post", i))]
    assert len(early) <= n // 10, early  # only where a stalled machine left no time before the next send


def test_fake_server_keeps_an_absolute_schedule_and_the_bench_reads_its_gaps():
    # No spin: every wait is a plain sleep, which overshoots. Slept gap by gap from the previous send, the overshoot
    # would add up along the answer (the last of 24 chunks late by 23 overshoots); against absolute deadlines it
    # does not. Ratios from one run, wide margins.
    script = FakeScript(ttft=0.03, itl=0.01, spin=0.0, max_lifetime=120)
    tokens = 24
    with FakeServerProcess(script) as srv:
        res, _ = asyncio.run(execute(bench_config(srv.url, concurrency=4, num_requests=24, output_tokens=tokens),
                                     display=False))
        recs = [r for r in srv.records() if r["stream"] and r["output_tokens"] == tokens]
    assert res["summary"]["requests"]["completed"] == 24 and len(recs) == 24
    first, last, gaps, per_request = [], [], [], []
    for r in recs:
        clk = r["_clock"]
        sent = np.asarray(clk["chunk_sent"])
        late = sent - (clk["received"] + script.ttft + script.itl * np.arange(sent.size))
        first.append(late[0])
        last.append(late[-1])
        gaps.extend(np.diff(sent))
        per_request.append(np.diff(sent).mean())
    assert np.median(last) - np.median(first) < 0.3 * script.itl
    assert abs(np.median(per_request) / script.itl - 1) < 0.05
    # the bench's ITL median is the server's gap median, and its TTFT is not below the server's
    itl = res["metrics"]["itl"]["percentiles"]["p50"]["value"]
    assert abs(itl / np.median(gaps) - 1) < 0.1
    srv_ttft = np.median([r["_clock"]["chunk_sent"][0] - r["_clock"]["received"] for r in recs])
    assert 0.98 < res["metrics"]["ttft"]["percentiles"]["p50"]["value"] / srv_ttft < 1.5
