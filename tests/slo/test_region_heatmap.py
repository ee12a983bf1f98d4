"""The region heatmap (slo/region_heatmap.py): region x time bucket -> P99 latency, median RTT and retransmit rate
from the request store, on the /slo page (GET /slo/heatmap, drawn with plotly) and in `tailguard slo report --html`."""

from __future__ import annotations

import contextlib
import datetime as dt
import shutil
import sqlite3
import subprocess

import httpx
import numpy as np
import pytest

from tailguard.cli import main
from tailguard.engine.fake import FakeTiming
from tailguard.observe.stores import open_store
from tailguard.observe.timeline import Outcome, Timeline
from tailguard.slo.profiles import builtin_profiles
from tailguard.slo.region_heatmap import quantile, region_heatmap, sqlite_rows, store_rows
from tailguard.slo.report import build_report, render_report_html
from tests.pg_cluster import shared_cluster
from tests.serving_helpers import ADMIN, ADMIN_KEY, fake_server, settle

MONDAY = dt.datetime(2026, 11, 30, tzinfo=dt.UTC).timestamp()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _timeline(i: int, at: float, e2e: float, region: str, rtt_ms: float | None = None, retrans: int = 0,
              segs: int = 100, outcome: Outcome = Outcome.SUCCESS, ttft: float | None = None) -> Timeline:
    ttft = ttft if ttft is not None else e2e / 2
    tl = Timeline(request_id=f"h{i}", endpoint="/v1/chat/completions", received=0.0, received_unix=at,
                  tokenized=0.0, scheduled=0.0, first_token=ttft, last_token=e2e, token_times=[ttft, e2e],
                  num_output_tokens=2, finish_reason="length", region=region)
    if rtt_ms is not None:
        tl.network = {"rtt_ms": {"first": rtt_ms, "mean": rtt_ms, "max": rtt_ms, "last": rtt_ms},
                      "retransmits": retrans, "segments_out": segs, "samples": 3}
    tl.finalize(200 if outcome is Outcome.SUCCESS else 500, outcome, at=e2e)
    return tl


def _fill(store, rng, base: float, bucket_s: float, regions=("eu", "us", "ap"), buckets: int = 3) -> dict:
    """Known records: per region and bucket, lognormal E2E (a different scale each), an RTT per region, some
    retransmits, and errors that must not count in the E2E percentile. Returns what each cell must show."""
    expect: dict[tuple[str, int], dict] = {}
    i = 0
    for k, region in enumerate(regions):
        for b in range(buckets):
            n = 40 + 10 * k + 5 * b
            e2e = rng.lognormal(np.log(0.2 * (k + 1)), 0.4, n)
            rtts = rng.uniform(5 * (k + 1), 10 * (k + 1), n)
            times = base + b * bucket_s + rng.uniform(1, bucket_s - 1, n)
            for v, rtt, t in zip(e2e, rtts, times, strict=True):
                store.put(_timeline(i, float(t), float(v), region, float(rtt), retrans=k, segs=100))
                i += 1
            for _ in range(3):  # errors: requests, but no E2E sample; with no network section
                store.put(_timeline(i, float(base + b * bucket_s + 2), 9.0, region, outcome=Outcome.ERROR))
                i += 1
            expect[(region, b)] = {"p99": float(np.percentile(e2e, 99)), "rtt": float(np.median(rtts)),
                                   "rate": k / 100, "n": n, "requests": n + 3}
    return expect


def _check(data: dict, expect: dict, buckets: int = 3) -> None:
    assert data["regions"] == ["ap", "us", "eu"]  # the busiest first
    assert len(data["buckets"]) == buckets
    for (region, b), e in expect.items():
        r = data["regions"].index(region)
        assert data["latency"][r][b] == pytest.approx(e["p99"], rel=1e-9), (region, b)
        assert data["latency_n"][r][b] == e["n"]
        assert data["requests"][r][b] == e["requests"]
        assert data["rtt_ms_median"][r][b] == pytest.approx(e["rtt"], rel=1e-9)
        assert data["retransmit_rate"][r][b] == pytest.approx(e["rate"])
        assert data["network_n"][r][b] == e["n"]


def test_quantile_is_numpys_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 99, 100, 1001):
        v = rng.normal(size=n).tolist()
        for q in (0.0, 0.5, 0.95, 0.99, 1.0):
            assert quantile(v, q) == pytest.approx(float(np.percentile(v, q * 100)), abs=1e-12)
    assert quantile([], 0.99) is None


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    with contextlib.ExitStack() as stack:
        target = (stack.enter_context(shared_cluster().database()) if request.param == "postgresql"
                  else str(tmp_path / "r.sqlite3"))
        s = open_store(target, retention_days=36500)
        yield s
        s.close(deadline_s=5)


def test_p99_per_region_and_minute_from_the_store(store):
    rng = np.random.default_rng(7)
    base = MONDAY + 3600
    expect = _fill(store, rng, base, 60.0)
    assert store.flush(20)
    rows = store_rows(store, base, base + 180)
    data = region_heatmap(rows, start=base, end=base + 179.9, bucket_s=60.0)
    _check(data, expect)
    # TTFT instead: every served request counts, errors included (their TTFT is half their 9 s E2E here).
    ttft = region_heatmap(rows, start=base, end=base + 179.9, bucket_s=60.0, metric="ttft")
    r = ttft["regions"].index("eu")
    assert ttft["latency_n"][r][0] == expect[("eu", 0)]["n"] + 3
    assert ttft["totals"]["eu"]["requests"] == sum(e["requests"] for (g, _), e in expect.items() if g == "eu")


