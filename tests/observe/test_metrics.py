"""Prometheus metrics: vLLM-style names, SLO bucket edges, labels, parseable and promtool-clean exposition."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tailguard.observe.metrics import LATENCY_BUCKETS, SLO_THRESHOLDS, ServerMetrics, clean_label
from tailguard.observe.timeline import Outcome, Timeline


def _finished(bt: str = "default", outcome: Outcome = Outcome.SUCCESS, status: int = 200) -> Timeline:
    tl = Timeline(request_id="r", endpoint="/v1/chat/completions", received=10.0, business_type=bt, stream=True,
                  tokenized=10.001, scheduled=10.01, first_token=10.3, last_token=10.9,
                  token_times=[10.3, 10.6, 10.9], num_prompt_tokens=12, num_output_tokens=3, finish_reason="stop")
    tl.add_tokens_sent(1, 10.31)
    tl.add_tokens_sent(1, 10.61)
    tl.add_tokens_sent(1, 10.91)
    tl.finalize(status, outcome, at=10.92)
    return tl


def _families(m: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def test_buckets_have_an_edge_at_every_slo_threshold():
    for t in SLO_THRESHOLDS:
        assert t in LATENCY_BUCKETS
    for t in (0.08, 0.1, 0.12, 0.15):  # the output-pacing targets
        assert t in LATENCY_BUCKETS
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)


def test_observe_fills_histograms_with_labels():
    m = ServerMetrics("fake")
    m.observe(_finished("finance"))
    fams = _families(m)
    for name in ("tailguard_time_to_first_token_seconds", "tailguard_inter_token_latency_seconds",
                 "tailguard_request_time_per_output_token_seconds", "tailguard_e2e_request_latency_seconds",
                 "tailguard_request_queue_time_seconds", "tailguard_request_tokenize_time_seconds",
                 "tailguard_request_prefill_time_seconds", "tailguard_request_decode_time_seconds"):
        fam = fams[name]
        assert fam.type == "histogram"
        count = [s for s in fam.samples if s.name == name + "_count"]
        assert count and count[0].labels == {"model": "fake", "business_type": "finance"}
        assert count[0].value == (2 if "inter_token" in name else 1)
        edges = {float(s.labels["le"]) for s in fam.samples if s.name == name + "_bucket" and s.labels["le"] != "+Inf"}
        assert set(SLO_THRESHOLDS) <= edges
    ttft = fams["tailguard_time_to_first_token_seconds"]
    le_035 = [s for s in ttft.samples if s.name.endswith("_bucket") and s.labels["le"] == "0.35"][0]
    le_03 = [s for s in ttft.samples if s.name.endswith("_bucket") and s.labels["le"] == "0.3"][0]
    assert (le_03.value, le_035.value) == (0, 1)  # TTFT 0.31 s falls between the 0.3 and 0.35 edges
    total = [s for s in fams["tailguard_requests"].samples if s.name == "tailguard_requests_total"][0]
    assert total.labels["outcome"] == "success" and total.value == 1
    assert [s.value for s in fams["tailguard_generation_tokens"].samples if s.name.endswith("_total")] == [3]


def test_rejected_requests_are_counted_but_not_in_latency():
    m = ServerMetrics("fake")
    m.observe(_finished(outcome=Outcome.REJECTED, status=429))
    fams = _families(m)
    assert not [s for s in fams["tailguard_e2e_request_latency_seconds"].samples if s.name.endswith("_count")]
    total = [s for s in fams["tailguard_requests"].samples if s.name == "tailguard_requests_total"][0]
    assert (total.labels["outcome"], total.labels["status"], total.value) == ("rejected", "429", 1)


def test_business_type_cardinality_is_capped():
    m = ServerMetrics("fake", max_business_types=3)
    seen = {m.business_type(f"type{i}") for i in range(10)}
    assert seen == {"type0", "type1", "type2", "other"}
    assert m.business_type("type1") == "type1"
    assert clean_label('evil"label\n{x}') == "evil_label__x_"
    assert clean_label("x" * 100) == "x" * 32
    allow = ServerMetrics("fake", business_types=["vip", "finance"])
    assert allow.business_type("vip") == "vip" and allow.business_type("random") == "other"
    assert allow.business_type(None) == "default"


def test_gauges_sampled():
    m = ServerMetrics("fake")
    m.sample(running=3, waiting=2, kv_total=100, kv_used=25, preemptions=4, admission_queue=2, in_flight=5,
             admission_limit=512)
    m.sample(running=3, waiting=2, kv_total=100, kv_used=25, preemptions=6, admission_queue=2, in_flight=5,
             admission_limit=512)
    fams = _families(m)
    val = {f: fams[f].samples[0].value for f in ("tailguard_num_requests_running", "tailguard_num_requests_waiting",
                                                 "tailguard_kv_cache_blocks_used", "tailguard_kv_cache_blocks_free",
                                                 "tailguard_kv_cache_usage_ratio", "tailguard_server_queue_requests")}
    assert val == {"tailguard_num_requests_running": 3, "tailguard_num_requests_waiting": 2,
                   "tailguard_kv_cache_blocks_used": 25, "tailguard_kv_cache_blocks_free": 75,
                   "tailguard_kv_cache_usage_ratio": 0.25, "tailguard_server_queue_requests": 2}
    pre = [s for s in fams["tailguard_num_preemptions"].samples if s.name.endswith("_total")][0]
    assert pre.value == 6


def test_promtool_check_metrics():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    m = ServerMetrics("fake")
    m.observe(_finished("finance"))
    m.observe(_finished(outcome=Outcome.ABORTED, status=499))
    m.sample(1, 0, 10, 1, 0, 0, 1, 512)
    out = subprocess.run([promtool, "check", "metrics"], input=m.render(), capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()


def test_records_the_store_could_not_write_are_exported(tmp_path):
    from tailguard.observe.stores import open_store

    m = ServerMetrics("fake")
    store = open_store(tmp_path / "r.sqlite3", max_backlog=0,
                       on_drop=lambda n: m.store_dropped.labels(m.model).inc(n),
                       on_error=lambda n: m.store_errors.labels(m.model).inc(n))
    assert not store.put(_finished())  # backlog full
    store.close()
    assert not store.put(_finished())  # closed
    fams = _families(m)
    dropped = {s.name: s.value for s in fams["tailguard_store_dropped_records"].samples}
    assert dropped["tailguard_store_dropped_records_total"] == 2 == store.dropped
    assert "tailguard_store_failed_records" in fams


def test_observe_many_counts_as_observe_one_by_one():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from tailguard.observe.metrics import LATENCY_BUCKETS, observe_many

    values = [0.0, 0.001, 0.0010001, 0.2, 0.2, 0.19999, 7.5, 119.0, 500.0, -0.001] + [i / 97 for i in range(300)]
    text = []
    for batched in (False, True):
        reg = CollectorRegistry()
        child = Histogram("gap_seconds", "gaps", ["m"], buckets=LATENCY_BUCKETS, registry=reg).labels("x")
        if batched:
            observe_many(child, values)
        else:
            for v in values:
                child.observe(v)
        text.append(generate_latest(reg).decode())
    # Every bucket, count and sum alike (the creation time apart).
    strip = [[line for line in t.splitlines() if not line.startswith("#") and "_created" not in line] for t in text]
    assert strip[0] == strip[1] and any('le="0.2"' in line for line in strip[1])


def test_observe_many_falls_back_to_observe():
    from tailguard.observe.metrics import observe_many

    class Plain:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, v: float) -> None:
            self.seen.append(v)

    p = Plain()
    observe_many(p, [0.1, 0.2])
    assert p.seen == [0.1, 0.2]
