"""The bench's measurement path against a scripted stream: percentiles, ITL zero gaps, TPOT, multi-token chunks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tailguard.bench.client import RequestResult, SSEParser, parse_server_timing
from tailguard.bench.fakeserver import FakeScript
from tailguard.bench.metrics import request_metrics
from tailguard.bench.runner import execute
from tailguard.bench.stats import Bootstrap, describe, diff_test
from tailguard.bench.tokens import ApproxTokenizer

from .bench_helpers import ScriptedTransport, bench_config, scripted_truth

SCRIPT = FakeScript(ttft=0.030, itl=0.004, jitter=0.5, multi_token_every=5, multi_token_size=3, seed=7)


def _run(cfg, transport):
    return asyncio.run(execute(cfg, transport=transport, display=False))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_percentiles_match_the_script(endpoint):
    tr = ScriptedTransport(SCRIPT)
    cfg = bench_config(concurrency=4, num_requests=300, endpoint=endpoint, output_spread=0.5, bootstrap=100)
    res, ms = _run(cfg, tr)
    probe_ids = [k for k in tr.planned if k.startswith("probe")]
    assert len(probe_ids) == 1  # the probe is sent but not measured
    del tr.planned[probe_ids[0]]
    ttft, itl, _ = scripted_truth(tr)
    assert res["summary"]["requests"]["completed"] == 300
    for name, truth in (("ttft", ttft), ("itl", itl)):
        got = res["metrics"][name]
        assert got["count"] == truth.size
        for q in (50.0, 90.0, 95.0, 99.0, 99.9):
            reported = got["percentiles"][f"p{q:g}"]["value"]
            assert abs(reported - np.percentile(truth, q)) < 1e-3, (name, q)
            # and much closer than the 1 ms required: nothing but float rounding separates them
            assert abs(reported - np.percentile(truth, q)) < 1e-6, (name, q)
    # TPOT per request: (E2E - TTFT) / (n - 1), with E2E ending 0.1 ms after the last chunk
    for m in ms:
        t0, chunks, _ = tr.planned[m.request_id]
        n = sum(k for _, k in chunks)
        e2e = t0 + sum(g for g, _ in chunks) + 0.0001
        assert m.output_tokens == n
        assert m.tpot == pytest.approx((e2e - t0) / (n - 1), abs=1e-9)


def test_multi_token_chunks_are_detected_and_give_zero_gaps():
    tr = ScriptedTransport(SCRIPT)
    res, ms = _run(bench_config(concurrency=2, num_requests=40, output_tokens=12), tr)
    # 12 tokens, every 5th chunk carries 3: chunk sizes 1,1,1,1,3,1,1,1,1,1 (tokens 4+3+5 = 12)
    for m in ms:
        assert m.chunk_tokens == [1, 1, 1, 1, 3, 1, 1, 1, 1, 1]
        assert m.multi_token_chunks == 1
        assert len(m.itl) == 11 and sum(1 for g in m.itl if g == 0.0) == 2
    c = res["tokens"]["chunks"]
    assert c["multi_token"] == 40 and c["max_tokens_per_chunk"] == 3
    assert any("carried several tokens" in w for w in res["warnings"])


def test_chunk_token_counts_without_usage_come_from_a_recount():
    tok = ApproxTokenizer()
    res = RequestResult(0, "r", None, 0.0)
    p = SSEParser(res, chat=True)
    times = [0.010, 0.015, 0.015, 0.030]
    texts = [" alpha", " beta gamma", " delta", " epsilon zeta eta"]
    for t, x in zip(times, texts):
        p.feed(f'data: {{"choices":[{{"delta":{{"content":"{x}"}}}}]}}\n\n'.encode(), t)
    p.feed(b"data: [DONE]\n\n", 0.031)
    res.status, res.end = 200, 0.031
    m = request_metrics(res, 0.0, tok)
    assert m.output_tokens_source == "recount"
    assert m.chunk_tokens == [1, 2, 1, 3] and m.multi_token_chunks == 2 and m.output_tokens == 7
    # gaps between chunks (one of them zero: two chunks in one read) plus 1 + 2 zero gaps
    assert sorted(m.itl) == pytest.approx(sorted([0.005, 0.0, 0.015, 0.0, 0.0, 0.0]))
    assert m.ttft == pytest.approx(0.010) and m.e2e == pytest.approx(0.031)


def test_sse_parser_survives_events_split_across_reads_and_errors_in_stream():
    res = RequestResult(0, "r", None, 0.0)
    p = SSEParser(res, chat=False)
    raw = b'data: {"choices":[{"text":"hi"}]}\n\ndata: {"choices":[{"text":" there","finish_reason":"length"}]}\n\n'
    p.feed(raw[:10], 1.0)
    p.feed(raw[10:40], 2.0)  # completes the first event: it is stamped with this read's time
    p.feed(raw[40:], 3.0)
    assert res.chunk_times == [2.0, 3.0] and res.chunk_texts == ["hi", " there"]
    assert res.finish_reason == "length" and not p.done
    p.feed(b'data: {"error":{"message":"engine died"}}\n\n', 4.0)
    assert res.error == "engine died"


def test_server_timing_header_is_parsed_to_seconds():
    st = parse_server_timing("tokenize;dur=1.5, queue;dur=20, prefill;desc=x;dur=3, bad, total;dur=40")
    assert st == {"tokenize": 0.0015, "queue": 0.02, "prefill": 0.003, "total": 0.04}
    assert parse_server_timing(None) is None


def test_bootstrap_interval_covers_the_true_percentile_and_cluster_bootstrap_is_wider():
    rng = np.random.default_rng(1)
    v = rng.lognormal(0, 0.5, 4000)
    d = describe(v, reps=400, seed=2)
    lo, hi = d["percentiles"]["p99"]["ci"]
    assert lo < np.exp(0.5 * 2.326) < hi  # the lognormal's true P99
    # 100 requests of 40 perfectly correlated gaps: resampling gaps alone would be falsely narrow
    per_req = rng.lognormal(0, 0.5, 100)
    gaps = np.repeat(per_req, 40)
    owner = np.repeat(np.arange(100), 40)
    naive = Bootstrap(gaps, None, (50.0,), 300, 0).ci(50.0)
    clustered = Bootstrap(gaps, owner, (50.0,), 300, 0).ci(50.0)
    assert (clustered[1] - clustered[0]) > 3 * (naive[1] - naive[0])


def test_diff_test_sees_a_real_shift_and_not_a_null_one():
    rng = np.random.default_rng(3)
    a = rng.normal(0.100, 0.01, 600)
    same = diff_test(a, a.copy(), 50.0, reps=300)
    assert same["delta"] == 0 and not same["significant"]
    shifted = diff_test(a, a + 0.005, 50.0, reps=300)
    assert shifted["significant"] and shifted["ci"][0] > 0 and shifted["p_value"] < 0.05
