"""``tailguard slo grafana``: the dashboard's JSON follows Grafana's model, and every panel's PromQL returns data from
a real Prometheus (Debian's binary) scraping a real tailguard server every second while traffic flows: successes,
streams, a VIP lane, server errors, and tiers low enough that the SLO monitor escalates and sheds and degrades."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tailguard.cli import main
from tailguard.engine.fake import FakeTiming
from tailguard.slo.grafana import (
    SCHEMA_VERSION,
    MetricInfo,
    available_metrics,
    build_dashboard,
    expand_variables,
    le_matcher,
    panel_queries,
)
from tailguard.slo.profiles import builtin_profiles
from tests.net import free_port
from tests.serving_helpers import FailingEngine, fake_server

PROMETHEUS = shutil.which("prometheus")
# CI installs Prometheus (.ci/run) and sets this, so that a missing binary fails there instead of skipping.
REQUIRED = os.environ.get("TAILGUARD_REQUIRE_PROMETHEUS") == "1"


def _dashboard(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "dashboard.json"
    assert main(["slo", "grafana", "-o", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_dashboard_follows_grafanas_model(tmp_path):
    d = _dashboard(tmp_path, "--profile", "advanced")
    assert d["schemaVersion"] == SCHEMA_VERSION and d["title"] == "tailguard" and d["uid"] == "tailguard"
    assert isinstance(d["version"], int) and d["time"] == {"from": "now-1h", "to": "now"}
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("model", "business_type", "scope"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    occupied: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in g.values())
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["y"] >= 0
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
        if p["type"] == "row":
            assert p["panels"] == [] and g["w"] == 24
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["expr"] and t["datasource"] == p["datasource"]
        assert "unit" in p["fieldConfig"]["defaults"] and p["fieldConfig"]["overrides"] == []
    titles = [p["title"] for p in d["panels"]]
    for wanted in ("TTFT P50 / P95 / P99", "Inter-token latency P50 / P95 / P99", "E2E latency P50 / P95 / P99",
                   "Queue wait P50 / P95 / P99", "Requests per second by outcome", "Error rate", "Tier per scope",
                   "Shed and degraded requests", "Burn rate: advanced/e2e_p99", "Burn rate: advanced/ttft_p99"):
        assert wanted in titles
    # The profile's objectives are the dashed lines of their panels: advanced has TTFT P99 <= 350 ms.
    ttft = next(p for p in d["panels"] if p["title"] == "TTFT P50 / P95 / P99")
    assert 0.35 in [s["value"] for s in ttft["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def test_panels_follow_the_metrics_that_exist():
    """No invented metrics: a panel appears only when its metric is exported; a new per-replica or acceptance
    metric gets a panel without code here knowing its name."""
    metrics = available_metrics()
    names = {MetricInfo(n, m.type).series for n, m in metrics.items()}
    # Every series any panel reads is one the server's registries export.
    dash, notes = build_dashboard(list(builtin_profiles().values()), metrics)
    assert notes == []
    series_read = {w for _, expr in panel_queries(dash) for w in _series_names(expr)}
    assert series_read <= names | {f"{n}_{s}" for n in metrics for s in ("sum", "count")}
    assert not any("replica" in s for s in series_read)  # no per-replica metric on a server without upstreams
    assert any("accepted" in s for s in series_read)  # the speculative decoding metrics exist: they get panels

    fewer = {n: m for n, m in metrics.items() if n != "tailguard_slo_tier"}
    dash2, notes2 = build_dashboard(list(builtin_profiles().values()), fewer)
    assert "Tier per scope" not in [p["title"] for p in dash2["panels"]]
    assert any("tailguard_slo_tier" in n for n in notes2)

    more = {**metrics, "tailguard_replica_load": MetricInfo("tailguard_replica_load", "gauge", ("replica",)),
            "tailguard_spec_accepted_tokens": MetricInfo("tailguard_spec_accepted_tokens", "counter", ("model",))}
    dash3, _ = build_dashboard(list(builtin_profiles().values()), more)
    exprs = dict((title, expr) for title, expr in panel_queries(dash3))
    assert exprs["tailguard_replica_load"] == "sum by (replica) (tailguard_replica_load)"
    assert "rate(tailguard_spec_accepted_tokens_total" in exprs["tailguard_spec_accepted_tokens"]
    rows = [p["title"] for p in dash3["panels"] if p["type"] == "row"]
    assert rows[-2:] == ["Per-replica load", "Speculative decoding"]


def _series_names(expr: str) -> set[str]:
    import re

    return {m for m in re.findall(r"\b(tailguard_[a-z0-9_]+)", expr)}


# --- against a real Prometheus ------------------------------------------------------------------------------------

def _traffic(url: str, stop: threading.Event, worker: int, counts: dict[str, int]) -> None:
    kinds = [({}, False), ({}, True), ({"X-Lane": "vip"}, False), ({"X-Business-Type": "batch"}, False),
             ({"X-Request-ID": "boom"}, False), ({"X-Business-Type": "chat"}, True)]
    i = worker
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            headers, stream = kinds[i % len(kinds)]
            if "X-Request-ID" in headers:
                headers = {"X-Request-ID": f"boom-{worker}-{i}"}
            body = {"model": "fake", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8,
                    "stream": stream}
            r = client.post(url + "/v1/chat/completions", json=body, headers=headers)
            counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1
            i += 1
            stop.wait(0.05)


def _start_prometheus(tmp_path: Path, target: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: tailguard\n    static_configs:\n      - targets: ['{target}']\n")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"prometheus did not start: {proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.1)


def _query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def _panels_without_data(prom_url: str, queries: list[tuple[str, str]], settle_s: float = 6,
                         timeout_s: float = 45) -> list[str]:
    """Panels whose query returns no finite value, polled while the traffic runs until none is left or time is up."""
    deadline = time.monotonic() + timeout_s
    time.sleep(settle_s)  # a few scrapes with traffic in them, and a few SLO evaluations
    while True:
        missing = [f"{title}: {expr}" for title, expr in queries if not _finite(_query(prom_url, expand_variables(expr)))]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(1)


def _panels_without_data_under(prom_url: str, queries: list[tuple[str, str]],
                               traffic: Callable[[threading.Event, int], None], workers: int) -> list[str]:
    """``_panels_without_data`` while ``workers`` threads run ``traffic(stop, worker)``."""
    stop = threading.Event()
    threads = [threading.Thread(target=traffic, args=(stop, w)) for w in range(workers)]
    for t in threads:
        t.start()
    try:
        return _panels_without_data(prom_url, queries)
    finally:
        stop.set()
        for t in threads:
            t.join(30)


needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None and not REQUIRED,
    reason="needs Prometheus on PATH (Debian: apt-get install prometheus; .ci/run installs it)")


@pytest.mark.slow
@needs_prometheus
def test_every_panel_returns_data_from_a_real_prometheus(tmp_path):
    assert PROMETHEUS is not None, "TAILGUARD_REQUIRE_PROMETHEUS=1 but no prometheus binary on PATH"
    dashboard = _dashboard(tmp_path)
    queries = panel_queries(dashboard)
    assert len(queries) >= 25
    # Tiers far below the fake engine's 10 ms TTFT: the monitor goes red within a few evaluations, so it scales
    # out, sheds batch traffic and degrades the rest (VIP is protected), as it would under a real overload.
    slo = {"eval_interval_s": 1.0, "objective_min_samples": 5,
           "tiers": {"judge": [{"metric": "ttft", "percentile": 99, "yellow": 0.001, "orange": 0.002, "red": 0.003}],
                     "min_samples": 5, "min_dwell_s": 0},
           "scopes": [{"name": "all"}, {"name": "vip", "where": {"lanes": ["vip"]}}]}
    # The fake engine also reports speculative decoding counts, so that the acceptance panels have data.
    engine = FailingEngine(FakeTiming(ttft=0.01, itl=0.002, spec_proposed_per_token=1.0, spec_acceptance=0.6))
    # The VIP traffic is told apart by X-Lane, which a server counts only behind a trusted proxy.
    with fake_server(tmp_path, engine=engine, slo=slo, trust_lane_header=True) as server:
        prom, prom_url = _start_prometheus(tmp_path, f"127.0.0.1:{server.port}")
        try:
            counts: dict[str, int] = {}
            missing = _panels_without_data_under(
                prom_url, queries, lambda stop, w: _traffic(server.url, stop, w, counts), workers=3)
            up = _query(prom_url, 'up{job="tailguard"}')
            variables = {name: httpx.get(f"{prom_url}/api/v1/label/{name}/values",
                                         params={"match[]": series}).json()["data"]
                         for name, series in (("model", "tailguard_requests_total"),
                                              ("business_type", "tailguard_requests_total"),
                                              ("scope", "tailguard_slo_tier"))}
            tiers = {s["metric"]["scope"]: float(s["value"][1]) for s in _query(prom_url, "tailguard_slo_tier")}
        finally:
            prom.terminate()
            prom.wait(30)
    assert up and up[0]["value"][1] == "1"
    assert counts.get("200") and counts.get("500") and counts.get("429"), counts
    assert not missing, "panels without data:\n" + "\n".join(missing)
    # The template variables (label_values queries) have values to offer.
    assert variables["model"] == ["fake"]
    assert {"default", "batch", "chat"} <= set(variables["business_type"])
    assert set(variables["scope"]) == {"all", "vip"}
    assert tiers["all"] == 3.0


def test_dashboard_reads_the_label_names_the_server_exports():
    """The per-request matcher names labels that every per-request series carries (else it would match nothing)."""
    for info in available_metrics().values():
        if info.name.startswith("tailguard_request") or info.name in ("tailguard_time_to_first_token_seconds",
                                                                     "tailguard_inter_token_latency_seconds",
                                                                     "tailguard_e2e_request_latency_seconds"):
            assert {"model", "business_type"} <= set(info.labels), info


def test_unknown_profile_is_a_clear_error(tmp_path, capsys):
    assert main(["slo", "grafana", "--profile", "no-such-profile", "-o", str(tmp_path / "d.json")]) == 2
    assert "no-such-profile" in capsys.readouterr().err
    assert not (tmp_path / "d.json").exists()


def test_bucket_matcher_reads_both_prometheus_2_and_3_spellings():
    """prometheus_client writes le="2.0"; Prometheus 3 normalizes it to le="2". The burn panels must find either."""
    import re

    matcher = le_matcher(2.0)
    assert matcher.startswith('le=~"') and matcher.endswith('"')
    regex = matcher[len('le=~"'):-1].encode().decode("unicode_escape")  # the PromQL string literal's value
    assert re.fullmatch(regex, "2.0") and re.fullmatch(regex, "2")
    assert not re.fullmatch(regex, "20") and not re.fullmatch(regex, "2.05")
    assert le_matcher(1.2) == 'le="1.2"'


@pytest.mark.slow
@needs_prometheus
def test_every_gateway_panel_returns_data_from_a_real_prometheus(tmp_path):
    """A gateway over two fake replicas, one fast and one that stalls: lanes, tenants, streams and replicas panels
    all get data from the traffic a gateway meets (refusals, a tenant over its rate, missed deadlines)."""
    from tailguard.policy.tenants import KeyFile
    from tests.serving.test_gateway import chat, gateway, replica

    assert PROMETHEUS is not None, "TAILGUARD_REQUIRE_PROMETHEUS=1 but no prometheus binary on PATH"
    queries = [(t, e) for t, e in panel_queries(_dashboard(tmp_path, "--gateway"))]
    gateway_titles = {"Lanes: waiting and in use", "Lane wait P99", "Outstanding tokens per replica",
                      "Upstream TTFT P99 per replica", "Healthy replicas",
                      "Refused: lanes full or late, tenants over their rate"}
    assert gateway_titles <= {t for t, _ in queries}
    kf = KeyFile()
    keys = {"vip": kf.add_key("acme", "vip"), "batch": kf.add_key("crawler", "batch"),
            "std": kf.add_key("shop", "standard"), "slow": kf.add_key("slowpoke", "standard", requests_per_s=0.5)}
    kf.save(tmp_path / "keys.yaml")
    lanes = {"vip": {"priority": 0, "reserved": True, "sheddable": False},
             "standard": {"priority": 1, "itl_deadline_s": 0.1, "ttft_deadline_s": 2.0},
             "batch": {"priority": 2, "burst": False, "max_queue": 1, "max_queue_wait_s": 0.3}}
    counts: dict[str, int] = {}

    def traffic(stop: threading.Event, worker: int) -> None:
        kinds = ["vip", "batch", "batch", "std", "slow"]
        i = worker
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                kind = kinds[i % len(kinds)]
                r = chat(gw.url, keys[kind], max_tokens=6, stream=kind == "std", client=client)
                counts[f"{kind} {r.status_code}"] = counts.get(f"{kind} {r.status_code}", 0) + 1
                i += 1
                stop.wait(0.02)

    with replica(tmp_path, "fast", ttft=0.01, itl=0.02) as fast, replica(tmp_path, "stalls", ttft=0.01, itl=0.25) \
            as slow, gateway(tmp_path, [fast.url, slow.url], keys_file=str(tmp_path / "keys.yaml"), lanes=lanes,
                             capacity={"max_concurrent": 4}) as gw:
        prom, prom_url = _start_prometheus(tmp_path, f"127.0.0.1:{gw.port}")
        try:
            missing = _panels_without_data_under(prom_url, queries, traffic, workers=6)
        finally:
            prom.terminate()
            prom.wait(30)
    assert counts.get("vip 200") and counts.get("batch 429") and counts.get("slow 429"), counts
    assert not missing, "panels without data:\n" + "\n".join(missing)
