"""The SLO monitor's shed and degrade actions select by tenant (the API key's) as well as by business type and lane:
non-core tenants are shed, protected tenants are neither shed nor degraded (each action has its own list), and a VIP
lane is never touched unless the configuration says so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.policy.tenants import KeyFile
from tailguard.slo.monitor import SLOMonitor
from tailguard.slo.windows import RequestSample
from tests.serving_helpers import settle
from tests.slo_helpers import FakeClock, slo_config, slo_server

TEMPLATE = "Busy: a short answer for now."
ACTIONS = {
    "shed": {"non_core_business_types": ["batch"], "non_core_tenants": ["shop"], "protected_tenants": ["crawler"]},
    "degrade": {"mode": "template", "template": TEMPLATE, "probe_every": 0, "protected_tenants": ["bistro"]},
}


def _tick(mon: SLOMonitor, clock: FakeClock, e2e: float) -> str:
    clock.advance(1.0)
    for _ in range(10):
        mon.record(RequestSample(e2e=e2e, ttft=e2e / 2, queue_wait=0.0))
    return mon.evaluate().to_dict()["tier"]


def test_tenant_selectors_in_the_actions():
    clock = FakeClock()
    mon = SLOMonitor(slo_config(actions=ACTIONS), clock=clock)
    act = mon.actions
    assert act.shed_for("chat", "standard", "shop") is None  # green: nothing is shed
    assert _tick(mon, clock, 0.7) == "orange"
    assert act.shed_for("chat", "standard", "shop") is not None  # a non-core tenant
    assert act.shed_for("chat", "standard", "bistro") is None  # a core tenant, core lane and business type
    assert act.shed_for("chat", "standard", None) is None  # no key, no tenant selector
    assert act.shed_for("chat", "batch", "crawler") is None  # protection wins over a non-core lane...
    assert act.shed_for("batch", "standard", "crawler") is None  # ...and over a non-core business type
    assert act.shed_for("chat", "batch", "bistro") is not None  # the lane alone still sheds others
    assert act.shed_for("chat", "vip", "shop") is None  # a protected lane wins over a non-core tenant
    assert act.degradation_for("chat", "standard", tenant="bistro") is None  # orange: no degradation yet
    shed = next(r for r in mon.alerts(limit=None) if r["name"] == "shed")
    assert shed["details"]["non_core_tenants"] == ["shop"] and shed["details"]["protected_tenants"] == ["crawler"]

    assert _tick(mon, clock, 1.0) == "red"
    assert act.degradation_for("chat", "standard", tenant="shop") is not None
    assert act.degradation_for("chat", "standard", tenant="bistro") is None  # protected from degradation
    assert act.degradation_for("chat", "standard", tenant="crawler") is not None  # shed-protected only
    deg = next(r for r in mon.alerts(limit=None) if r["name"] == "degrade")
    assert deg["details"]["protected_tenants"] == ["bistro"]
    # Back to green: every tenant is served as usual again.
    for _ in range(4):
        _tick(mon, clock, 0.01)
    assert act.shed_for("chat", "standard", "shop") is None
    assert act.degradation_for("chat", "standard", tenant="shop") is None


def _post(url: str, key: str, max_tokens: int = 1) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                      json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})


def test_a_server_sheds_and_degrades_by_the_keys_tenant(tmp_path: Path):
    kf = KeyFile()
    keys = {name: kf.add_key(name, lane) for name, lane in (
        ("acme", "vip"), ("crawler", "batch"), ("shop", "standard"), ("bistro", "standard"), ("cafe", "standard"))}
    kf.save(tmp_path / "keys.yaml")
    clock, engine = FakeClock(), FakeEngine(FakeTiming(ttft=0.01, itl=0.0))
    with slo_server(tmp_path, clock, slo_config(actions=ACTIONS), engine, keys_file=str(tmp_path / "keys.yaml")) \
            as server:
        clock.advance(1.0)
        engine.timing.ttft = 1.0  # slow answers take the monitor to red
        with ThreadPoolExecutor(6) as pool:
            assert all(r.status_code == 200 for r in pool.map(lambda _: _post(server.url, keys["cafe"]), range(6)))
        settle(server)
        assert server.state.slo.evaluate().to_dict()["tier"] == "red"
        engine.timing.ttft = 0.0

        shed = _post(server.url, keys["shop"])  # a non-core tenant in a core lane
        assert shed.status_code == 429 and shed.json()["error"]["code"] == "slo_shed"
        assert "tenant 'shop'" in shed.json()["error"]["message"] and shed.headers["retry-after"] == "7"

        crawler = _post(server.url, keys["crawler"], 4)  # batch lane (non-core) but a shed-protected tenant
        assert crawler.status_code == 200
        assert crawler.json()["choices"][0]["message"]["content"] == TEMPLATE  # degraded: not degrade-protected

        cafe = _post(server.url, keys["cafe"], 4)
        assert cafe.json()["choices"][0]["message"]["content"] == TEMPLATE  # red degrades ordinary tenants

        for name in ("bistro", "acme"):  # a degrade-protected tenant, and the VIP lane (sheddable: false)
            r = _post(server.url, keys[name], 4)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] != TEMPLATE
            assert body["usage"]["completion_tokens"] == 4 and "system_fingerprint" not in body
        settle(server)
        rec = server.state.store.get(shed.headers["x-request-id"])
        assert rec["status"] == 429 and rec["slo_action"]["action"] == "shed" and rec["gateway"]["tenant"] == "shop"
        assert server.state.store.get(r.headers["x-request-id"])["degraded"] is False
