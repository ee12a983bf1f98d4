"""Connection hygiene (serving/connections.py), over raw sockets against ``tailguard serve``: request heads over the
size limit are refused without the server growing, slow heads and bodies are cut after their timeouts, idle
connections are closed, connections over the cap get a JSON 503, and ``/health`` answers quickly throughout."""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.serving_helpers import ADMIN_KEY, start_serve, stop_serve

CAP = 32  # more than the slow clients of the timeout test, which would otherwise evict one another
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, int, int]]:
    """``tailguard serve --model fake`` with short timeouts and a small connection cap: (url, port, pid)."""
    tmp: Path = tmp_path_factory.mktemp("connections")
    cfg = tmp / "server.yaml"
    cfg.write_text(yaml.safe_dump({
        "fake": {"ttft": 0.01, "itl": 0.05}, "admin_key": ADMIN_KEY, "log_level": "warning", "access_log": False,
        "max_connections": CAP, "header_timeout_s": 1.0, "body_timeout_s": 1.0, "body_min_rate": 1000,
        "keepalive_timeout_s": 1.0}))
    proc, url = start_serve("--model", "fake", "--config", str(cfg), "--store", str(tmp / "requests.sqlite3"))
    try:
        yield url, int(url.rsplit(":", 1)[1]), proc.pid
    finally:
        stop_serve(proc)


