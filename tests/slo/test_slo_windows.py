"""Sliding windows: t-digest percentiles against exact ones, slot ageing, counts and rates, slicing by key."""

from __future__ import annotations

import numpy as np
import pytest

from tailguard.slo.profiles import Selector
from tailguard.slo.windows import Key, RequestSample, SlidingWindows


def test_window_percentiles_within_one_percent_of_exact_on_100k():
    rng = np.random.default_rng(7)
    n = 100_000
    e2e = rng.lognormal(mean=np.log(0.6), sigma=0.8, size=n)
    ttft = rng.lognormal(mean=np.log(0.12), sigma=0.5, size=n)
    bts = rng.choice(["chat", "batch", "finance"], size=n)
    t0 = 1_800_000_000.0
    w = SlidingWindows(slot_s=30, max_window_s=900)
    times = t0 + np.sort(rng.uniform(0, 899.0, size=n))  # spread over 30 slots and three keys
    for i in range(n):
        w.record(RequestSample(e2e=float(e2e[i]), ttft=float(ttft[i]), business_type=str(bts[i])), now=float(times[i]))
    now = float(times[-1])
    st = w.query(Selector(), window_s=900, now=now)
    assert st.total == n and st.n("e2e") == n and st.n("ttft") == n
    for q in (0.5, 0.95, 0.99):
        for name, vals in (("e2e", e2e), ("ttft", ttft)):
            exact = float(np.quantile(vals, q))
            got = st.quantile(name, q)
            assert abs(got - exact) / exact < 0.01, (name, q, got, exact)
    # A slice: one business type, same accuracy.
    mask = bts == "finance"
    fin = w.query(Selector(business_types=("finance",)), window_s=900, now=now)
    assert fin.n("e2e") == int(mask.sum())
    exact = float(np.quantile(e2e[mask], 0.99))
    assert abs(fin.quantile("e2e", 0.99) - exact) / exact < 0.01
    # A repeated query (closed slots cached) gives the same answer.
    assert w.query(Selector(), window_s=900, now=now).quantile("e2e", 0.99) == st.quantile("e2e", 0.99)


def test_slots_age_out_and_counts_follow_outcomes():
    t = [1000.0]
    w = SlidingWindows(slot_s=1, max_window_s=5, clock=lambda: t[0])
    for outcome in ("success", "success", "error", "aborted", "rejected", "invalid"):
        w.record(RequestSample(e2e=0.5, ttft=0.1, outcome=outcome))
    w.record(RequestSample(e2e=0.01, outcome="success", degraded=True, synthetic=True))  # a template answer
    st = w.query(window_s=5)
    assert (st.total, st.served, st.errors, st.aborted, st.rejected, st.degraded) == (7, 5, 1, 1, 1, 1)
    assert st.n("e2e") == 2  # successes only; the synthetic answer is not a latency sample
    assert st.error_rate == pytest.approx(1 / 5) and st.shed_rate == pytest.approx(1 / 6)
    assert st.n("ttft") == 4  # everything that reached the engine and had a first token
    t[0] += 3
    assert w.query(window_s=5).total == 7
    assert w.query(window_s=2).total == 0  # the last two slots only
    t[0] += 3
    w.advance()
    assert w.query(window_s=5).total == 0  # gone from the ring


def test_long_context_and_key_cap():
    w = SlidingWindows(slot_s=10, max_window_s=60, ctx_edges=(8192,), max_keys=2)
    w.record(RequestSample(e2e=1.0, input_tokens=100), now=5)
    w.record(RequestSample(e2e=3.0, input_tokens=20_000), now=5)
    assert w.query(Selector(min_input_tokens=8193), 60, now=5).n("e2e") == 1
    assert w.query(Selector(max_input_tokens=8192), 60, now=5).quantile("e2e", 0.5) == pytest.approx(1.0)
    for r in ("a", "b", "c"):  # two keys exist already: new ones fold into "other"
        w.record(RequestSample(e2e=1.0, region=r), now=5)
    assert w.query(Selector(regions=("other",)), 60, now=5).total == 3
    assert w.dropped_keys == 3


