"""A request's clock starts when its body is in: a client that takes its time to send is not the server's TTFT,
tokenize stage or E2E (in the record, the metrics and so the SLO windows), and its upload is kept on its own."""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.serving_helpers import ADMIN, fake_server, settle

UPLOAD_S = 0.6


def _slow_post(port: int, rid: str, body: dict) -> int:
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nX-Request-ID: {rid}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + data[:10])
        time.sleep(UPLOAD_S)  # the rest of the body comes later, as from a slow link
        sock.sendall(data[10:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_a_slow_upload_is_the_clients_time_not_the_servers(tmp_path):
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with fake_server(tmp_path) as s:
        port = int(s.url.rsplit(":", 1)[1])
        assert _slow_post(port, "slow", body) == 200
        assert httpx.post(s.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": "quick"}).status_code \
            == 200
        settle(s)
        slow = httpx.get(s.url + "/v1/requests/slow", headers=ADMIN).json()
        quick = httpx.get(s.url + "/v1/requests/quick", headers=ADMIN).json()
        metrics = httpx.get(s.url + "/metrics").text
    assert slow["upload"] >= UPLOAD_S * 0.9
    assert slow["ttft"] < UPLOAD_S / 2 and slow["e2e"] < UPLOAD_S / 2
    assert slow["stages"]["tokenize"] < UPLOAD_S / 2
    assert quick["upload"] < UPLOAD_S / 2
    # Neither request's TTFT reached the histogram's buckets at or past the upload time.
    ttft_counts = {line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                   for line in metrics.splitlines()
                   if line.startswith("tailguard_time_to_first_token_seconds_bucket") and 'le="' in line}
    assert ttft_counts, "no TTFT histogram in /metrics"
    below = [count for le, count in ttft_counts.items() if le != "+Inf" and 0.25 <= float(le) < UPLOAD_S]
    assert below and min(below) == ttft_counts["+Inf"] >= 2
