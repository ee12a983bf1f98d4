"""The upstream queue feeds admission, with real replica processes: a ``tailguard serve --model fake`` replica that
runs two sequences at a time reports its waiting queue on /metrics (``tailguard_num_requests_waiting``); once the
gateway reads a queue over the limit, new batch requests wait in the gateway's lane queue (where VIP goes first)
rather than in the replica's FIFO, a VIP request is still admitted at once, and the batch requests are admitted as
the replica drains; once the replica has shown how many it runs, a burst is held at the gateway at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.serving.test_gateway import chat, gateway, keyfile, metric_value, record, replica
from tests.serving_helpers import settle, wait_until


def test_upstream_queue_keeps_batch_at_the_gateway_while_vip_passes(tmp_path):
    path, keys = keyfile(tmp_path)
    with replica(tmp_path, "a", ttft=0.01, itl=0.02, max_num_seqs=2) as a, \
            gateway(tmp_path, [a.url], per_replica=40, keys_file=str(path),
                    routing={"health_interval_s": 0.3, "queue_scrape_s": 0.1},
                    capacity={"upstream_queue_limit": 1}) as gw:
        lanes = gw.state.lanes
        batch = lanes.lanes["batch"]
        assert lanes.upstream_full is not None and not lanes.gate_closed()
        with httpx.Client(timeout=60) as c, ThreadPoolExecutor(24) as pool:
            # The first wave is admitted at once (the replica has not queued yet): most of it waits upstream.
            first = [pool.submit(chat, gw.url, keys["batch"], 20, False, c) for _ in range(10)]
            assert wait_until(lambda: lanes.gate_closed(), timeout=10, interval=0.02)
            # The second wave finds the upstream queueing: it waits here, though the sequences have room (40).
            second = [pool.submit(chat, gw.url, keys["batch"], 20, False, c) for _ in range(8)]
            assert wait_until(lambda: batch.waiting >= 6, timeout=10, interval=0.01)
            assert batch.in_use <= 10 < lanes.general
            assert metric_value(httpx.get(gw.url + "/metrics").text, "tailguard_upstream_queue_gate_closed") == 1
            vip = chat(gw.url, keys["vip"], 2, False, c)
            results = [f.result() for f in first + second]
        assert vip.status_code == 200
        assert record(gw, vip)["gateway"]["lane_wait"] < 0.05  # VIP is not held at the gateway
        # The batch requests held at the gateway were admitted as the replica drained, none refused.
        assert [r.status_code for r in results] == [200] * 18
        waits = [record(gw, r)["gateway"]["lane_wait"] for r in results[10:]]
        assert max(waits) > 0.1  # they did wait at the gateway (a 20-token answer takes 0.4 s upstream)
        settle(gw)
        assert all(s.in_use == 0 and s.waiting == 0 for s in lanes.lanes.values())
        assert wait_until(lambda: not lanes.gate_closed(), timeout=10)
        # The replica has shown it runs 2 at once: a new burst is held at the gateway at once, before any read of
        # its queue (without that, the whole burst would be admitted and queue upstream).
        assert gw.state.engine.pool.replicas[0].slots in (1, 2)  # 1: a read between a finish and the next start
        with httpx.Client(timeout=60) as c, ThreadPoolExecutor(10) as pool:
            burst = [pool.submit(chat, gw.url, keys["batch"], 20, False, c) for _ in range(10)]
            assert wait_until(lambda: batch.waiting >= 5, timeout=10, interval=0.01)
            assert batch.in_use <= 5
            assert all(f.result().status_code == 200 for f in burst)


def test_the_gate_is_off_with_no_limit(tmp_path):
    path, keys = keyfile(tmp_path)
    with replica(tmp_path, "a", ttft=0.01, itl=0.02, max_num_seqs=2) as a, \
            gateway(tmp_path, [a.url], per_replica=40, keys_file=str(path),
                    routing={"health_interval_s": 0.3, "queue_scrape_s": 0.1},
                    capacity={"upstream_queue_limit": None}) as gw:
        lanes = gw.state.lanes
        assert lanes.upstream_full is None
        with httpx.Client(timeout=60) as c, ThreadPoolExecutor(12) as pool:
            flood = [pool.submit(chat, gw.url, keys["batch"], 20, False, c) for _ in range(12)]
            # All admitted at once: they queue at the replica instead (its /metrics says so).
            assert wait_until(lambda: lanes.lanes["batch"].in_use == 12, timeout=10, interval=0.01)
            assert wait_until(lambda: gw.state.engine.pool.replicas[0].upstream_waiting >= 5, timeout=10)
            assert lanes.lanes["batch"].waiting == 0
            assert all(f.result().status_code == 200 for f in flood)
