"""Requests the service never took up cannot blind the SLO scopes: a flood of requests without a valid API key (each
refused with a 401) that make up their own X-Client and X-Region used to fill the windows' key table, after which every
new key, the VIP lane's included, was folded into one "other" key and the lane's scope and objectives saw nothing
for the whole window."""

from __future__ import annotations

from pathlib import Path

import httpx

from tailguard.policy.tenants import KeyFile
from tailguard.slo.monitor import SLOMonitor
from tailguard.slo.windows import RequestSample
from tests.serving_helpers import settle
from tests.slo_helpers import FakeClock, slo_config, slo_server

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def test_a_flood_of_unauthorized_requests_leaves_the_lane_scopes_their_traffic(tmp_path: Path):
    kf = KeyFile()
    vip_key = kf.add_key("acme", "vip")
    kf.save(tmp_path / "keys.yaml")
    clock = FakeClock()
    slo = slo_config(max_keys=16, scopes=[{"name": "all"}, {"name": "vip", "where": {"lanes": ["vip"]}}])
    with slo_server(tmp_path, clock, slo, keys_file=str(tmp_path / "keys.yaml")) as server, httpx.Client() as http:
        clock.advance(1.0)
        url = server.url + "/v1/chat/completions"
        for i in range(40):  # more made-up clients and regions than the key table holds
            r = http.post(url, json=BODY, headers={"X-Client": f"flood{i}", "X-Region": f"r{i}"})
            assert r.status_code == 401
        for _ in range(5):
            r = http.post(url, json=BODY, headers={"Authorization": f"Bearer {vip_key}", "X-Client": "mobile"})
            assert r.status_code == 200, r.text
        settle(server)
        mon = server.state.slo
        ev = mon.evaluate().to_dict()
        vip = ev["scopes"]["vip"]
        assert (vip["total"], vip["ttft"]["n"]) == (5, 5)
        assert ev["scopes"]["all"]["total"] == 45  # the refused requests are still counted
        assert mon.windows.dropped_keys == 0
        assert {k.client for k in mon.windows.known_keys()} == {"mobile", "other"}
        assert "r0" not in ev["regions"]


def test_many_regions_keep_the_evaluation_bounded():
    # Each region in the regions view costs a query every evaluation: 513 regions took an evaluation from under a
    # millisecond to ~100 ms. Past max_regions, new regions are counted as "other".
    clock = FakeClock()
    mon = SLOMonitor(slo_config(max_regions=8), clock=clock)
    clock.advance(1.0)
    for i in range(500):
        mon.record(RequestSample(e2e=0.2, ttft=0.1, region=f"r{i}"))
    queries = []
    query = mon.windows.query
    mon.windows.query = lambda *a, **kw: queries.append(1) or query(*a, **kw)  # type: ignore[method-assign]
    ev = mon.evaluate()
    assert sorted(ev.regions) == sorted([f"r{i}" for i in range(8)] + ["other"])
    assert ev.regions["other"]["total"] == 492 and ev.scopes["all"]["total"] == 500
    assert len(queries) < 20
