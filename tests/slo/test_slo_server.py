"""The SLO monitor inside the server: a fake engine whose latency the test sets, a fake clock, and evaluations by
hand. Tiers rise and fall with hysteresis; scale-out, shed and degrade take effect at the API and are undone; dry
run changes nothing but the record; alerts reach the store, GET /v1/alerts and /metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import httpx
import pytest

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.serving.server import ThreadedServer
from tailguard.slo.config import DegradeConfig
from tests.serving_helpers import ADMIN, make_config, settle
from tests.slo_helpers import FakeClock, WebhookReceiver, burst, chat, slo_config, slo_server


def _phase(server, clock: FakeClock, engine: FakeEngine, ttft: float, n: int = 6) -> str:
    """One phase: a new slot, ``n`` concurrent requests at latency ``ttft``, one evaluation; returns the tier."""
    clock.advance(1.0)
    engine.timing.ttft = ttft
    for r in burst(server, n):
        assert r.status_code == 200, r.text
    settle(server)  # a response reaches the client before its record closes: judge the phase once all are in
    return server.state.slo.evaluate().to_dict()["tier"]


def _names(records, kind):
    return [(r["name"], r["event"]) for r in records if r["kind"] == kind]


def test_tiers_and_actions_end_to_end(tmp_path):
    clock = FakeClock()
    engine = FakeEngine(FakeTiming(ttft=0.01, itl=0.0))
    with WebhookReceiver() as hook:
        slo = slo_config(actions={"scale_out": {"webhook_url": hook.url}})
        with slo_server(tmp_path, clock, slo, engine) as server:
            mon = server.state.slo
            assert _phase(server, clock, engine, 0.01) == "green"
            assert _phase(server, clock, engine, 0.40) == "yellow"
            assert hook.wait_for(1)[0]["action"] == "scale_out"
            assert hook.bodies[0]["replicas_delta_pct"] == 10.0
            assert hook.bodies[0]["figures"]["tier_value"] > 0.3
            # Hysteresis band (0.21 s .. 0.3 s): neither raises nor clears.
            assert _phase(server, clock, engine, 0.25) == "yellow"
            assert chat(server.url, business_type="batch").status_code == 200  # not shedding before orange

            assert _phase(server, clock, engine, 0.70) == "orange"
            shed = chat(server.url, business_type="batch")
            assert shed.status_code == 429
            assert shed.headers["retry-after"] == "7"
            err = shed.json()["error"]
            assert err["code"] == "slo_shed" and err["type"] == "rate_limit_error" and "orange" in err["message"]
            assert chat(server.url, business_type="chat").status_code == 200  # core traffic still served
            # A lane is a property of the API key: a header claiming the protected lane does not escape shedding.
            assert chat(server.url, business_type="batch", **{"x-lane": "vip"}).status_code == 429

            assert _phase(server, clock, engine, 1.0) == "red"
            r = chat(server.url)
            assert r.status_code == 200
            assert r.json()["choices"][0]["message"]["content"] == "Busy: a short answer for now."
            assert r.json()["tailguard"]["degraded"]["mode"] == "template"
            assert r.headers["x-tailguard-degraded"].startswith("template; tier=red; action=")
            probe = chat(server.url)  # every 2nd affected request is served by the engine, to keep measuring
            assert "x-tailguard-degraded" not in probe.headers and probe.json()["choices"][0]["message"]["content"]
            s = chat(server.url, stream=True)
            assert "Busy: a short answer for now." in s.text and s.text.rstrip().endswith("data: [DONE]")
            assert s.headers["x-tailguard-degraded"].startswith("template")
            settle(server)
            rec = server.state.store.get(r.headers["x-request-id"])
            assert rec["degraded"] is True and rec["slo_action"]["action"] == "degrade"
            assert rec["outcome"] == "success"
            shed_rec = server.state.store.get(shed.headers["x-request-id"])
            assert shed_rec["outcome"] == "rejected" and shed_rec["status"] == 429
            assert shed_rec["slo_action"]["action"] == "shed"
            # Once per escalation: yellow -> orange -> red asked to scale out once.
            time.sleep(0.2)
            assert [b["action"] for b in hook.bodies] == ["scale_out"]

            # Recovery: every 2nd affected request is a probe served by the engine; two good evaluations clear.
            engine.timing.ttft = 0.01
            clock.advance(1.0)
            rs = burst(server, 12)
            assert sum("x-tailguard-degraded" in x.headers for x in rs) == 6  # the others are probes
            settle(server)
            assert mon.evaluate().to_dict()["tier"] == "red"  # clear_after: 2
            clock.advance(1.0)
            burst(server, 12)
            settle(server)
            assert mon.evaluate().to_dict()["tier"] == "green"
            assert [b["action"] for b in hook.wait_for(2)] == ["scale_out", "scale_in"]
            assert hook.bodies[1]["replicas_delta_pct"] == -10.0
            back = chat(server.url)
            assert "x-tailguard-degraded" not in back.headers and "degraded" not in back.json()["tailguard"]
            assert chat(server.url, business_type="batch").status_code == 200

            recs = mon.alerts(limit=None)
            assert _names(recs, "alert") == [
                ("tier_yellow", "raised"), ("tier_orange", "raised"), ("tier_red", "raised"),
                ("tier_red", "cleared"), ("tier_orange", "cleared"), ("tier_yellow", "cleared")]
            assert _names(recs, "action") == [
                ("scale_out", "started"), ("shed", "started"), ("degrade", "started"),
                ("scale_out", "undone"), ("shed", "undone"), ("degrade", "undone")]
            # Each action carries the figures that triggered it and the alert that caused it.
            started = {r["name"]: r for r in recs if r["kind"] == "action" and r["event"] == "started"}
            assert started["degrade"]["figures"]["tier_value"] > 0.9
            assert started["degrade"]["alert_id"] == next(
                r["id"] for r in recs if r["name"] == "tier_red" and r["event"] == "raised")
            undone = next(r for r in recs if r["name"] == "shed" and r["event"] == "undone")
            assert undone["id"] == started["shed"]["id"] and undone["ended_at"] > undone["started_at"]

            # Stored, and listed by the API.
            assert server.state.store.flush()
            stored = server.state.store.alerts(limit=1000)
            assert {(r["id"], r["event"]) for r in recs} <= {(r["id"], r["event"]) for r in stored}
            api = httpx.get(server.url + "/v1/alerts", params={"kind": "action"}, headers=ADMIN).json()
            assert [(r["name"], r["event"]) for r in api["data"]] == _names(recs, "action")
            assert api["tier"] == "green" and api["active"] == [] and api["dry_run"] is False
            metrics = httpx.get(server.url + "/metrics").text
    assert 'tailguard_slo_alerts_total{scope="all",tier="red"} 1.0' in metrics
    assert 'tailguard_slo_actions_total{action="shed",dry_run="0",event="started"} 1.0' in metrics
    assert 'tailguard_slo_requests_affected_total{action="degrade",mode="template"}' in metrics
    assert 'tailguard_slo_requests_affected_total{action="shed",mode="shed"} 2.0' in metrics
    assert 'tailguard_slo_tier{scope="all"} 0.0' in metrics
    assert 'tailguard_slo_hook_calls_total{result="ok",target="webhook"} 2.0' in metrics
    promtool = shutil.which("promtool")
    if promtool:  # the combined exposition must stay valid
        out = subprocess.run([promtool, "check", "metrics"], input=metrics.encode(), capture_output=True, timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr


def test_red_truncates_by_default_and_the_answer_says_so(tmp_path):
    """The default red action is one a user would accept unread: a real answer, capped at max_tokens, that a client
    can tell from a full one. The canned template is opt-in."""
    clock = FakeClock()
    engine = FakeEngine(FakeTiming(ttft=0.01, itl=0.0))
    slo = slo_config()
    slo.actions.degrade = DegradeConfig()  # the shipped default, not the helper's template
    assert slo.actions.degrade.mode == "truncate" and slo.actions.degrade.max_tokens == 64
    with slo_server(tmp_path, clock, slo, engine) as server:
        assert _phase(server, clock, engine, 1.0) == "red"
        engine.timing.ttft = 0.01
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-business-type": "chat"},
                       timeout=30)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 64 and out["choices"][0]["finish_reason"] == "length"
        assert r.headers["x-tailguard-degraded"].startswith("truncate; tier=red; action=")
        settle(server)
        rec = server.state.store.get(r.headers["x-request-id"])
        assert rec["degraded"] is True and rec["output_tokens"] == 64
        assert rec["slo_action"]["mode"] == "truncate"
        degrade = next(x for x in server.state.slo.alerts(limit=None) if x["name"] == "degrade")
        assert degrade["details"]["mode"] == "truncate" and degrade["details"]["max_tokens"] == 64


def test_dry_run_changes_nothing_but_the_record(tmp_path):
    clock = FakeClock()
    engine = FakeEngine(FakeTiming(ttft=0.01, itl=0.0))
    with WebhookReceiver() as hook:
        slo = slo_config(actions={"dry_run": True, "scale_out": {"webhook_url": hook.url}})
        with slo_server(tmp_path, clock, slo, engine) as server:
            assert _phase(server, clock, engine, 1.0) == "red"
            assert chat(server.url, business_type="batch").status_code == 200
            r = chat(server.url)
            assert r.json()["choices"][0]["message"]["content"] != "Busy: a short answer for now."
            assert "x-tailguard-degraded" not in r.headers
            recs = server.state.slo.alerts(limit=None)
            assert _names(recs, "action") == [("scale_out", "started"), ("shed", "started"), ("degrade", "started")]
            assert all(r["dry_run"] for r in recs if r["kind"] == "action")
            assert next(r for r in recs if r["name"] == "scale_out")["details"]["hook"] == "dry_run"
            settle(server)
            assert server.state.store.get(r.headers["x-request-id"])["slo_action"] is None
            assert httpx.get(server.url + "/v1/alerts", headers=ADMIN).json()["dry_run"] is True
    time.sleep(0.1)
    assert hook.bodies == []


def test_background_evaluation_and_dashboard_data(tmp_path):
    """Real clock, short windows: the server's own evaluation task notices a slow engine."""
    engine = FakeEngine(FakeTiming(ttft=0.4, itl=0.0))
    slo = slo_config(slot_s=0.5, peak_window_s=5, offpeak_window_s=5, eval_interval_s=0.1)
    with slo_server(tmp_path, None, slo, engine) as server:
        burst(server, 6)
        deadline = time.monotonic() + 10
        while server.state.slo.last is None or server.state.slo.last.tier < 1:
            assert time.monotonic() < deadline, "the background evaluation never raised yellow"
            time.sleep(0.05)
        data = httpx.get(server.url + "/slo/data", headers=ADMIN).json()
        assert data["tier"] == "yellow"
        assert data["evaluation"]["scopes"]["all"]["e2e"]["n"] == 6
        assert data["history"] and data["history"][-1]["e2e"]["p99"] > 0.3
        page = httpx.get(server.url + "/slo")
        assert page.status_code == 200 and 'id="tier"' in page.text and "/data" in page.text


