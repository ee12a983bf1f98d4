"""Many gateways, one view: gateways sharing a real Redis (a throwaway ``redis-server``) hold a tenant's rate limit
and a lane's in-flight budget together, their SLO windows merge into the fleet's percentiles, an alert fires once for
the fleet, a dead gateway's slots come back, and a Redis killed mid-run leaves every gateway serving (fail open)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastdigest import TDigest

from tailguard.engine.fake import FakeTiming
from tailguard.policy.fleet_state import RedisState
from tailguard.policy.lanes import LaneConfig, Lanes
from tailguard.policy.tenants import KeyFile, RateLimited, Tenant, TenantConfig
from tailguard.serving.server import ThreadedServer
from tailguard.slo.monitor import SLOMonitor
from tailguard.slo.windows import RequestSample, SlidingWindows
from tests.serving_helpers import fake_server, settle, wait_until
from tests.slo_helpers import FakeClock, slo_config


def _keys(tmp: Path, **tenants: dict) -> tuple[str, dict[str, str]]:
    kf = KeyFile()
    keys = {name: kf.add_key(name, **cfg) for name, cfg in tenants.items()}
    path = tmp / "keys.yaml"
    kf.save(path)
    return str(path), keys


@contextlib.contextmanager
def fleet(tmp: Path, n: int, timing: FakeTiming, **cfg) -> Iterator[list[ThreadedServer]]:
    """``n`` gateways (each with its own fake engine) sharing one Redis and one key file. Redis calls may take up
    to 2 s before a gateway decides alone: this process runs both gateways and their clients on a loaded machine."""
    cfg.setdefault("redis_timeout_s", 2.0)
    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(n):
            d = tmp / f"gw{i}"
            d.mkdir()
            servers.append(stack.enter_context(fake_server(d, timing, **cfg)))
        assert wait_until(lambda: all(s.state.ready for s in servers), timeout=20)
        yield servers


def _chat(url: str, key: str, client: httpx.Client, lane_check: bool = False, max_tokens: int = 1) -> httpx.Response:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return client.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


# --- rate limits --------------------------------------------------------------------------------------------------

def test_two_gateways_hold_a_tenants_rate_limit_together_within_5_percent(tmp_path, redis):
    rate, burst_s, run_s = 20.0, 1.0, 3.0
    keyfile, keys = _keys(tmp_path, acme={"lane": "standard", "requests_per_s": rate, "burst_s": burst_s})
    timing = FakeTiming(ttft=0.001, itl=0.001)
    with fleet(tmp_path, 2, timing, keys_file=keyfile, redis_url=redis.url) as gws:
        stamps: list[tuple[float, int]] = []
        per_gateway: dict[str, int] = {}
        lock = threading.Lock()
        stop = time.monotonic() + run_s

        def hammer(url: str) -> None:
            with httpx.Client() as c:
                while time.monotonic() < stop:
                    t = time.monotonic()
                    r = _chat(url, keys["acme"], c)
                    with lock:
                        stamps.append((t, r.status_code))
                        if r.status_code == 200:
                            per_gateway[url] = per_gateway.get(url, 0) + 1

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(hammer, [g.url for g in gws]))
        codes = [c for _, c in stamps]
        assert set(codes) <= {200, 429}
        t0, t1 = min(t for t, _ in stamps), max(t for t, c in stamps if c == 200)
        allowed = rate * burst_s + rate * (t1 - t0)  # a full bucket, then the sustained rate
        served = codes.count(200)
        assert codes.count(429) > served  # the load was well over the limit
        assert abs(served - allowed) <= 0.05 * allowed, (served, allowed)
        # Both gateways served part of it from the one bucket (each alone would have let ``allowed`` through).
        assert all(n > 0.2 * served for n in per_gateway.values()), per_gateway


def test_refunds_go_back_to_the_shared_bucket(redis):
    async def run() -> None:
        a, b = RedisState(redis.url, gateway_id="a"), RedisState(redis.url, gateway_id="b")
        cfg = TenantConfig(tokens_per_s=1.0, burst_s=100.0)  # 100 tokens; refills 1 a second (negligible here)
        ta, tb = Tenant("t", cfg), Tenant("t", cfg)
        assert await a.charge(ta, 80) is True
        with pytest.raises(RateLimited):
            await b.charge(tb, 80)  # the other gateway sees the same bucket
        a.refund(ta, 60, shared=True)  # 60 tokens charged but never produced
        await asyncio.wait_for(asyncio.gather(*a._tasks), 5)
        assert await b.charge(tb, 70) is True
        await a.close()
        await b.close()

    asyncio.run(run())


# --- lane budgets -------------------------------------------------------------------------------------------------

def test_a_lanes_fleet_in_flight_budget_holds_across_two_gateways(tmp_path, redis):
    keyfile, keys = _keys(tmp_path, shop={"lane": "standard"}, acme={"lane": "vip"})
    timing = FakeTiming(ttft=0.3, itl=0.02)  # each request holds its slot ~0.5 s
    # The fleet's capacity is 4 (configured the same on every gateway): 1 reserved for VIP, 3 general.
    cap = {"max_concurrent": 4, "reserved_share": 0.25, "burst_share": 0.0}
    with fleet(tmp_path, 2, timing, keys_file=keyfile, redis_url=redis.url, capacity=cap) as gws:
        peak = 0
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, sum(g.state.lanes.lanes["standard"].in_use for g in gws))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with httpx.Client() as c, ThreadPoolExecutor(12) as pool:
            futs = [pool.submit(_chat, gws[i % 2].url, keys["shop"], c, max_tokens=10) for i in range(12)]
            time.sleep(0.25)  # standard holds the fleet (it borrows the idle reserve)
            vip = _chat(gws[1].url, keys["acme"], c, max_tokens=1)
            answers = [f.result() for f in futs]
            codes = [r.status_code for r in answers]
        done.set()
        watcher.join()
        assert codes == [200] * 12 and vip.status_code == 200
        # The fleet never held more than its capacity for standard, although each gateway alone would take 4.
        assert peak == 4, peak
        # VIP got its fleet reserve at once, while standard requests waited for each other's slots (same run).
        for g in gws:
            settle(g)

        def lane_wait(r: httpx.Response) -> float:
            rec = next(filter(None, (g.state.store.get(r.headers["x-request-id"]) for g in gws)))
            return rec["gateway"]["lane_wait"]

        longest = max(lane_wait(r) for r in answers)
        assert lane_wait(vip) < 0.25 * longest, (lane_wait(vip), longest)
        # Each gateway's SLO monitor judges the fleet: both see all 13 requests (the first round publishes).
        for _ in range(2):
            for g in gws:
                g.state.slo.evaluate()
        assert [next(iter(g.state.slo.last.scopes.values()))["total"] for g in gws] == [13, 13]
        assert all(g.state.shared.fallbacks == 0 for g in gws)


def test_a_dead_gateways_slots_come_back_when_its_leases_expire(redis):
    lanes = {"standard": LaneConfig()}

    async def run() -> None:
        dead = RedisState(redis.url, gateway_id="dead", lease_ttl_s=0.6)
        live = RedisState(redis.url, gateway_id="live", lease_ttl_s=0.6)
        a, b = Lanes(lanes, 2, fleet=dead), Lanes(lanes, 2, fleet=live)
        await a.acquire("standard")
        await a.acquire("standard")
        assert await live.fleet_in_use(["standard"]) == {"standard": 2}
        dead._heartbeat.cancel()  # the gateway dies: nobody renews its leases, nobody releases them
        assert await live.take_slot("standard", b.rule) is None  # the fleet is full while the leases live
        await asyncio.wait_for(b.acquire("standard"), 10)  # queued in b until a dead lease expires
        assert await live.fleet_in_use(["standard"]) == {"standard": 1}  # both dead leases are gone
        # A live gateway's leases are renewed: they outlast their TTL.
        await asyncio.sleep(1.0)
        assert await live.fleet_in_use(["standard"]) == {"standard": 1}
        b.release("standard")
        await live.close()
        await dead.client.aclose()

    asyncio.run(run())


# --- fleet SLO judgement ------------------------------------------------------------------------------------------

def test_merged_digests_give_the_fleet_percentile():
    clock = FakeClock()
    rng = np.random.default_rng(7)
    a_vals = rng.lognormal(-1.5, 0.4, 3000)
    b_vals = rng.lognormal(-0.5, 0.6, 1000)  # the slower gateway: it owns the fleet's tail
    wa, wb = SlidingWindows(slot_s=1.0, max_window_s=10, clock=clock), SlidingWindows(slot_s=1.0, max_window_s=10,
                                                                                      clock=clock)
    for i, v in enumerate(a_vals):
        wa.record(RequestSample(e2e=float(v), ttft=float(v) / 3), now=clock.t + (i % 3))
    for i, v in enumerate(b_vals):
        wb.record(RequestSample(e2e=float(v), ttft=float(v) / 3), now=clock.t + (i % 3))
    now = clock.t + 2.5
    parts = [wa.decode_slot(raw) for w in (wa, wb) for raw in w.export_slots(now).values()]
    st = wa.merged(parts).query(window_s=5, now=now)
    again = wa.merged(parts).query(window_s=5, now=now)  # decoded slots are kept between evaluations: unchanged
    assert (again.total, again.quantile("e2e", 0.99)) == (st.total, st.quantile("e2e", 0.99))
    every = np.concatenate([a_vals, b_vals])
    assert st.total == 4000 and st.n("e2e") == 4000
    reference = TDigest.from_values(every.tolist(), max_centroids=200)
    for q in (0.5, 0.95, 0.99):
        exact = float(np.quantile(every, q))
        assert st.quantile("e2e", q) == pytest.approx(exact, rel=0.02)
        assert st.quantile("e2e", q) == pytest.approx(reference.quantile(q), rel=0.02)
    # Neither gateway alone sees the fleet's P99.
    alone = [w.query(window_s=5, now=now).quantile("e2e", 0.99) for w in (wa, wb)]
    assert all(abs(x - float(np.quantile(every, 0.99))) > 0.05 * float(np.quantile(every, 0.99)) for x in alone)


def test_an_alert_fires_once_for_the_fleet(tmp_path, redis):
    clock = FakeClock()
    out = tmp_path / "hook.jsonl"
    script = f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read() + '\\n')"
    cfg = slo_config(actions={"inline_hooks": True, "scale_out": {"command": [sys.executable, "-c", script]}})
    sunk: list[list[dict]] = [[], []]
    mons = [SLOMonitor(cfg, clock=clock, sinks=[sunk[i].append]) for i in range(2)]
    for i, m in enumerate(mons):
        m.join_fleet(redis.url, gateway_id=f"gw{i}")
    clock.advance(1.0)
    for m in mons:
        for _ in range(3):  # min_samples is 5: neither gateway alone has enough to judge
            m.record(RequestSample(e2e=0.45, ttft=0.2, queue_wait=0.0))
    for m in mons:  # the first round publishes (the first to evaluate has not seen the other yet)
        m.evaluate()
    tiers = [m.evaluate().to_dict()["tier"] for m in mons]
    assert tiers == ["yellow", "yellow"]  # both judge the fleet (6 samples at 0.45 s > 0.3 s)
    assert [m.evaluate().to_dict()["tier"] for m in mons] == tiers  # a third round changes nothing
    raised = [[r for r in s if r["kind"] == "alert" and r["event"] == "raised"] for s in sunk]
    assert sorted(len(r) for r in raised) == [0, 1]  # one record, from the leader
    actions = [r for s in sunk for r in s if r["kind"] == "action"]
    assert [a["name"] for a in actions] == ["scale_out"]
    assert len(out.read_text().splitlines()) == 1  # the scale hook ran once for the fleet
    leaders = [m.fleet.leader for m in mons]
    assert sorted(leaders) == [False, True]
    counted = [m.metrics.alerts.labels("all", "yellow")._value.get() for m in mons]
    assert sorted(counted) == [0, 1]
    # The leader stops: the other takes the lead at its next evaluation and fires the fleet's next transition.
    lead, other = (mons[0], mons[1]) if leaders[0] else (mons[1], mons[0])
    lead.close()
    clock.advance(1.0)
    for _ in range(6):
        other.record(RequestSample(e2e=0.01, ttft=0.005, queue_wait=0.0))
    other.evaluate()
    assert other.fleet.leader
    clock.advance(1.0)
    for _ in range(6):
        other.record(RequestSample(e2e=0.01, ttft=0.005, queue_wait=0.0))
    assert other.evaluate().to_dict()["tier"] == "green"  # clear_after: 2
    cleared = [r for s in sunk for r in s if r["kind"] == "alert" and r["event"] == "cleared"]
    assert len(cleared) == 1 and cleared[0] in sunk[mons.index(other)]
    # Alone (no fleet), the same samples would not be judged at all.
    solo = SLOMonitor(cfg, clock=clock)
    for _ in range(3):
        solo.record(RequestSample(e2e=0.45, ttft=0.2, queue_wait=0.0))
    assert solo.evaluate().to_dict()["tier"] == "green"
    other.close()
    solo.close()


def test_a_bad_redis_url_is_refused_with_a_clear_error():
    from pydantic import ValidationError

    from tailguard.serving.config import ServerConfig

    with pytest.raises(ValidationError, match="redis_url must be a redis://"):
        ServerConfig(redis_url="http://127.0.0.1:6379")
    assert ServerConfig(redis_url="redis://127.0.0.1:6379/0").redis_url == "redis://127.0.0.1:6379/0"


# --- Redis goes away ----------------------------------------------------------------------------------------------

def test_redis_killed_mid_run_gateways_keep_serving(tmp_path, redis):
    keyfile, keys = _keys(tmp_path, acme={"lane": "standard", "requests_per_s": 1000.0})
    timing = FakeTiming(ttft=0.002, itl=0.001)
    with fleet(tmp_path, 2, timing, keys_file=keyfile, redis_url=redis.url, capacity={"max_concurrent": 8}) as gws:
        with httpx.Client() as c:
            before = [_chat(g.url, keys["acme"], c).status_code for g in gws for _ in range(5)]
            redis.kill()
            # A gateway waiting on the dead Redis would show as the client's timeout (30 s), not as a 200.
            after = [_chat(g.url, keys["acme"], c).status_code for g in gws for _ in range(20)]
            metrics = [c.get(g.url + "/metrics").text for g in gws]
        assert before == [200] * 10
        assert after == [200] * 40  # fail open: never a 5xx
        assert all(g.state.shared.down and g.state.shared.fallbacks > 0 for g in gws)
        assert all("tailguard_fleet_fallbacks_total" in m for m in metrics)
