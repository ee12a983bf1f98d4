"""The gateway's dashboard shows what the replicas' engines report (running, waiting, KV-cache use per replica): the
panels read series the gateway exports, and their PromQL is valid as Prometheus parses it (``promtool check
rules``). ``tests/slo/test_grafana.py`` runs every gateway panel, these included, against a real Prometheus."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tailguard.slo.grafana import available_metrics, build_dashboard, expand_variables, panel_queries
from tailguard.slo.profiles import builtin_profiles

PANELS = {"Engine running and waiting per replica": ("tailguard_upstream_running_requests",
                                                     "tailguard_upstream_queue_requests"),
          "KV cache in use per replica": ("tailguard_upstream_kv_cache_usage_ratio",)}


def _queries(gateway: bool) -> dict[str, list[str]]:
    dash, _ = build_dashboard(list(builtin_profiles().values()), available_metrics(gateway=gateway))
    out: dict[str, list[str]] = {}
    for title, expr in panel_queries(dash):
        out.setdefault(title, []).append(expr)
    return out


def test_the_gateway_dashboard_has_the_engine_panels_over_series_it_exports():
    metrics = available_metrics(gateway=True)
    queries = _queries(gateway=True)
    for title, series in PANELS.items():
        assert title in queries
        for name in series:
            assert metrics[name].type == "gauge" and metrics[name].labels == ("model", "replica")
            assert any(name in q for q in queries[title])
        assert all("by (replica)" in q for q in queries[title])
    assert not set(PANELS) & set(_queries(gateway=False))  # a server without upstreams has no such panels


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian: apt-get install prometheus)")
def test_the_engine_panels_queries_parse_as_promql(tmp_path):
    queries = _queries(gateway=True)
    rules = [{"record": f"tailguard:engine_panel_{i}", "expr": expand_variables(q)}
             for i, q in enumerate(q for title in PANELS for q in queries[title])]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "engine-panels", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules)} rules found" in done.stdout
