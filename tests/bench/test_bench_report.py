"""The HTML report: produced, self-contained, with the Sankey and CDF figures (rendered in headless Chromium if any)."""

from __future__ import annotations

import asyncio
import csv
import json
import shutil
import subprocess

import pytest

from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.bench.runner import execute, write_outputs
from tests.bench_helpers import bench_config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-report")
    script = FakeScript(ttft=0.02, itl=0.003, jitter=0.4, multi_token_every=6, max_lifetime=60)
    with FakeServerProcess(script) as srv:
        res, ms = asyncio.run(execute(bench_config(srv.url, rate=60, num_requests=60, join="auto",
                                                   warmup_requests=5, langs=("en", "zh")), display=False))
    write_outputs(res, ms, out)
    return out


def test_outputs_are_written_and_consistent(run_dir):
    res = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    assert res["schema"] == "tailguard.bench/v1"
    assert res["summary"]["requests"] == {"sent": 60, "warmup": 5, "measured": 55, "completed": 55, "failed": 0}
    with (run_dir / "requests.csv").open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60 and sum(r["warmup"] == "1" for r in rows) == 5
    assert {r["lang"] for r in rows} == {"en", "zh"} and set(res["by_language"]) == {"en", "zh"}
    assert all(r["stage_source"] == "server" for r in rows)
    assert set(res["slo"]) == {"baseline", "advanced", "strict"}


def test_report_has_the_sankey_and_cdf_figures_and_opens_offline(run_dir):
    doc = (run_dir / "report.html").read_text(encoding="utf-8")
    for div in ("fig-cdf", "fig-sankey", "fig-bands", "fig-timeline"):
        assert f'id="{div}"' in doc
    assert '"type":"sankey"' in doc and "Latency CDFs" in doc
    assert "Verdicts" in doc and "baseline" in doc
    # self-contained: plotly.js is inlined and nothing is fetched from the network
    assert "Plotly" in doc and "<script src=" not in doc and "cdn.plot.ly" not in doc.split("</script>", 1)[1]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    png = tmp_path / "report.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--hide-scrollbars", "--virtual-time-budget=5000",
           f"--screenshot={png}", "--window-size=1280,2400", (run_dir / "report.html").as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert png.is_file()
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # a blank page compresses to a few KB; drawn figures and tables do not
    assert len(data) > 60_000
