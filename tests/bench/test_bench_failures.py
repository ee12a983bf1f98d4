"""Failure accounting: failed, cut-off and refused requests are SLO misses, and every percentile table counts them.

The scripted transport answers every request fast (well under every threshold) and fails every 20th one, in turn
with a 429, a stream cut halfway (no [DONE]) and a client timeout. A bench that dropped those requests would report a
server that fails 5% of its traffic as one that meets an E2E P99 objective.
"""

from __future__ import annotations

import asyncio
import io

import pytest
from rich.console import Console

from tailguard.bench.cli import print_summary
from tailguard.bench.fakeserver import FakeScript
from tailguard.bench.runner import execute, write_outputs
from tests.bench_helpers import ScriptedTransport, bench_config

N = 200
KINDS = ("429", "cut", "timeout")


def _fail(i: int) -> str | None:
    return KINDS[(i // 20) % 3] if i % 20 == 7 else None


FAILED = sum(1 for i in range(N) if _fail(i))  # 10: 5% of the run

PROFILE = """\
profiles:
  - name: tail
    objectives:
      - {metric: e2e, percentile: 99, threshold: 2s}
    request_bounds:
      - {metric: e2e, threshold: 2s}
  - name: median
    objectives:
      - {metric: e2e, percentile: 50, threshold: 450ms}
  - name: p95
    objectives:
      - {metric: e2e, percentile: 95, threshold: 2s}
"""


def _run(tmp_path, **kw):
    yml = tmp_path / "profiles.yaml"
    yml.write_text(PROFILE)
    tr = ScriptedTransport(FakeScript(), latency=lambda i: (0.010, 0.002), fail=_fail)
    cfg = bench_config(concurrency=4, num_requests=N, output_tokens=12, timeout=5.0, profiles=(str(yml),), **kw)
    return asyncio.run(execute(cfg, transport=tr, display=False))


def test_failed_requests_are_slo_misses_and_counted_beside_the_percentiles(tmp_path):
    res, ms = _run(tmp_path)
    s = res["summary"]
    assert s["requests"]["failed"] == FAILED == 10
    assert set(s["errors_by_kind"]) == {"HTTP 429", "stream ended without [DONE]", "timeout after 5 s"}
    # the percentiles stay success-only, and say how many requests they leave out
    e2e = res["metrics"]["e2e"]
    assert e2e["count"] == N - FAILED and e2e["excluded_failures"] == FAILED
    assert e2e["percentiles"]["p99"]["value"] < 0.05  # every completed request took ~32 ms
    for name in ("ttft", "itl", "tpot", "ttfb"):
        assert res["metrics"][name]["excluded_failures"] == FAILED
    assert s["percentile_failures"]["failed"] == FAILED and s["percentile_failures"]["policy"] == "success_only"
    # ...but the verdict counts them: 5% of requests missed, so the P99 objective fails, the P50 one does not
    tail, median = res["slo"]["tail"], res["slo"]["median"]
    check = tail["checks"][0]
    assert check["status"] == "fail" and check["failed_in_scope"] == FAILED and check["value_s"] is None
    assert tail["pass"] is False
    assert median["checks"][0]["status"] == "pass" and median["pass"] is True
    # P95 of 200 lies between the last completed request and the first failed one: a miss, with no made-up value
    p95 = res["slo"]["p95"]["checks"][0]
    assert p95["status"] == "fail" and p95["value_s"] is None and p95["headroom"] is None
    # goodput: a failed request is never good, and stays in the denominator
    assert tail["good_requests"] == N - FAILED and tail["failed_requests"] == FAILED
    assert tail["goodput_ratio"] == pytest.approx((N - FAILED) / N)


def test_a_run_where_every_request_fails_fails_its_objectives_rather_than_having_none(tmp_path):
    yml = tmp_path / "p.yaml"
    yml.write_text(PROFILE)
    tr = ScriptedTransport(FakeScript(), latency=lambda i: (0.010, 0.002), fail=lambda i: "429")
    cfg = bench_config(concurrency=2, num_requests=20, timeout=5.0, profiles=(str(yml),))
    res, _ = asyncio.run(execute(cfg, transport=tr, display=False))
    assert res["metrics"]["e2e"]["count"] == 0 and res["metrics"]["e2e"]["excluded_failures"] == 20
    for name in ("tail", "median", "p95"):
        assert res["slo"][name]["checks"][0]["status"] == "fail" and res["slo"][name]["pass"] is False


def test_failures_as_timeout_puts_them_in_the_tail_at_the_request_timeout(tmp_path):
    res, _ = _run(tmp_path, failures_as_timeout=True)
    for name in ("ttft", "e2e"):
        d = res["metrics"][name]
        assert d["count"] == N and d["excluded_failures"] == 0 and d["failures_at_timeout"] == FAILED
        # 10 of 200 at 5 s: P99 (rank 197 of 0..199) and P95 (rank 189.05) lie among them, P90 does not
        assert d["percentiles"]["p99"]["value"] == pytest.approx(5.0)
        assert d["percentiles"]["p90"]["value"] < 0.05
        assert d["max"] == pytest.approx(5.0)
    # ITL and TPOT have no value for a request that never finished: still success-only, and they say so
    assert res["metrics"]["itl"]["excluded_failures"] == FAILED
    assert res["summary"]["percentile_failures"]["policy"] == "failures_at_timeout"
    assert res["slo"]["tail"]["pass"] is False  # the verdict is the same either way


def test_every_percentile_table_shows_the_excluded_count(tmp_path):
    res, ms = _run(tmp_path)
    buf = io.StringIO()
    print_summary(res, Console(file=buf, width=200, highlight=False))
    out = buf.getvalue()
    assert "failed excl." in out
    assert f"{FAILED} failed, cut-off or refused requests are left out of every percentile" in out
    write_outputs(res, ms, tmp_path / "out")
    doc = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert "<th>failed excluded</th>" in doc and f"{FAILED} failed counted as misses" in doc
    assert f"{FAILED} failed, cut-off or refused requests are left out of every percentile" in doc
    assert res["by_language"]["en"]["failed_excluded"] == FAILED


class _SlowTransport(ScriptedTransport):
    """Each request takes 20 ms of real time (the scripted stream's own times stay virtual)."""

    async def post(self, url, body, headers, res, stream, chat) -> None:
        await asyncio.sleep(0.02)
        await super().post(url, body, headers, res, stream, chat)


def test_a_closed_loop_runs_its_whole_count_past_the_drain_timeout(tmp_path):
    """The drain timeout applies to the requests still in flight when the run stops sending, not to the run itself:
    a closed loop that lasted longer than it (by default the request timeout + 5 s) was cut short, its unsent
    requests never sent and its in-flight ones counted as failed."""
    tr = _SlowTransport(FakeScript(), latency=lambda i: (0.010, 0.002))
    cfg = bench_config(concurrency=2, num_requests=60, output_tokens=12, timeout=5.0, drain_timeout=0.2)
    res, _ = asyncio.run(execute(cfg, transport=tr, display=False))  # ~0.6 s of requests, 3x the drain timeout
    s = res["summary"]["requests"]
    assert s["failed"] == 0 and s["sent"] == 60, s
