"""The client's network per request (serving/network.py): the kernel's TCP_INFO read from the client connection while
the answer is written, its summary on the record and in the metrics, and the request's region."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tailguard.engine.fake import FakeTiming
from tailguard.serving.network import (
    TCP_INFO_LEN,
    NetworkSampler,
    RegionMap,
    cycle_of,
    parse_tcp_info,
    read_tcp_info,
)
from tests.serving_helpers import ADMIN, fake_server, settle

LINUX = sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO")
needs_linux = pytest.mark.skipif(not LINUX, reason="TCP_INFO is Linux's")
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def _record(server, request_id: str) -> dict:
    settle(server)
    r = httpx.get(f"{server.url}/v1/requests/{request_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, request_id: str, max_tokens: int, headers: dict | None = None) -> str:
    body = {**CHAT, "max_tokens": max_tokens, "stream": True}
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      headers={"x-request-id": request_id, **(headers or {})}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            text.append(line)
    return "\n".join(text)


@pytest.fixture()
def pair():
    """An established loopback TCP connection: (server side, client side)."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(1)
    cli = socket.create_connection(lsn.getsockname())
    srv, _ = lsn.accept()
    lsn.close()
    yield srv, cli
    srv.close()
    cli.close()


# --- the parser --------------------------------------------------------------------------------------------------------
@needs_linux
def test_the_parser_reads_a_real_connection(pair):
    srv, cli = pair
    for _ in range(20):  # some traffic, so that the RTT is measured on data, not only the handshake
        srv.sendall(b"x" * 1000)
        cli.recv(65536)
    info = read_tcp_info(srv)
    assert info is not None
    assert info["state"] == 1  # TCP_ESTABLISHED
    assert 0 < info["rtt"] < 1_000_000  # microseconds: loopback is far under a second
    assert info["min_rtt"] <= info["rtt"] or info["min_rtt"] < 1_000_000
    assert info["snd_mss"] > 0 and info["snd_cwnd"] > 0 and info["pmtu"] >= info["snd_mss"]
    assert info["total_retrans"] == 0 and info["lost"] == 0
    assert info["data_segs_out"] >= 20 and info["bytes_acked"] >= 20_000
    assert info["notsent_bytes"] == 0  # everything was read


@needs_linux
@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) not installed")
def test_the_parser_agrees_with_ss(pair):
    srv, cli = pair
    for _ in range(5):
        srv.sendall(b"y" * 500)
        cli.recv(65536)
    port = srv.getsockname()[1]
    peer = srv.getpeername()[1]
    out = subprocess.run(["ss", "-tin", "state", "established", f"( sport = :{port} and dport = :{peer} )"],
                         capture_output=True, text=True, timeout=10).stdout
    info = read_tcp_info(srv)
    assert info is not None
    mss = re.search(r"\bmss:(\d+)", out)
    cwnd = re.search(r"\bcwnd:(\d+)", out)
    rtt = re.search(r"\brtt:([\d.]+)/([\d.]+)", out)
    assert mss and cwnd and rtt, out
    assert int(mss.group(1)) == info["snd_mss"]
    assert int(cwnd.group(1)) == info["snd_cwnd"]  # an idle connection: neither moves between the two reads
    assert abs(float(rtt.group(1)) - info["rtt"] / 1000) < 1.0  # ss prints ms; both well under a second


def test_a_short_struct_gives_the_fields_it_holds():
    full = parse_tcp_info(bytes(range(256))[:TCP_INFO_LEN])
    assert len(full) == 54 and full["state"] == 0
    old = parse_tcp_info(bytes(104))  # a kernel before 4.6: up to total_retrans
    assert "total_retrans" in old and "notsent_bytes" not in old and "rtt" in old


def test_off_uvicorn_there_is_nothing_to_sample():
    async def send(message):  # a plain ASGI send: no uvicorn cycle behind it
        return None

    assert NetworkSampler.for_send(send) is None
    assert cycle_of(print) is None
    assert read_tcp_info(object()) is None


@needs_linux
def test_a_sample_costs_microseconds(pair):
    """The cost the module docstring states: one sample of a real connection, and a write that takes none."""
    srv, cli = pair

    class Transport:
        def is_closing(self):
            return False

        def get_write_buffer_size(self):
            return 0

    sampler = NetworkSampler(srv, Transport(), None)
    n = 20_000
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            sampler.sample()
        best = min(best, (time.perf_counter() - t0) / n)
    sampler._next = float("inf")
    t0 = time.perf_counter()
    for _ in range(n):
        sampler.on_write()
    skip = (time.perf_counter() - t0) / n
    print(f"one sample {best * 1e6:.2f} us, a write without one {skip * 1e6:.3f} us")
    assert best < 50e-6 and skip < 5e-6  # generous: a loaded 2-core CI machine; measured ~1 us and ~0.1 us
    s = sampler.summary()
    assert s is not None and s["samples"] == 3 * n


