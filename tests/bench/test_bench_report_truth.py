"""The bench report tells the truth, plainly: SLO lines where the thresholds are, one CI per figure, no false alarms
about the bench or the server, no insider words, sample sizes and small-sample warnings, numbers for people, raw
JSON only in collapsed blocks, and titles that do not overlap (checked in headless Chromium where it is installed).

The runs go through the scripted transport with latencies the tests choose, so that every expectation below is
worked out from those latencies, not read back from the bench.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.bench.loadgen import LoadOutcome, LoadPlan
from tailguard.bench.profiles import golden_rules, plain_words
from tailguard.bench.report import cdf_figure, fmt_s, sig, split_thresholds
from tailguard.bench.runner import _health, execute, saturation_warning, write_outputs
from tailguard.bench.stats import min_samples
from tests.bench_helpers import ScriptedTransport, bench_config

N = 60


def _known_latency(i: int) -> tuple[float, float]:
    """TTFT spread over 100-570 ms and a gap of 20-60 ms: E2E (12 tokens, 11 gaps) spans about 0.3-1.2 s."""
    ttft = 0.100 + 0.470 * (i % 40) / 39
    gap = 0.020 + 0.040 * ((i * 7) % 40) / 39
    return ttft, gap


def _run(tmp_path, name: str, n: int = N, fail=None, **kw):
    tr = ScriptedTransport(FakeScript(), latency=_known_latency, fail=fail)
    cfg = bench_config(concurrency=4, num_requests=n, output_tokens=12, timeout=5.0, **kw)
    res, ms = asyncio.run(execute(cfg, transport=tr, display=False))
    write_outputs(res, ms, tmp_path / name)
    return res, (tmp_path / name / "report.html").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("truth"), "known")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real run against the fake server process, with its stage timelines: every figure of the report."""
    out = tmp_path_factory.mktemp("served")
    script = FakeScript(ttft=0.02, itl=0.003, jitter=0.4, max_lifetime=60)
    with FakeServerProcess(script) as srv:
        res, ms = asyncio.run(execute(bench_config(srv.url, rate=40, num_requests=40, join="auto"), display=False))
    write_outputs(res, ms, out)
    return res, (out / "report.html").read_text(encoding="utf-8")


def figure(doc: str, div_id: str) -> tuple[list, dict]:
    """(data, layout) of a plotly figure as the report wrote it into the page."""
    at = doc.index(f'"{div_id}",', doc.index("Plotly.newPlot(", doc.index(f'id="{div_id}"'))) + len(div_id) + 3
    dec = json.JSONDecoder()
    data, end = dec.raw_decode(doc, re.search(r"\S", doc[at:]).start() + at)
    nxt = doc.index(",", end) + 1
    layout, _ = dec.raw_decode(doc, re.search(r"\S", doc[nxt:]).start() + nxt)
    return data, layout


def visible_text(doc: str) -> str:
    """What a reader sees without opening a <details> block: no scripts, no tags."""
    body = doc.split("</head>", 1)[1]
    body = re.sub(r"<script.*?</script>", " ", body, flags=re.S)
    body = re.sub(r"<details>.*?</details>", " ", body, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body)).replace("\xa0", " ")


def table_row(doc: str, first_cell: str) -> list[str]:
    """The cells (as text) of each table row whose first cell is ``first_cell``."""
    rows = []
    for tr in re.findall(r"<tr>(.*?)</tr>", doc, flags=re.S):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).replace("\xa0", " ").strip()
                 for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", tr)]
        if cells and cells[0] == first_cell:
            rows.append(cells)
    return rows


# --- 1. SLO lines on the CDFs ---------------------------------------------------------------------------------

def test_slo_thresholds_are_drawn_on_the_cdfs_where_they_are(known):
    res, doc = known
    _, layout = figure(doc, "fig-cdf")
    lines = {(s["xref"], round(s["x0"], 6)) for s in layout.get("shapes", []) if s["x0"] == s["x1"]}
    # TTFT (first subplot, axis x) spans 100-570 ms: the advanced profile's 350 ms line lies inside it
    assert ("x", 350.0) in lines
    # E2E (fourth subplot) spans ~0.3-1.2 s: 450 ms, 1.2 s, 1.5 s (strict's finance bound) and 2 s are all drawn
    assert {("x4", 450.0), ("x4", 1200.0), ("x4", 1500.0), ("x4", 2000.0)} <= lines
    texts = [a.get("text", "") for a in layout.get("annotations", [])]
    assert "SLO 350 ms" in texts and "SLO 450 ms" in texts
    assert not any("right" in t for t in texts)  # nothing is "off to the right" of data it lies inside