def _connect(port: int, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response with a content-length body: (status, headers, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        part = sock.recv(65536)
        if not part:
            raise ConnectionError(f"closed after {buf!r}")
        buf += part
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        part = sock.recv(65536)
        if not part:
            break
        body += part
    return int(lines[0].split()[1]), headers, body


def _closed(sock: socket.socket) -> bool:
    """True once the server has closed the connection (what it sent before is read and dropped); False when it
    stays open past the socket's timeout."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _health_ms(port: int) -> float:
    t0 = time.perf_counter()
    with _connect(port) as s:
        s.sendall(HEALTH)
        status, _, body = _response(s)
    assert status == 200 and json.loads(body)["status"] == "ok"
    return (time.perf_counter() - t0) * 1000


def _rss_peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert err["message"] and err["type"]
    return err


def test_a_head_over_the_limit_is_answered_431_and_one_under_it_served(server):
    _, port, _ = server
    for size, want in ((100_000, 431), (60_000, 200)):
        with _connect(port) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * size + b"\r\n\r\n")
            status, headers, body = _response(s)
            assert status == want, body
            if want == 431:
                assert _error(body)["code"] == "request_header_fields_too_large"
                assert headers["connection"] == "close" and _closed(s)
    # Many headers, none of them large: the head's total is what counts.
    with _connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90)
                                                                   for i in range(1000)) + b"\r\n")
        assert _response(s)[0] == 431
    # Refused before the app (no record): counted on /metrics, with the connections open now.
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    refused = re.search(r'tailguard_server_connections_refused_total\{reason="head_too_large"\} (\S+)', metrics)
    assert refused is not None and float(refused.group(1)) >= 2
    assert re.search(r"^tailguard_server_connections [1-9]", metrics, re.M)


def test_a_request_offering_an_upgrade_we_do_not_speak_is_served_as_http_1_1(server):
    """curl --http2 and Java's HttpClient offer h2c on plain HTTP; the HTTP parser would take the body as the new
    protocol's bytes. The offer is ignored (RFC 9110 allows it) and the request answered, body and all."""
    _, port, _ = server
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    for parts in ([head + body], [head, body]):  # the body with the head, and in a later packet
        with _connect(port) as s:
            for part in parts:
                s.sendall(part)
                time.sleep(0.05)
            status, headers, answer = _response(s)
        assert status == 200, answer
        assert headers["content-type"].startswith("application/json")
        assert json.loads(answer)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("raw", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nhello\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHo\x01st: x\r\n\r\n",
])
def test_bytes_that_are_not_http_get_a_json_400_and_are_counted(server, raw):
    _, port, _ = server
    before = _refused(port, "bad_request")
    with _connect(port) as s:
        s.sendall(raw)
        status, headers, body = _response(s)
        assert status == 400 and headers["content-type"] == "application/json"
        assert _error(body)["code"] == "invalid_http_request" and _closed(s)
    assert _refused(port, "bad_request") == before + 1


def _refused(port: int, reason: str) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    m = re.search(r'tailguard_server_connections_refused_total\{reason="' + reason + r'"\} (\S+)', metrics)
    assert m is not None
    return float(m.group(1))


def test_huge_heads_are_refused_without_growing_the_server(server):
    """16 clients each sending a 64 MB header, as in the report: each is cut after the limit, and the server's peak
    RSS barely moves (before: the head was buffered whole, +1 GB, and answered 200)."""
    _, port, pid = server
    before = _rss_peak_kib(pid)
    chunk = b"a" * (1 << 20)
    outcomes: list[str] = []

    def flood() -> None:
        with _connect(port) as s:
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
                for _ in range(64):  # more than the kernel's socket buffers hold: the cut shows
                    s.sendall(chunk)
                s.sendall(b"\r\n\r\n")
                outcomes.append("sent all")
            except OSError:
                outcomes.append("cut")

    threads = [threading.Thread(target=flood) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes == ["cut"] * 16
    grown_mb = (_rss_peak_kib(pid) - before) / 1024
    assert grown_mb < 40, f"the server's peak RSS grew by {grown_mb:.0f} MB"
    assert _health_ms(port) < 1000


def test_slow_heads_and_bodies_are_cut_after_their_timeouts_while_health_answers(server):
    url, port, _ = server
    body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 1}).encode()
    slow = [(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: yes\r\n\r\n", "head") for _ in range(12)]
    slow += [(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"X-Request-ID: slow-body-%d\r\nContent-Length: %d\r\n\r\n" % (i, len(body)) + body, "body")
             for i in range(12)]
    results: dict[int, tuple[str, float, int | None]] = {}

    def trickle(i: int, data: bytes, kind: str) -> None:
        t0 = time.monotonic()
        status = None
        with _connect(port) as s:
            if kind == "body":  # the head arrives at once; the body a byte at a time
                split = data.index(b"\r\n\r\n") + 4
                s.sendall(data[:split])
                data = data[split:]
            try:
                for b in data:
                    s.sendall(bytes([b]))
                    time.sleep(0.1)
                    if select.select([s], [], [], 0)[0]:  # the server answered (or closed): stop sending
                        break
            except OSError:
                pass
            with contextlib.suppress(OSError):
                status, _, _ = _response(s)
        results[i] = (kind, time.monotonic() - t0, status)

    threads = [threading.Thread(target=trickle, args=(i, d, k)) for i, (d, k) in enumerate(slow)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    during = [_health_ms(port) for _ in range(5)]
    for t in threads:
        t.join(30)
    assert sorted(during)[2] < 300, during  # the median /health while 24 connections trickle
    assert len(results) == len(slow)
    for kind, took, status in results.values():
        # Cut at the 1 s timeout (a whole request would take 4-13 s at this pace), with a 408.
        assert status == 408 and 0.9 < took < 3.5, (kind, took, status)
    with httpx.Client() as c:  # and the server serves as before
        assert c.post(url + "/v1/completions", content=body,
                      headers={"Content-Type": "application/json"}).status_code == 200
        # The records say what the clients saw: a 408, the client's doing (not a disconnect, not the service's).
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        deadline = time.monotonic() + 10
        while (r := c.get(url + "/v1/requests/slow-body-0", headers=admin)).status_code == 404:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert r.json()["status"] == 408 and r.json()["outcome"] == "invalid"


def test_idle_connections_are_closed(server):
    _, port, _ = server
    with _connect(port) as silent, _connect(port) as kept:
        kept.sendall(HEALTH)
        assert _response(kept)[0] == 200
        t0 = time.monotonic()
        silent.settimeout(5)
        kept.settimeout(5)
        assert silent.recv(1) == b"" and kept.recv(1) == b""  # closed by the server (a timeout raises instead)
        assert time.monotonic() - t0 < 2.5


def _stream(port: int, rid: str) -> socket.socket:
    s = _connect(port)
    payload = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 400, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"X-Request-ID: {rid}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    return s


def test_connections_over_the_cap_get_503_and_idle_ones_make_room(server):
    url, port, _ = server
    busy = [_stream(port, f"busy-{i}") for i in range(CAP)]
    try:
        with _connect(port) as extra:
            extra.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 2\r\n\r\n{}")
            status, headers, body = _response(extra)
            assert status == 503 and headers["retry-after"] == "2" and headers["connection"] == "close"
            assert headers["content-type"] == "application/json"
            assert _error(body)["code"] == "too_many_connections"
        assert _health_ms(port) < 1000  # the probes are answered over the cap
    finally:
        for s in busy:
            s.close()
    # A crowd of idle connections (the 20,000 of the report, scaled to ten times the cap): each new one evicts the longest
    # idle, so the server holds at most CAP, and a new client is served at once.
    idle = [_connect(port) for _ in range(10 * CAP)]
    try:
        assert _health_ms(port) < 1000
        with httpx.Client() as c:
            r = c.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        for s in idle[:CAP]:
            s.settimeout(0.5)
        assert all(_closed(s) for s in idle[:CAP])  # the oldest were evicted
    finally:
        for s in idle:
            s.close()


def test_serve_flags_set_the_connection_limits_and_the_drain_timeout(monkeypatch):
    import tailguard.serving.server as server_module
    from tailguard.cli import main

    got = []
    monkeypatch.setattr(server_module, "serve", lambda config, engine_args=None: got.append(config) or 0)
    assert main(["serve", "--model", "fake", "--max-connections", "100", "--max-header-bytes", "8192",
                 "--header-timeout", "3", "--body-timeout", "4", "--body-min-rate", "500", "--keepalive-timeout",
                 "2.5", "--drain-timeout", "12"]) == 0
    c = got[0]
    assert (c.max_connections, c.max_header_bytes, c.header_timeout_s, c.body_timeout_s, c.body_min_rate,
            c.keepalive_timeout_s, c.graceful_shutdown_s) == (100, 8192, 3.0, 4.0, 500, 2.5, 12.0)
    from tailguard.serving.config import ServerConfig

    assert ServerConfig(drain_timeout_s=7).graceful_shutdown_s == 7  # the config file's other name for it
