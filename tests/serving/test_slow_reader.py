"""A client that reads its stream slowly: the time the answer waits for it to read is its own, not the server's
E2E, ITL or TPOT (in the record's figures, the metrics and so the SLO windows), and the record keeps that wait on its
own (``client_wait``) beside the timestamps as they happened."""

from __future__ import annotations

import json
import socket
import sys
import time

import httpx
import pytest

from tailguard.engine.fake import FakeTiming
from tests.serving_helpers import ADMIN, fake_server, settle

# Long enough to fill every buffer between the server and a reader that does not read (~800 KB of SSE chunks, where
# the server's socket and uvicorn's write buffer hold a few hundred KB with a real path's MSS).
MAX_TOKENS = 4000
STALL_S = 2.5  # the reader reads nothing for this long, then everything


def _slow_read(port: int, rid: str) -> bytes:
    body = json.dumps({"model": "fake", "stream": True, "max_tokens": MAX_TOKENS,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Request-ID: {rid}\r\nConnection: close\r\n\r\n").encode()
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        if hasattr(socket, "TCP_MAXSEG"):
            # A real path's MSS: loopback's 64 KB one lets the server's send buffer grow to megabytes.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1448)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", port))
        sock.sendall(head + body)
        time.sleep(STALL_S)  # a slow link, or a client doing it on purpose
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer
    finally:
        sock.close()


def _buckets(metrics: str, name: str) -> dict[str, float]:
    return {line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines() if line.startswith(name + "_bucket") and 'le="' in line}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the socket buffer sizes are Linux's")
def test_a_slow_reader_is_the_clients_time_not_the_servers(tmp_path):
    with fake_server(tmp_path, FakeTiming(ttft=0.005, itl=0.0002)) as s:
        port = int(s.url.rsplit(":", 1)[1])
        answer = _slow_read(port, "slow")
        assert answer.startswith(b"HTTP/1.1 200") and answer.rstrip().endswith(b"0")  # the whole chunked body
        settle(s)
        rec = httpx.get(s.url + "/v1/requests/slow", headers=ADMIN).json()
        metrics = httpx.get(s.url + "/metrics").text
        window = s.state.slo.evaluate().to_dict()["scopes"]["all"]  # now, not at the last periodic evaluation
    # It did wait for the reader: the last byte went out after the stall.
    assert rec["output_tokens"] == MAX_TOKENS
    assert rec["timestamps"]["last_byte"] >= STALL_S * 0.9
    # None of it is the server's: E2E, TPOT and every token gap are the server's own time.
    assert rec["e2e"] < STALL_S / 2
    assert rec["tpot"] < STALL_S / 2 / MAX_TOKENS
    # The record says how long the answer waited for the reader, and when: what the figures leave out.
    assert rec["client_wait"] >= STALL_S / 2 and rec["client_waits"]
    assert rec["e2e"] + rec["client_wait"] == pytest.approx(rec["timestamps"]["last_byte"], abs=0.05)
    assert sum(rec["stages"].values()) == pytest.approx(rec["e2e"], abs=1e-6)
    # The metrics and the SLO window have the same figures: no gap, no E2E at or past half the stall.
    itl = _buckets(metrics, "tailguard_inter_token_latency_seconds")
    below = [n for le, n in itl.items() if le != "+Inf" and float(le) >= STALL_S / 2]
    assert itl["+Inf"] >= MAX_TOKENS - 1 and min(below) == itl["+Inf"]
    e2e = _buckets(metrics, "tailguard_e2e_request_latency_seconds")
    assert min(n for le, n in e2e.items() if le != "+Inf" and float(le) >= STALL_S / 2) == e2e["+Inf"] == 1
    assert window["e2e"]["p99"] < STALL_S / 2 and window["itl"]["p99"] < 0.1
    # The wait itself is counted, on its own.
    assert "tailguard_client_wait_seconds_count" in metrics