def test_the_interruption_rate_counts_streams_that_began():
    from tailguard.slo.profiles import Metric, Objective, SLOProfile

    t = [1000.0]
    w = SlidingWindows(slot_s=1, max_window_s=30, clock=lambda: t[0])
    for i in range(200):
        w.record(RequestSample(e2e=0.5, ttft=0.1, streamed=i < 100, interrupted=i in (3, 7)))
    w.record(RequestSample(e2e=None, outcome="error", streamed=False, interrupted=False))
    t[0] += 1.5
    w.advance()
    st = w.query(window_s=30)
    assert (st.streams, st.interrupted) == (100, 2) and st.interruption_rate == 0.02
    assert st.rate_samples("interruption_rate") == 100 and st.rate_samples("error_rate") == 201
    assert st.summary()["interruption_rate"] == 0.02
    # A fleet's slot carries the counts (and one from an earlier release, without them, still decodes).
    raw = next(iter(w.export_slots().values()))
    again = w.decode_slot(raw)
    assert sum(c.streams for c in again.cells.values()) == 100
    import json

    old = json.loads(raw)
    for cell in old["cells"]:
        cell["counts"] = cell["counts"][:10]
    assert sum(c.streams for c in w.decode_slot(json.dumps(old).encode()).cells.values()) == 0
    obj = Objective(metric=Metric.INTERRUPTION_RATE, threshold="0.1%", comparison="<")
    assert obj.describe().startswith("interruption_rate < 0.100%")
    SLOProfile(name="streams", objectives=(obj,))  # a rate: no percentile, a share below 1


def test_requests_never_taken_up_do_not_create_keys():
    # A flood of invalid requests (a 401 without a valid key, a malformed body), each claiming its own client and
    # region, must not fill the key table: they are counted under their business type and lane only.
    w = SlidingWindows(slot_s=10, max_window_s=60, max_keys=8)
    for i in range(100):
        w.record(RequestSample(e2e=None, outcome="invalid", client=f"made-up-{i}", region=f"r{i}"), now=5)
    w.drain()  # records are queued until a query, advance or drain applies them
    assert w.known_keys() == {Key("default", "default", "other", "other", 0)}
    assert w.dropped_keys == 0
    w.record(RequestSample(e2e=0.2, ttft=0.1, lane="vip", client="mobile", region="eu"), now=5)
    vip = w.query(Selector(lanes=("vip",)), 60, now=5)
    assert (vip.total, vip.n("ttft")) == (1, 1)
    assert w.query(Selector(clients=("mobile",)), 60, now=5).total == 1  # served: keeps its client
    assert w.query(Selector(), 60, now=5).total == 101  # every request is still counted


def test_a_full_key_table_keeps_lane_and_business_type():
    w = SlidingWindows(slot_s=10, max_window_s=60, max_keys=4)
    for i in range(4):  # served traffic of four clients fills the table
        w.record(RequestSample(e2e=0.2, ttft=0.1, client=f"c{i}"), now=5)
    for i in range(3):
        w.record(RequestSample(e2e=0.3, ttft=0.2, lane="vip", business_type="finance", client=f"n{i}",
                               region=f"x{i}"), now=5)
    w.drain()
    assert w.dropped_keys == 3
    # The lane and business type still select the folded traffic; only the client and region are "other".
    vip = w.query(Selector(lanes=("vip",), business_types=("finance",)), 60, now=5)
    assert (vip.total, vip.n("ttft")) == (3, 3)
    assert {k for k in w.known_keys() if k.lane == "vip"} == {Key("finance", "vip", "other", "other", 0)}


def test_regions_past_the_cap_fold_into_other():
    w = SlidingWindows(slot_s=10, max_window_s=60, max_regions=3)
    for i in range(10):
        w.record(RequestSample(e2e=0.2, ttft=0.1, region=f"r{i}"), now=5)
    w.record(RequestSample(e2e=0.2, ttft=0.1), now=5)  # the default region is never folded
    w.drain()
    assert {k.region for k in w.known_keys()} == {"r0", "r1", "r2", "other", "default"}
    assert w.query(Selector(regions=("other",)), 60, now=5).total == 7
    # Once the named regions leave the ring, new ones take their place.
    w.record(RequestSample(e2e=0.2, ttft=0.1, region="later"), now=125)
    w.drain()
    assert {k.region for k in w.known_keys()} == {"later"}