def test_empty_cells_and_the_other_region():
    base = MONDAY
    rows = [(f"r{k}", base + 10, 0.1 * (k + 1), None, "success", None) for k in range(5) for _ in range(5 - k)]
    data = region_heatmap(rows, start=base, end=base + 120, bucket_s=60.0, max_regions=3)
    assert data["regions"] == ["r0", "r1", "other"]
    assert data["requests"][2] == [3 + 2 + 1, 0]  # two buckets: [base, base + 60), [base + 60, end]
    assert data["latency"][0][1] is None and data["rtt_ms_median"][0][0] is None  # no request / no network figure
    assert data["retransmit_rate"][0][0] is None
    with pytest.raises(ValueError):
        region_heatmap(rows, start=base, end=base + 1, bucket_s=60.0, metric="tpot")


def _report_store(tmp_path):
    rng = np.random.default_rng(11)
    db = tmp_path / "requests.sqlite3"
    store = open_store(db, retention_days=36500)
    base = MONDAY + 10 * 3600
    expect = _fill(store, rng, base, 3600.0)
    store.close()
    return db, base, expect


def test_the_report_has_the_region_heatmap(tmp_path):
    db, base, expect = _report_store(tmp_path)
    rep = build_report(db, list(builtin_profiles().values()), weeks=1, now=MONDAY + 2 * 86400)
    heat = rep["regions"]
    assert heat["bucket_s"] == 3600
    assert heat["start"] == MONDAY and len(heat["buckets"]) == 48
    first = int((base - MONDAY) // 3600)
    sliced = {k: [row[first:first + 3] for row in heat[k]] for k in
              ("latency", "latency_n", "requests", "rtt_ms_median", "retransmit_rate", "network_n")}
    _check({**heat, **sliced, "buckets": heat["buckets"][first:first + 3]}, expect)
    assert all(v == 0 for row in heat["requests"] for v in row[:first])  # nothing before the records
    page = render_report_html(rep)
    assert "Plotly.newPlot" in page and '"type":"heatmap"' in page.replace(" ", "")
    assert "region-heatmap" in page and ">eu<" in page and "P99 E2E" in page
    # A read-only connection gives the same rows as the running server's store.
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    cols = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
    rows = sqlite_rows(conn, base, base + 3 * 3600, cols)
    conn.close()
    assert len(rows) == sum(e["requests"] for e in expect.values())


def test_slo_report_html_from_the_command_line(tmp_path, capsys):
    db, _, _ = _report_store(tmp_path)
    out = tmp_path / "out" / "report.html"
    assert main(["slo", "report", "--db", str(db), "--weeks", "2", "--html", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("<!doctype html>") and "plotly" in text and ">ap<" in text
    printed = capsys.readouterr().out
    assert "Regions" in printed and "ap" in printed
    rep = build_report(db, list(builtin_profiles().values()), weeks=20, now=MONDAY + 86400)
    assert rep["regions"]["bucket_s"] == 86400 and len(rep["regions"]["buckets"]) == 19 * 7 + 1  # a day a column, to now


def test_the_slo_page_serves_the_heatmap(tmp_path):
    with fake_server(tmp_path, FakeTiming(ttft=0.002, itl=0.001), region_cidrs={"127.0.0.0/8": "loopback"}) as s:
        for i, region in enumerate(["eu", "eu", "us", None, None, None]):
            headers = {"x-region": region} if region else {}
            r = httpx.post(s.url + "/v1/chat/completions",
                           json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                 "stream": i % 2 == 0}, headers=headers)
            assert r.status_code == 200
        settle(s)
        assert httpx.get(s.url + "/slo/heatmap").status_code == 401  # regions and their traffic: the admin's
        h = httpx.get(s.url + "/slo/heatmap", headers=ADMIN)
        assert h.status_code == 200, h.text
        body = h.json()
        data = body["data"]
        assert data["bucket_s"] == 60 and data["metric"] == "e2e"
        assert data["regions"] == ["loopback", "eu", "us"]
        assert [data["totals"][r]["requests"] for r in data["regions"]] == [3, 2, 1]
        assert all(data["totals"][r]["network_n"] == data["totals"][r]["requests"] for r in data["regions"])
        assert [t["type"] for t in body["figure"]["data"]] == ["heatmap"] * 3
        assert httpx.get(s.url + "/slo/heatmap?metric=ttft&minutes=30", headers=ADMIN).json()["data"]["metric"] \
            == "ttft"
        assert httpx.get(s.url + "/slo/heatmap?metric=nope", headers=ADMIN).status_code == 400
        js = httpx.get(s.url + "/slo/plotly.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"] and b"plotly" in js.content[:2000]
        page = httpx.get(s.url + "/slo").text
        assert 'id="heatmap"' in page and "/plotly.js" in page


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian package 'chromium')")
def test_the_heatmap_is_drawn_in_chromium(tmp_path):
    with fake_server(tmp_path, FakeTiming(ttft=0.002, itl=0.001)) as s:
        for region in ("eu", "us", "us"):
            httpx.post(s.url + "/v1/chat/completions", headers={"x-region": region},
                       json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        settle(s)
        out = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=8000", "--dump-dom",
             s.url + f"/slo?interval=500#key={ADMIN_KEY}"],
            capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    assert 'id="heatmap" data-drawn="1"' in dom, dom[-3000:]
    assert 'class="hm"' in dom or "heatmaplayer" in dom  # plotly's heatmap layer
    assert "<td>us</td>" in dom and "<td>eu</td>" in dom  # the per-region table, from the same data