def test_a_threshold_far_right_of_the_data_is_named_not_drawn():
    assert split_thresholds([0.35, 5.0], data_max_s=0.57) == ([0.35], [5.0])
    assert split_thresholds([0.45, 1.2, 2.0], data_max_s=1.2) == ([0.45, 1.2, 2.0], [])  # both sides in seconds
    ttft = list(np.linspace(0.1, 0.57, 40))
    results = {"samples": {"ttft": ttft}, "summary": {"requests": {"failed": 0}},
               "slo": {"p": {"checks": [{"metric": "ttft", "threshold_s": 5.0, "status": "pass"},
                                        {"metric": "ttft", "threshold_s": 0.35, "status": "pass"}]}}}
    fig = cdf_figure(results)
    assert [s.x0 for s in fig.layout.shapes] == [350.0]
    far = [a.text for a in fig.layout.annotations if "far right" in (a.text or "")]
    assert far == ["SLO 5 s: far right of the data (largest 570 ms)"]


# --- 2. one CI per figure ------------------------------------------------------------------------------------

def test_the_same_figure_shows_the_same_ci_everywhere(known):
    res, doc = known
    table = res["metrics"]
    for profile, label, metric in (("baseline", "E2E P99 <= 2 s", "e2e"), ("baseline", "E2E P50 <= 450 ms", "e2e"),
                                   ("advanced", "TTFT P99 <= 350 ms", "ttft")):
        check = next(c for c in res["slo"][profile]["checks"] if c["objective"] == label)
        q = "p" + label.split(" P", 1)[1].split(" ")[0]
        assert check["ci_s"] == table[metric]["percentiles"][q]["ci"]
        assert check["value_s"] == table[metric]["percentiles"][q]["value"]
    # ...and the page prints one CI for E2E P99, in the verdicts and in the percentile table alike
    e2e_p99_ci = [row[3] for row in table_row(doc, "E2E P99 <= 2 s")]
    assert len(e2e_p99_ci) == 3 and len(set(e2e_p99_ci)) == 1  # baseline, advanced, strict
    (row,) = table_row(doc, "E2E")
    p99_cell = row[6]  # metric, n, mean, P50, P90, P95, P99
    assert e2e_p99_ci[0] in p99_cell


def test_a_verdict_over_another_sample_bootstraps_its_own(tmp_path):
    # 3 failed requests are misses in the verdict's sample but left out of the table's: a different figure
    res, _ = _run(tmp_path, "failed", fail=lambda i: "429" if i in (5, 17, 29) else None)
    check = next(c for c in res["slo"]["baseline"]["checks"] if c["objective"] == "E2E P50 <= 450 ms")
    assert check["failed_in_scope"] == 3 and "ci_from" not in check and check["samples"] == N


# --- 3. the bench's health and the server's, judged against what was measured ------------------------------------

def _outcome(send_lag_s: float, cpu_share: float, loop_lag_s: float = 0.0005) -> LoadOutcome:
    lag = np.full(100, send_lag_s / 3)
    lag[-2:] = send_lag_s  # P99 of the lag ~ send_lag_s
    return LoadOutcome(results=[], t0=0.0, started_unix=0.0, finished=100.0, send_lag=lag,
                       loop_lag=np.full(50, loop_lag_s), cpu_seconds=cpu_share * 100.0, wall_seconds=100.0,
                       inflight_waits=0)


def _latencies(ttft: float, e2e: float, tpot: float) -> dict:
    return {k: {"count": 18, "percentiles": {"p50": {"value": v}}} for k, v in
            (("ttft", ttft), ("e2e", e2e), ("tpot", tpot), ("itl", tpot))}


def test_a_few_ms_of_send_lag_against_13_s_latencies_is_no_bottleneck():
    h, warnings = _health(_outcome(0.006, 0.009), LoadPlan(mode="open"), _latencies(12.9, 13.2, 0.1))
    assert h["bench_is_bottleneck"] is False and warnings == []
    assert h["verdict"].startswith("The bench kept up")
    lag = next(c for c in h["checks"] if c["check"] == "send lag")
    assert lag["value_s"] == pytest.approx(0.006, rel=0.05) and lag["share"] < 0.001


def test_send_lag_that_is_a_large_share_of_the_latency_is_a_bottleneck_and_says_why():
    h, warnings = _health(_outcome(0.050, 0.02), LoadPlan(mode="open"), _latencies(0.100, 0.4, 0.01))
    assert h["bench_is_bottleneck"] is True
    (w,) = [w for w in warnings if "send lag" in w]
    assert "of the median TTFT (100 ms)" in w and "came from its machine" in w  # 2% CPU: not its own work
    assert h["verdict"].startswith("The bench may have distorted these latencies (send lag)")


