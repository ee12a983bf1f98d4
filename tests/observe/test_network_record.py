"""The client network section of a request's record (serving/network.py fills it): on the timeline's record, through
the store (SQLite and PostgreSQL) as a record extra, and in the metrics by region, with the region label capped."""

from __future__ import annotations

import contextlib
import re
import time

import pytest

from tailguard.observe.metrics import ServerMetrics
from tailguard.observe.stores import open_store
from tailguard.observe.timeline import Outcome, Timeline
from tests.pg_cluster import shared_cluster

NETWORK = {"rtt_ms": {"first": 12.5, "mean": 14.0, "max": 20.25, "last": 15.0, "min": 11.0},
           "rttvar_ms": {"max": 4.0, "last": 2.0}, "retransmits": 3, "segments_out": 120, "max_unacked": 7,
           "max_lost": 1, "max_notsent_bytes": 20_000, "max_write_buffer_bytes": 70_000,
           "max_backlog_bytes": 90_000, "cwnd": {"min": 10, "last": 14}, "paused_samples": 1, "paused_writes": 2,
           "samples": 9, "span_s": 0.8}


def _tl(rid: str, region: str = "eu-west", network: dict | None = NETWORK,
        outcome: Outcome = Outcome.SUCCESS) -> Timeline:
    tl = Timeline(request_id=rid, endpoint="/v1/chat/completions", received=10.0, received_unix=time.time(),
                  tokenized=10.001, scheduled=10.002, first_token=10.01, last_token=10.02,
                  token_times=[10.01, 10.02], num_output_tokens=2, finish_reason="length", region=region)
    tl.network = network
    tl.finalize(200 if outcome is Outcome.SUCCESS else 499, outcome, at=10.03)
    return tl


def test_the_record_carries_the_network_section():
    rec = _tl("a").to_record()
    assert rec["network"] == NETWORK and rec["region"] == "eu-west"
    assert "network" not in _tl("b", network=None).to_record()  # off Linux, or sampling off: no section


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    with contextlib.ExitStack() as stack:
        target = (stack.enter_context(shared_cluster().database()) if request.param == "postgresql"
                  else str(tmp_path / "r.sqlite3"))
        s = open_store(target)
        yield s
        s.close(deadline_s=5)


def test_the_store_keeps_the_network_section(store):
    assert store.put(_tl("with")) and store.put(_tl("without", network=None))
    assert store.flush(10)
    got = store.get("with")
    assert got["network"] == NETWORK and got["region"] == "eu-west"
    assert store.get("without")["network"] is None


def _series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(name + r'\{model="m",region="([^"]+)"\} ([\d.e+]+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_by_region():
    m = ServerMetrics("m")
    m.observe(_tl("1", "eu-west"))
    m.observe(_tl("2", "eu-west"))
    m.observe(_tl("3", "us-east", outcome=Outcome.ABORTED))  # the connection counts whatever the answer's outcome
    m.observe(_tl("4", "ap", network=None))  # no figures: no series
    text = m.render().decode()
    assert _series(text, "tailguard_client_rtt_seconds_count") == {"eu-west": 2, "us-east": 1}
    assert _series(text, "tailguard_client_rtt_seconds_sum")["eu-west"] == pytest.approx(0.030)  # rtt_ms.last
    assert _series(text, "tailguard_client_retransmits_total") == {"eu-west": 6, "us-east": 3}
    assert _series(text, "tailguard_client_send_backlog_bytes_sum") == {"eu-west": 180_000, "us-east": 90_000}
    assert 'tailguard_client_rtt_seconds_bucket{le="0.02",model="m",region="eu-west"} 2.0' in text
    assert 'tailguard_client_send_backlog_bytes_bucket{le="65536.0",model="m",region="eu-west"} 0.0' in text


def test_the_region_label_set_is_capped():
    m = ServerMetrics("m", max_regions=3)
    for i in range(6):
        m.observe(_tl(str(i), f"r{i}"))
    m.observe(_tl("again", "r0"))
    counts = _series(m.render().decode(), "tailguard_client_rtt_seconds_count")
    assert counts == {"r0": 2, "r1": 1, "r2": 1, "other": 3}
