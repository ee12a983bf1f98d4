"""SSE keep-alives while the first token is pending (L6): the stream's status goes out with the first comment, and
the request still holds its queue slot until the engine's first event (the slot bounds requests waiting on the
engine, whatever the client has been sent)."""

from __future__ import annotations

import time

import httpx

from tailguard.engine.fake import FakeTiming
from tests.serving_helpers import fake_server, read_during, settle


def test_keepalives_come_before_the_first_token_and_the_request_keeps_its_queue_slot(tmp_path):
    lanes = {"standard": {"priority": 1, "keepalive_s": 0.1}}
    with fake_server(tmp_path, FakeTiming(ttft=1.0, itl=0.001), lanes=lanes, default_lane="standard") as server:
        lines: list[tuple[float, str]] = []
        t0 = time.perf_counter()
        with read_during(0.6, lambda: server.state.admission.depth) as depth_during, httpx.Client(timeout=30) as c, \
                c.stream("POST", server.url + "/v1/chat/completions", json={
                    "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "stream": True}) as r:
            head = time.perf_counter() - t0
            for line in r.iter_lines():
                if line:
                    lines.append((time.perf_counter() - t0, line))
        assert r.status_code == 200
        pings = [at for at, line in lines if line == ": keep-alive"]
        first = next(at for at, line in lines if line.startswith("data: {") and '"content":"' in line
                     and '"content":""' not in line)
        # The status left with the first comment, long before the first token; every comment came before it.
        assert len(pings) >= 3 and head < 0.5 and all(at < first for at in pings) and first >= 0.9
        # Still waiting on the engine: the queue slot was held all along, and given back at the end.
        assert depth_during == [1]
        settle(server)
        assert server.state.admission.depth == 0