# --- over a real server --------------------------------------------------------------------------------------------------
@needs_linux
def test_a_streamed_answer_records_its_network(tmp_path):
    with fake_server(tmp_path, FakeTiming(ttft=0.01, itl=0.02)) as s:
        _stream(s.url, "net-1", max_tokens=20)
        rec = _record(s, "net-1")
    net = rec["network"]
    assert net is not None, rec
    assert net["samples"] >= 2  # the first token, every ~100 ms, the end
    assert net["samples"] <= 3 + net["span_s"] / 0.1  # the first, one per 100 ms of the stream, the end
    rtt = net["rtt_ms"]
    assert 0 < rtt["last"] < 1000 and 0 < rtt["first"] < 1000  # loopback: well under a second
    assert rtt["max"] >= rtt["mean"] >= 0 and rtt["max"] >= rtt["last"]
    # A loaded machine may fire a tail-loss probe even on loopback: a count, never more than what was sent.
    assert 0 <= net["retransmits"] <= net["segments_out"] and net["segments_out"] >= 1
    assert net["span_s"] > 0.2  # first to last sample spans the stream


@needs_linux
def test_sampling_can_be_turned_off(tmp_path):
    with fake_server(tmp_path, FakeTiming(ttft=0.005, itl=0.001), network_sampling=False) as s:
        _stream(s.url, "net-off", max_tokens=5)
        rec = _record(s, "net-off")
    assert rec.get("network") is None


