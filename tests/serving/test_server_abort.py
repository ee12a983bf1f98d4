"""An aborted request's record says where it was when the client left: a client that hangs up during prefill or
mid-stream must not have its prefill charged to the queue (that would inflate queue-wait P99 everywhere)."""

from __future__ import annotations

import time

from tailguard.engine.fake import FakeEngine, FakeTiming
from tests.serving_helpers import fake_server, open_stream, settle, wait_until


def _start_stream(url: str, request_id: str, max_tokens: int):
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens, "stream": True}
    return open_stream(url, body, request_id)


def test_a_client_gone_during_prefill_is_charged_to_prefill_not_queue(tmp_path):
    engine = FakeEngine(FakeTiming(ttft=30.0, itl=0.01))
    with fake_server(tmp_path, engine=engine) as s:
        sock = _start_stream(s.url, "prefill-gone", 5)
        assert wait_until(lambda: "prefill-gone" in engine._abort_flags)
        time.sleep(0.3)  # the engine is in its prefill
        sock.close()
        settle(s)
        rec = s.state.store.get("prefill-gone")
    assert rec["outcome"] == "aborted" and rec["status"] == 499 and rec["output_tokens"] == 0
    assert rec["timestamps"]["scheduled"] is not None and rec["timestamps"]["first_token"] is None
    st = rec["stages"]
    assert st["prefill"] >= 0.25 and st["queue"] < st["prefill"] / 10, st
    assert st["decode"] == 0 and abs(sum(st.values()) - rec["e2e"]) < 1e-3


def test_a_client_gone_mid_stream_keeps_its_prefill_out_of_the_queue(tmp_path):
    engine = FakeEngine(FakeTiming(ttft=0.3, itl=0.02))
    with fake_server(tmp_path, engine=engine) as s:
        sock = _start_stream(s.url, "stream-gone", 1000)
        received = b""
        while received.count(b"data: ") < 4:  # the role chunk and three tokens
            received += sock.recv(65536)
        sock.close()
        settle(s)
        rec = s.state.store.get("stream-gone")
    assert rec["outcome"] == "aborted" and rec["status"] == 499
    ts, st = rec["timestamps"], rec["stages"]
    assert ts["scheduled"] is not None and ts["scheduled"] < ts["first_token"]
    assert st["prefill"] >= 0.25 and st["queue"] < st["prefill"] / 10, st
    assert st["decode"] > 0 and 3 <= rec["output_tokens"] < 1000