def test_alerts_api_rejects_bad_queries_and_monitor_can_be_off(tmp_path):
    with slo_server(tmp_path, FakeClock()) as server:
        for params in ({"limit": "0"}, {"limit": "x"}, {"kind": "nope"}, {"since": "-1"}):
            r = httpx.get(server.url + "/v1/alerts", params=params, headers=ADMIN)
            assert r.status_code == 400, params
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(server.url + "/v1/alerts", headers=ADMIN).json()["data"] == []
    with slo_server(tmp_path / "off", None, slo_config(enabled=False)) as server:
        assert server.state.slo is None
        assert chat(server.url).status_code == 200
        assert httpx.get(server.url + "/slo").status_code == 404
        assert httpx.get(server.url + "/v1/alerts", headers=ADMIN).json() == {"object": "list", "enabled": False, "data": []}


def test_lane_client_region_headers_reach_windows_and_record(tmp_path):
    clock = FakeClock()
    # X-Lane counts only behind a proxy the operator trusts to set it (otherwise lanes come from API keys).
    with slo_server(tmp_path, clock, trust_lane_header=True) as server:
        r = chat(server.url, **{"x-lane": "vip", "x-client": "mobile", "x-region": "eu-west"})
        settle(server)
        rec = server.state.store.get(r.headers["x-request-id"])
        assert (rec["lane"], rec["client"], rec["region"]) == ("vip", "mobile", "eu-west")
        ev = server.state.slo.evaluate()
        assert ev.regions["eu-west"]["e2e"]["n"] == 1
        keys = server.state.slo.windows.known_keys()
        assert any(k.lane == "vip" and k.client == "mobile" for k in keys)