def test_a_busy_bench_cpu_is_a_bottleneck_whatever_the_lag():
    h, warnings = _health(_outcome(0.0005, 0.97), LoadPlan(mode="open"), _latencies(12.9, 13.2, 0.1))
    assert h["bench_is_bottleneck"] is True and any("97% of a CPU core" in w for w in warnings)


def test_long_latencies_over_a_short_schedule_are_not_saturation():
    # 18 requests sent over 85 s (0.2 req/s), each 13 s long: all completed, none queued
    summary = {"requests": {"completed": 18}, "duration_s": 85.0 + 13.0, "throughput": {}}
    assert saturation_warning(summary, _latencies(12.9, 13.0, 0.1), offered=17 / 85.0) is None
    # a server serving 5 req/s of the 10 offered for 10 s: its queue grows, latencies with it (median 5 s)
    summary = {"requests": {"completed": 100}, "duration_s": 20.0, "throughput": {}}
    w = saturation_warning(summary, _latencies(4.9, 5.0, 0.1), offered=10.0)
    assert w is not None and "6.67 req/s while 10 req/s were offered" in w


def test_an_end_to_end_run_with_long_latencies_raises_no_false_alarm(tmp_path):
    tr = ScriptedTransport(FakeScript(), latency=lambda i: (12.0 + 0.01 * i, 0.1))
    cfg = bench_config(rate=20.0, num_requests=18, output_tokens=12, timeout=60.0, profiles=("baseline",))
    res, ms = asyncio.run(execute(cfg, transport=tr, display=False))
    write_outputs(res, ms, tmp_path / "long")
    doc = visible_text((tmp_path / "long" / "report.html").read_text(encoding="utf-8"))
    assert res["bench_health"]["bench_is_bottleneck"] is False
    assert "saturated" not in doc and "fell behind" not in doc
    assert "The bench kept up" in doc


def test_golden_rule_advice_agrees_with_its_own_evidence():
    def table(p50, p90, p95, p99):
        return {"e2e": {"percentiles": {k: {"value": v} for k, v in
                                        (("p50", p50), ("p90", p90), ("p95", p95), ("p99", p99))}}}

    # a lognormal body of sigma 1: P99/P50 = 10 is what that body implies, not an anomalous tail
    wide = [a for a in golden_rules(table(1.0, 3.6, 5.18, 10.2), ("e2e",)) if a["fired"]]
    assert wide and all(a["severity"] == "info" for a in wide)
    for a in wide:
        assert "now" not in a["action"] and "within a day" not in a["action"]
        assert a["action"][0].isupper() and a["note"][0].isupper()
    # a real tail: P99 far above what P50/P90 predict
    heavy = {a["rule"]: a for a in golden_rules(table(1.0, 1.5, 1.7, 6.0), ("e2e",)) if a["fired"]}
    assert heavy["P99 > 3 x P50"]["action"].startswith("Plan improvements now")
    assert heavy["P99 > 1.5 x P95"]["action"].startswith("Plan improvements within a day")
    assert all(a["severity"] == "warning" for a in heavy.values())


# --- 4. plain words ------------------------------------------------------------------------------------------

INSIDER = re.compile(r"seed's|\bthe seed\b|\b[LMS][0-9]\b|optimization plan|improvement plan|24 h\b", re.I)


def test_no_insider_words_reach_the_reader(known, served):
    for _, doc in (known, served):  # served: with the stage tables and the "attack these first" advice
        text = visible_text(doc)
        assert not INSIDER.findall(text), INSIDER.findall(text)
    assert "attack these first" in visible_text(served[1])
    assert plain_words("the seed's baseline: E2E P50 <= 450 ms") == "the baseline SLO profile: E2E P50 <= 450 ms"
    assert plain_words("a pick of the seed's tree") == "a pick of the advisor's decision tree"
    assert plain_words("cost per language (L1); attack these first, M2)") == "cost per language; attack these first)"
    assert plain_words("start the optimization plan now") == "plan improvements now"


# --- 5 and 6. layout, sample sizes, numbers for people -------------------------------------------------------

def test_failures_are_mentioned_only_when_there_are_some(known, tmp_path):
    _, doc = known
    text = visible_text(doc)
    assert "failed requests not shown" not in text and "A 0" not in text
    assert "are not in the curves" not in text
    _, failed_doc = _run(tmp_path, "with-failures", fail=lambda i: "cut" if i % 20 == 3 else None)
    assert "3 failed requests are not in the curves." in visible_text(failed_doc)


