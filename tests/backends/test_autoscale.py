"""The replica provider following the gateway's backlog: the decision on scripted load samples, then a real gateway
whose queued requests start a replica (which serves them) and whose quiet stops it, drained."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from tailguard.backends.upstream.autoscale import LoadSample, ReplicaAutoscaler
from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.serving.backend_factory import build_backend
from tailguard.serving.server import ThreadedServer
from tailguard.slo.config import AutoscaleConfig
from tests.backends.test_provider import FAKE_REPLICA, alive
from tests.serving_helpers import make_config, settle, wait_until
from tests.slo.test_slo_provider import stream, tokens
from tests.slo_helpers import slo_config

QUIET = LoadSample(oldest_wait_s=0.0, gateway_waiting=0, upstream_waiting=0.0, busy=4, capacity=32, replicas=2,
                   removable_capacity=16)


def scaler(hold: bool = False, **cfg: float) -> ReplicaAutoscaler:
    base = {"wait_s": 1.0, "sustain_s": 2.0, "cooldown_s": 10.0, "scale_in_after_s": 20.0,
            "scale_in_utilization": 0.5, "queued_per_replica": 4.0}
    return ReplicaAutoscaler(AutoscaleConfig(**{**base, **cfg}), provider=None, sample=lambda: QUIET,  # type: ignore[arg-type]
                             hold=lambda: hold)


def test_a_backlog_held_for_sustain_s_starts_one_replica_then_waits_out_the_cooldown():
    a = scaler()
    waiting = dataclasses.replace(QUIET, oldest_wait_s=1.5, gateway_waiting=3, busy=32, removable_capacity=None)
    short = dataclasses.replace(waiting, oldest_wait_s=0.5)
    assert a.decide(short, 0.0) == 0  # requests wait, but not yet wait_s
    assert a.decide(waiting, 1.0) == 0  # backlog from now on
    assert a.decide(waiting, 2.9) == 0
    assert a.decide(short, 3.0) == 0  # it went away: the sustain timer starts again
    assert a.decide(waiting, 3.5) == 0
    assert a.decide(waiting, 5.5) == 1
    a._last_step = 5.5
    a._backlog_since = None
    assert a.decide(waiting, 8.0) == 0 and a.decide(waiting, 15.4) == 0  # cooldown
    assert a.decide(waiting, 15.6) == 1
    full = scaler(sustain_s=0.0)  # at max_replicas: nothing to ask for
    assert full.decide(dataclasses.replace(waiting, can_add=False), 0.0) == 0
    assert full.decide(waiting, 0.1) == 1
    # The replicas' own queues count as backlog too: 4 a replica.
    b = scaler(sustain_s=0.0)
    assert b.decide(dataclasses.replace(QUIET, upstream_waiting=7.0), 0.0) == 0
    assert b.decide(dataclasses.replace(QUIET, upstream_waiting=8.0), 0.0) == 1


def test_the_newest_replica_stops_only_when_the_others_carry_the_load_for_scale_in_after_s():
    a = scaler()
    assert a.decide(QUIET, 0.0) == 0  # 4 busy <= 0.5 x 16 left
    assert a.decide(QUIET, 19.9) == 0
    assert a.decide(QUIET, 20.0) == -1
    b = scaler()
    assert b.decide(QUIET, 0.0) == 0
    assert b.decide(dataclasses.replace(QUIET, busy=9), 10.0) == 0  # would not fit at 50%: the timer resets
    assert b.decide(QUIET, 11.0) == 0 and b.decide(QUIET, 30.0) == 0 and b.decide(QUIET, 31.0) == -1
    for not_now in (dataclasses.replace(QUIET, removable_capacity=None),  # nothing the provider could stop
                    dataclasses.replace(QUIET, gateway_waiting=1, oldest_wait_s=0.1),  # something waits
                    dataclasses.replace(QUIET, upstream_waiting=1.0)):
        c = scaler()
        assert c.decide(not_now, 0.0) == 0 and c.decide(not_now, 100.0) == 0
    held = scaler(hold=True)  # the tiers' scale-out is in effect: their replicas stay
    assert held.decide(QUIET, 0.0) == 0 and held.decide(QUIET, 100.0) == 0


def test_autoscale_config_is_validated():
    with pytest.raises(ValueError):
        AutoscaleConfig(scale_in_utilization=1.5)
    with pytest.raises(ValueError):
        AutoscaleConfig(wait_s=0)


def test_a_gateways_queue_starts_a_replica_that_serves_it_and_its_quiet_stops_it(tmp_path):
    autoscale = {"wait_s": 0.3, "sustain_s": 0.1, "cooldown_s": 0.5, "scale_in_after_s": 1.0,
                 "scale_in_utilization": 1.0, "interval_s": 0.05}
    slo = slo_config(actions={"scale_out": {"provider": {
        "command": FAKE_REPLICA, "max_replicas": 1, "max_concurrent": 4, "start_timeout_s": 10,
        "drain_timeout_s": 10, "stop_grace_s": 2, "log_dir": str(tmp_path / "replicas"), "autoscale": autoscale}}})
    with FakeServerProcess(FakeScript(ttft=0.01, itl=0.05, max_lifetime=120)) as static:
        config = make_config(tmp_path, upstreams=[{"url": static.url, "max_concurrent": 2}], slo=slo,
                             routing={"health_interval_s": 0.5},
                             capacity={"reserved_share": 0.0, "burst_share": 0.0})
        with ThreadedServer(config, engine_factory=lambda: build_backend(config)) as gw:
            assert wait_until(lambda: gw.state.ready, timeout=30)
            state = gw.state
            assert state.autoscaler is not None and state.lanes.capacity == 2
            # Six 40-token streams (2 s each) on two slots: four wait at the gateway, and a replica starts for them.
            with ThreadPoolExecutor(6) as ex:
                futs = [ex.submit(stream, gw.url, 40) for _ in range(6)]
                assert wait_until(lambda: any(r.state == "serving" for r in state.provider.replicas()), timeout=15)
                (rep,) = state.provider.replicas()
                assert state.lanes.capacity == 6
                results = [f.result() for f in futs]
            for status, lines, _ in results:
                assert status == 200 and lines[-1] == "data: [DONE]" and tokens(lines) == 40
            settle(gw)
            served_by = [state.store.get(rid)["gateway"]["replica"] for _, _, rid in results]
            assert served_by.count(rep.name) >= 2, served_by  # the waiting requests went to the new replica
            # Quiet: the new replica stops, drained, a second (scale_in_after_s) after the load is gone.
            assert wait_until(lambda: not state.provider.replicas(), timeout=15)
            assert not alive(rep.pid) and state.lanes.capacity == 2
            steps = [r for r in state.slo.alerts(limit=None) if r["kind"] == "hook"]
            assert [(r["name"], r["event"], r["scope"]) for r in steps] == [
                ("scale_out", "ok", "backlog"), ("scale_in", "ok", "backlog")]
            out, back = steps
            assert out["figures"]["gateway_waiting"] >= 1 and out["figures"]["oldest_wait_s"] >= 0.3
            assert out["details"]["trigger"] == "backlog" and out["details"]["replicas_delta"] == 1
            assert back["details"]["cut_off_requests"] == 0 and back["figures"]["gateway_waiting"] == 0
            assert [a for _, a in state.autoscaler.steps] == ["scale_out", "scale_in"]