@pytest.mark.parametrize("status", [429, 503])
def test_shed_status_is_configurable(tmp_path, status):
    clock = FakeClock()
    engine = FakeEngine(FakeTiming(ttft=0.7, itl=0.0))
    slo = slo_config(actions={"shed": {"status": status}, "degrade": {"enabled": False}})
    with slo_server(tmp_path, clock, slo, engine) as server:
        burst(server, 6)
        assert server.state.slo.evaluate().to_dict()["tier"] == "orange"
        r = chat(server.url, business_type="batch")
        assert r.status_code == status and int(r.headers["retry-after"]) >= 1
        assert json.loads(r.text)["error"]["code"] == "slo_shed"


def test_shed_matches_the_business_type_even_when_its_metric_label_is_capped(tmp_path):
    """The Prometheus label set is capped (an allowlist, or 32 types seen): a type outside it is counted as 'other'.
    Shedding must still see the type the client sent, or non-core traffic escapes orange by its label alone."""
    clock = FakeClock()
    engine = FakeEngine(FakeTiming(ttft=0.7, itl=0.0))
    slo = slo_config(actions={"degrade": {"enabled": False}})
    cfg = make_config(tmp_path, slo=slo, business_types=["chat"])  # "batch" is not a metric label here
    with ThreadedServer(cfg, engine, slo_clock=clock) as server:
        burst(server, 6)
        assert server.state.slo.evaluate().to_dict()["tier"] == "orange"
        r = chat(server.url, business_type="batch")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "slo_shed" and "'batch'" in r.json()["error"]["message"]
        assert chat(server.url, business_type="chat").status_code == 200
        settle(server)
        rec = server.state.store.get(r.headers["x-request-id"])
        assert rec["slo_action"]["action"] == "shed" and rec["business_type"] == "other"  # the label stays capped


def test_alerts_limit_must_be_a_whole_number(tmp_path):
    with slo_server(tmp_path, FakeClock()) as server:
        for limit in ("1.5", "1e3", "nan", "-1", "9" * 5000):
            r = httpx.get(server.url + "/v1/alerts", params={"limit": limit}, headers=ADMIN)
            assert r.status_code == 400, (limit, r.text)
            assert r.json()["error"]["param"] == "limit"
        assert httpx.get(server.url + "/v1/alerts", params={"limit": "10"}, headers=ADMIN).status_code == 200