def test_every_figure_and_percentile_shows_its_sample_size_and_warns_when_it_is_too_small(known):
    res, doc = known
    _, layout = figure(doc, "fig-cdf")
    titles = [a["text"] for a in layout["annotations"] if a.get("text", "").startswith(("TTFT", "E2E", "TPOT"))]
    assert f"TTFT (n = {N})" in titles and f"E2E (n = {N})" in titles
    _, timeline = figure(doc, "fig-timeline")
    assert any(f"(n = {N} requests)" in a["text"] for a in timeline["annotations"])
    # the rule: P99 needs 100 samples (one beyond it), P99.9 1000; P95 20
    assert (min_samples(95), min_samples(99), min_samples(99.9)) == (20, 100, 1000)
    (row,) = table_row(doc, "E2E")
    p95, p99, p999 = row[5], row[6], row[7]
    assert "needs n ≥ 100" in p99 and "needs n ≥ 1,000" in p999 and "needs" not in p95  # 60 requests
    assert "P99 100, P99.9 1000" in visible_text(doc)
    verdict = table_row(doc, "E2E P99 <= 2 s")[0]
    assert verdict[1] == str(N) and "needs n ≥ 100" in verdict[2]
    assert f"Only {N} samples: P99 needs at least 100" in verdict[6]


def test_the_sankey_says_how_few_requests_its_slowest_1_percent_rests_on(served):
    res, doc = served
    tail_n = res["stages"]["p99_band_requests"]
    assert 1 <= tail_n < 5  # the requests at or above P99 of 40
    _, sankey = figure(doc, "fig-sankey")
    heads = [a["text"] for a in sankey["annotations"]]
    assert any(f"n = {tail_n} request" in t and "slowest 1%" in t for t in heads)
    assert any(f"n = {res['stages']['requests']} requests" in t and "mean request" in t for t in heads)


def test_numbers_are_for_people_and_raw_json_is_collapsed(known):
    _, doc = known
    text = visible_text(doc)
    assert not re.search(r"\d\.\d{5,}", text)  # no 17-digit floats where people read
    assert '{"' not in text and "{'" not in text  # no JSON or Python dicts outside <details>
    assert "<details><summary>Raw run configuration (JSON)</summary>" in doc
    assert "Source: the server's" not in text or "{" not in text.split("Source:", 1)[1][:200]
    assert re.search(r"Load: open loop|Load: closed loop: 4 concurrent streams", text)
    assert "– ms" not in text and "- ms" not in text and "n/a" in text  # the medical objective has no requests
    assert fmt_s(0.90836) == "908 ms" and fmt_s(13.7079) == "13.7 s" and fmt_s(None) == "n/a"
    assert sig(1040.69) == "1,041" and sig(0.04871) == "0.0487" and sig(2.0) == "2"
    data, _ = figure(doc, "fig-timeline")
    sizes = [t["marker"]["size"] for t in data if t.get("mode") == "markers"]
    assert sizes and min(sizes) >= 6  # dots a person can see


def test_health_is_said_in_plain_words_in_the_report(known):
    res, doc = known
    text = visible_text(doc)
    assert res["bench_health"]["verdict"] in html.unescape(doc)
    assert "judged against" in text and "of the median TTFT" in text


def _boxes(path, tmp_path) -> dict:
    """Each figure's title and annotation boxes, measured in headless Chromium after plotly drew the page."""
    probe = """<script>window.addEventListener('load', function () { setTimeout(function () {
      var box = function (el) { var b = el.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
      var out = {};
      document.querySelectorAll('.plotly-graph-div').forEach(function (div) {
        var t = div.querySelector('.g-gtitle .gtitle');
        out[div.id] = {title: t ? {text: t.textContent, box: box(t)} : null,
                       annotations: Array.from(div.querySelectorAll('g.annotation')).map(function (a) {
                         return {text: a.textContent, box: box(a)}; })};
      });
      var pre = document.createElement('pre'); pre.id = 'layout-boxes'; pre.textContent = JSON.stringify(out);
      document.body.appendChild(pre); }, 500); });</script>"""
    page = tmp_path / "probe.html"
    page.write_text(path.read_text(encoding="utf-8").replace("</body>", probe + "</body>"), encoding="utf-8")
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--virtual-time-budget=5000", "--window-size=1280,2400",
           "--dump-dom", page.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False).stdout
    m = re.search(r'<pre id="layout-boxes">(.*?)</pre>', out, flags=re.S)
    assert m, "the page did not finish drawing"
    return json.loads(html.unescape(m.group(1)))


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_titles_and_labels_do_not_overlap_when_drawn(served, tmp_path):
    res, doc = served
    (tmp_path / "report.html").write_text(doc, encoding="utf-8")
    boxes = _boxes(tmp_path / "report.html", tmp_path)
    assert {"fig-cdf", "fig-sankey", "fig-timeline"} <= set(boxes)
    for div_id, fig in boxes.items():
        items = ([fig["title"]] if fig["title"] else []) + fig["annotations"]
        for i, a in enumerate(items):
            for b in items[i + 1:]:
                assert not _overlap(a["box"], b["box"]), (div_id, a["text"], b["text"])
