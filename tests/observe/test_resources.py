"""Machine sampling (O2): CPU use and RSS every 100 ms, windowed, in /metrics and in each request's resources."""

from __future__ import annotations

import time

import httpx
from prometheus_client import CollectorRegistry

from tailguard.observe.resources import ResourceSampler
from tests.serving_helpers import fake_server, settle, wait_until


def test_sampler_sees_cpu_work_and_memory():
    s = ResourceSampler(CollectorRegistry(), "m", interval_s=0.05, window_s=2.0, cuda=False)
    s.sample()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.2:  # one core busy
        sum(i * i for i in range(1000))
    busy = s.sample()
    time.sleep(0.2)
    idle = s.sample()
    assert busy.cpu > 0.1 and idle.cpu < busy.cpu / 2  # (a loaded machine may give the loop well under a core)
    blob = bytearray(64 << 20)  # 64 MiB touched
    for i in range(0, len(blob), 4096):
        blob[i] = 1
    grown = s.sample()
    assert grown.rss - idle.rss > 48 << 20
    st = s.export()  # the window: every sample so far
    assert st["samples"] == 4 and st["rss_bytes_max"] >= grown.rss and st["cpu_cores_max"] >= round(busy.cpu, 3) - 1e-3  # the window rounds to 3 decimals
    del blob


def test_server_exports_machine_samples(tmp_path):
    with fake_server(tmp_path) as server:
        assert wait_until(lambda: len(server.state.machine.samples) >= 5, timeout=10)  # 100 ms sampling
        r = httpx.post(server.url + "/v1/chat/completions", headers={"X-Request-ID": "m-1"},
                       json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200
        settle(server)
        metrics = httpx.get(server.url + "/metrics").text
        assert 'tailguard_process_cpu_cores{model="fake",stat="mean"}' in metrics
        assert 'tailguard_process_resident_memory_bytes_window{model="fake",stat="max"}' in metrics
        rec = server.state.store.get("m-1")
        assert rec["resources"]["machine"]["rss_bytes_max"] > 10 << 20