@needs_linux
def test_a_client_that_stops_reading_builds_a_backlog(tmp_path):
    """A client with a small receive buffer that reads nothing for a while: the bytes pile up in the kernel's send
    buffer (notsent) and above it in the transport; the record says so, where a reading client's shows none."""
    tokens = 6000
    with fake_server(tmp_path, FakeTiming(ttft=0.005, itl=0.0)) as s:
        _stream(s.url, "reader", max_tokens=300)  # a client that reads (at most ~50 KB in all)
        payload = json.dumps({**CHAT, "max_tokens": tokens, "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        sock.connect(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Request-ID: stalled\r\n" + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        time.sleep(1.5)  # the server writes; nobody reads
        got = bytearray()
        sock.settimeout(30)
        while not got.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        sock.close()
        assert b"[DONE]" in got
        reading = _record(s, "reader")["network"]
        stalled = _record(s, "stalled")["network"]
    assert reading is not None and stalled is not None
    backlog = stalled["max_notsent_bytes"] + stalled["max_write_buffer_bytes"]
    assert stalled["max_backlog_bytes"] >= backlog / 2 > 0
    assert backlog > 32 * 1024, stalled
    assert stalled["max_backlog_bytes"] > 4 * max(reading["max_backlog_bytes"], 1024), (reading, stalled)
    # (uvicorn's flow control pauses only once the kernel's send buffer, up to a few MB, is full: not asked here.)


# --- regions -----------------------------------------------------------------------------------------------------------
def test_region_map_header_then_networks_then_default():
    m = RegionMap("x-region", {"10.0.0.0/8": "private", "10.1.0.0/16": "eu-west", "2001:db8::/32": "doc6"})
    assert m.region({"x-region": "us-east"}, ("10.1.2.3", 5)) == "us-east"  # the header first
    assert m.region({}, ("10.1.2.3", 5)) == "eu-west"  # the longest prefix
    assert m.region({}, ("10.9.9.9", 5)) == "private"
    assert m.region({}, ("2001:db8::1", 5)) == "doc6"
    assert m.region({}, ("::ffff:10.1.0.7", 5)) == "eu-west"  # an IPv4 client on a dual-stack listener
    assert m.region({}, ("192.0.2.1", 5)) == "default"
    assert m.region({}, None) == "default" and m.region({}, ("not-an-address", 0)) == "default"
    assert m.region({"x-region": "a b<c>"}, None) == "a_b_c_"  # a label: plain characters only
    # X-Forwarded-For only when a trusted proxy sets it; its first hop is the client.
    fwd = {"x-forwarded-for": "10.1.0.9, 192.0.2.1"}
    assert m.region(fwd, ("192.0.2.50", 1)) == "default"
    trusted = RegionMap("x-region", {"10.1.0.0/16": "eu-west"}, trust_forwarded=True)
    assert trusted.region(fwd, ("192.0.2.50", 1)) == "eu-west"
    assert RegionMap(None, {}).region({"x-region": "eu"}, None) == "default"  # no header configured


def test_region_cidrs_are_validated():
    from pydantic import ValidationError

    from tailguard.serving.config import ServerConfig

    with pytest.raises(ValidationError, match="not a network"):
        ServerConfig(region_cidrs={"10.0.0.0/33": "x"})
    cfg = ServerConfig(region_cidrs={"10.1.0.0/16": "eu-west"}, region_header="X-Geo")
    assert cfg.region_cidrs == {"10.1.0.0/16": "eu-west"}


def _regions_metric(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r'tailguard_client_rtt_seconds_count\{model="fake",region="([^"]+)"\} ([\d.e+]+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


@needs_linux
def test_regions_from_the_header_the_networks_and_the_default(tmp_path):
    with fake_server(tmp_path, FakeTiming(ttft=0.002, itl=0.001), region_header="X-Geo",
                     region_cidrs={"127.0.0.0/8": "loopback"}) as s:
        _stream(s.url, "geo-header", 3, {"x-geo": "eu-west"})
        _stream(s.url, "geo-other-header", 3, {"x-region": "ignored"})  # not the configured header
        r = httpx.post(s.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3},
                       headers={"x-request-id": "geo-json"})
        assert r.status_code == 200
        assert _record(s, "geo-header")["region"] == "eu-west"
        assert _record(s, "geo-other-header")["region"] == "loopback"  # 127.0.0.1 is in the map
        assert _record(s, "geo-json")["region"] == "loopback"
        assert _record(s, "geo-json")["network"]["samples"] == 1  # a one-piece answer: its end only
        metrics = httpx.get(s.url + "/metrics").text
    counts = _regions_metric(metrics)
    assert counts == {"eu-west": 1, "loopback": 2}, counts
    assert 'tailguard_client_send_backlog_bytes_count{model="fake",region="eu-west"} 1.0' in metrics
    assert "tailguard_client_retransmits_total" in metrics or "# TYPE tailguard_client_retransmits counter" in metrics
    with fake_server(tmp_path / "plain", FakeTiming(ttft=0.002, itl=0.001)) as s:
        _stream(s.url, "no-region", 3)
        assert _record(s, "no-region")["region"] == "default"


@needs_linux
def test_a_trusted_proxy_names_the_client_network(tmp_path):
    """Behind a proxy the server trusts (trust_lane_header), X-Forwarded-For's first hop is the client."""
    with fake_server(tmp_path, FakeTiming(ttft=0.002, itl=0.001), trust_lane_header=True,
                     region_cidrs={"10.1.0.0/16": "eu-west", "127.0.0.0/8": "loopback"}) as s:
        _stream(s.url, "via-proxy", 3, {"x-forwarded-for": "10.1.4.4, 127.0.0.1"})
        assert _record(s, "via-proxy")["region"] == "eu-west"


def test_the_cli_takes_the_region_flags(monkeypatch, tmp_path):
    from tailguard import cli

    seen = {}

    def fake_serve(config, *args):
        seen["config"] = config
        return 0

    monkeypatch.setattr("tailguard.serving.server.serve", fake_serve)
    rc = cli.main(["serve", "--model", "fake", "--store", str(tmp_path / "s.sqlite3"), "--region-header", "X-Geo",
                   "--region-cidr", "10.1.0.0/16=eu-west", "--region-cidr", "fd00::/8=lab",
                   "--no-network-sampling"])
    assert rc == 0
    cfg = seen["config"]
    assert cfg.region_header == "X-Geo" and cfg.network_sampling is False
    assert cfg.region_cidrs == {"10.1.0.0/16": "eu-west", "fd00::/8": "lab"}
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", "fake", "--region-cidr", "eu-west"])


def test_sampling_works_with_a_wrapped_send():
    """With tracing on, Starlette's middlewares and the trace context's wrap ``send`` in closures, three deep: the
    sampler still finds uvicorn's cycle behind them."""
    import tailguard.serving.network as network

    class Cycle:
        async def send(self, message):
            return None

    Cycle.__module__, Cycle.__name__ = network._UVICORN_CYCLE
    cycle = Cycle()
    inner = cycle.send

    async def server_error_send(message):  # Starlette's error middleware
        await inner(message)

    async def send_with_trace(message):  # the trace context's
        await server_error_send(message)

    async def sender(message):  # Starlette's exception middleware: what the endpoint gets with tracing on
        await send_with_trace(message)

    assert cycle_of(cycle.send) is cycle
    assert cycle_of(send_with_trace) is cycle
    assert cycle_of(sender) is cycle
    lock = threading.Lock()  # a closure holding other objects: none of them is taken for the cycle

    async def unrelated(message):
        with lock:
            return None

    assert cycle_of(unrelated) is None
