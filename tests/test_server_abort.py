"""An aborted request's record says where it was when the client left: a client that hangs up during prefill or
mid-stream must not have its prefill charged to the queue (that would inflate queue-wait P99 everywhere)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

from tailguard.engine.engine import TokenEvent
from tailguard.engine.fake import ByteTokenizer, FakeEngine, FakeTiming
from tailguard.engine.request import FinishReason
from tests.serving_helpers import fake_server, settle


class AbortReportingEngine(FakeEngine):
    """A scripted engine that keeps the Backend contract on abort: after ``abort(id)`` its stream ends with a final
    event (finish reason ``abort``) carrying when the request was first scheduled and produced its first token."""

    def __init__(self, timing: FakeTiming) -> None:
        super().__init__(timing)
        self._abort_flags: dict[str, asyncio.Event] = {}

    async def generate(self, prompt_token_ids, sampling, request_id, priority=0, arrival_time=None):
        self.check_request(len(prompt_token_ids), sampling)
        aborted = self._abort_flags[request_id] = asyncio.Event()
        scheduled = time.perf_counter()  # a free slot: scheduled at once, so everything after is prefill/decode
        first = None
        waits = [self.timing.ttft] + [self.timing.itl] * (sampling.max_tokens - 1)
        try:
            for n, wait in enumerate(waits):
                try:
                    async with asyncio.timeout(wait):
                        await aborted.wait()
                except TimeoutError:
                    now = time.perf_counter()
                    first = first or now
                    last = n + 1 == len(waits)
                    yield TokenEvent(request_id, ByteTokenizer._OFFSET + ord("a"), "a", now, finished=last,
                                     finish_reason=FinishReason.LENGTH if last else None,
                                     num_prompt_tokens=len(prompt_token_ids), num_output_tokens=n + 1,
                                     first_scheduled=scheduled, first_token=first)
                    continue
                yield TokenEvent(request_id, None, "", time.perf_counter(), finished=True,
                                 finish_reason=FinishReason.ABORT, num_prompt_tokens=len(prompt_token_ids),
                                 num_output_tokens=n, first_scheduled=scheduled, first_token=first)
                return
        finally:
            self._abort_flags.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        flag = self._abort_flags.get(request_id)
        if flag is not None:
            flag.set()


def _start_stream(url: str, request_id: str, max_tokens: int) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens,
                       "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"X-Request-ID: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _wait(pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_a_client_gone_during_prefill_is_charged_to_prefill_not_queue(tmp_path):
    engine = AbortReportingEngine(FakeTiming(ttft=30.0, itl=0.01))
    with fake_server(tmp_path, engine=engine) as s:
        sock = _start_stream(s.url, "prefill-gone", 5)
        assert _wait(lambda: "prefill-gone" in engine._abort_flags)
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
    engine = AbortReportingEngine(FakeTiming(ttft=0.3, itl=0.02))
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
