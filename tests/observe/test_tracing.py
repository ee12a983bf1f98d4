"""OpenTelemetry traces end to end: real servers export over OTLP/HTTP to a real receiver started here, which parses
the protobuf payloads (``ExportTraceServiceRequest``) the way a collector does; nothing of the SDK is mocked."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the server extra (opentelemetry-sdk)")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs opentelemetry-exporter-otlp-proto-http")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace.status import StatusCode  # noqa: E402

from tailguard.engine.fake import FakeEngine, FakeTiming  # noqa: E402
from tailguard.observe import tracing  # noqa: E402
from tailguard.observe.timeline import Outcome, Timeline  # noqa: E402
from tailguard.observe.tracing import RequestTrace, RequestTracer, upstream_call, upstream_headers  # noqa: E402
from tailguard.observe.tracing_config import TracingConfig  # noqa: E402
from tailguard.serving.config import ServerConfig  # noqa: E402
from tests.net import free_port
from tests.serving_helpers import FailingEngine, fake_server, settle, start_serve, stop_serve  # noqa: E402

STAGES = ["tokenize", "queue", "prefill", "decode", "stream"]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


# --- a real OTLP/HTTP receiver ----------------------------------------------------------------------------------
def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    """POST /v1/traces: protobuf ExportTraceServiceRequest in, every span kept as a plain dict."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.posts = 0
        self.content_types: set[str] = set()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                elif self.headers.get("Content-Encoding") == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver.add(req, self.headers.get("Content-Type", ""))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, req: ExportTraceServiceRequest, content_type: str) -> None:
        with self._lock:
            self.posts += 1
            self.content_types.add(content_type)
            for rs in req.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans.append({
                            "name": sp.name, "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                            "parent": sp.parent_span_id.hex(), "kind": sp.kind, "start": sp.start_time_unix_nano,
                            "end": sp.end_time_unix_nano, "attrs": {a.key: _value(a.value) for a in sp.attributes},
                            "status": sp.status.code, "status_message": sp.status.message,
                            "events": [(e.name, e.time_unix_nano) for e in sp.events], "resource": resource,
                            "scope": ss.scope.name, "flags": sp.flags,
                        })

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


def _flush(server) -> None:
    settle(server)
    assert server.state.tracer.force_flush(30)


def _tracing(receiver: Receiver, **kw: Any) -> dict[str, Any]:
    return {"otlp_endpoint": receiver.url, **kw}


def _chat(url: str, headers: dict[str, str] | None = None, stream: bool = False, max_tokens: int = 6,
          **body: Any) -> httpx.Response:
    payload = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
               "stream": stream, **body}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=headers or {}, timeout=30)


def _request_span(spans: list[dict[str, Any]]) -> dict[str, Any]:
    roots = [s for s in spans if s["kind"] == Span.SPAN_KIND_SERVER]
    assert len(roots) == 1, [s["name"] for s in spans]
    return roots[0]


def _server_timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, dur = part.strip().split(";dur=")
        out[name] = float(dur)
    return out


# --- the tests --------------------------------------------------------------------------------------------------
def test_request_span_joins_the_clients_trace_with_stage_children(tmp_path, receiver):
    receiver.clear()
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=abc",
               "X-Request-ID": "traced-1", "X-Lane": "vip", "X-Business-Type": "finance"}
    wall_before = time.time_ns()
    # X-Lane counts here because the server is told a trusted proxy sets it (else lanes come from API keys).
    with fake_server(tmp_path, FakeTiming(ttft=0.02, itl=0.004), tracing=_tracing(receiver),
                     trust_lane_header=True) as server:
        assert [m.cls.__name__ for m in server.app.user_middleware] == ["TraceContextMiddleware"]
        r = _chat(server.url, headers, max_tokens=6, temperature=0.5)
        assert r.status_code == 200
        _flush(server)
    wall_after = time.time_ns()
    body = r.json()

    spans = receiver.trace(CLIENT_TRACE)
    req = _request_span(spans)
    # The server's span is a child of the client's, and the response names it (W3C traceresponse).
    assert req["parent"] == CLIENT_SPAN
    assert r.headers["traceresponse"] == f"00-{CLIENT_TRACE}-{req['span_id']}-01"
    assert req["name"] == "chat fake"
    assert req["scope"] == "tailguard" and req["resource"]["service.name"] == "tailguard"
    a = req["attrs"]
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.system"] == "tailguard"
    assert a["gen_ai.request.model"] == "fake"
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.5
    assert a["tailguard.request_id"] == "traced-1"
    assert a["tailguard.lane"] == "vip" and a["tailguard.business_type"] == "finance"
    assert a["http.response.status_code"] == 200 and "error.type" not in a
    assert req["status"] == Status.STATUS_CODE_UNSET
    # Seconds, as the server itself reports them (the Server-Timing header carries milliseconds to 1 us).
    timing = _server_timing(r.headers["server-timing"])
    assert a["gen_ai.server.time_to_first_token"] * 1e3 == pytest.approx(timing["ttft"], abs=2e-3)
    assert a["gen_ai.server.time_to_first_token"] >= 0.02  # the fake engine's prefill alone takes 20 ms
    # Epoch nanoseconds from one anchor per request: the span lies within the wall-clock time of the exchange.
    assert wall_before - 1e9 <= req["start"] < req["end"] <= wall_after + 1e9

    children = sorted((s for s in spans if s is not req), key=lambda s: s["start"])
    assert [c["name"] for c in children] == STAGES
    for c in children:
        assert c["parent"] == req["span_id"] and c["trace_id"] == CLIENT_TRACE
        assert c["kind"] == Span.SPAN_KIND_INTERNAL
        assert req["start"] <= c["start"] <= c["end"] <= req["end"]
        # Each stage span is the stage Server-Timing reports (ms with 3 decimals, so within 2 us); the header leaves
        # before the body, so its stream stage (and total) stop short of the last byte the span runs to.
        duration_ms = (c["end"] - c["start"]) / 1e6
        if c["name"] == "stream":
            assert duration_ms >= timing["stream"] - 2e-3
        else:
            assert duration_ms == pytest.approx(timing[c["name"]], abs=2e-3), c["name"]
    # The stages tile the request: no gap, no overlap (integer nanoseconds from the same anchor).
    assert children[0]["start"] == req["start"] and children[-1]["end"] == req["end"]
    for left, right in zip(children, children[1:]):
        assert left["end"] == right["start"]
    assert (req["end"] - req["start"]) / 1e6 >= timing["total"] - 2e-3
    assert children[2]["end"] - children[2]["start"] >= 20_000_000  # prefill >= the fake's 20 ms
    assert receiver.content_types == {"application/x-protobuf"}


def test_new_trace_without_client_context_and_streaming(tmp_path, receiver):
    receiver.clear()
    with fake_server(tmp_path, tracing=_tracing(receiver)) as server:
        r = _chat(server.url, {"X-Request-ID": "root-1"}, stream=True, max_tokens=4,
                  stream_options={"include_usage": True})
        assert r.status_code == 200
        bad = _chat(server.url, {"X-Request-ID": "root-2", "traceparent": "00-zzzz-not-a-trace-01"})
        assert bad.status_code == 200
        _flush(server)
    # No traceparent from the client: a new trace, and the request span is its root.
    version, trace_id, span_id, flags = r.headers["traceresponse"].split("-")
    assert version == "00" and flags == "01" and len(trace_id) == 32 and trace_id != CLIENT_TRACE
    spans = receiver.trace(trace_id)
    req = _request_span(spans)
    assert req["span_id"] == span_id and req["parent"] == ""
    assert req["attrs"]["tailguard.stream"] is True
    assert req["attrs"]["gen_ai.usage.output_tokens"] == 4
    first_token = dict(req["events"])["gen_ai.first_token"]
    assert first_token == req["start"] + round(req["attrs"]["gen_ai.server.time_to_first_token"] * 1e9)
    assert sorted(s["name"] for s in spans if s is not req) == sorted(STAGES)
    # A malformed traceparent starts a new trace (W3C: restart), it does not fail the request.
    t2 = bad.headers["traceresponse"].split("-")[1]
    assert t2 not in (trace_id, "0" * 32)
    assert _request_span(receiver.trace(t2))["parent"] == ""


def test_failures_are_marked_and_unsampled_traces_are_not_exported(tmp_path, receiver):
    receiver.clear()
    engine = FailingEngine(FakeTiming(ttft=0.005, itl=0.001))
    # sample_ratio 0: new traces are dropped; a client that sampled its trace still gets it recorded.
    with fake_server(tmp_path, engine=engine, tracing=_tracing(receiver, sample_ratio=0.0)) as server:
        sampled = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        boom = _chat(server.url, {**sampled, "X-Request-ID": "boom-1"})
        invalid = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                             headers={"traceparent": f"00-{'ab' * 16}-{CLIENT_SPAN}-01"}, timeout=30)
        unsampled = _chat(server.url, {"traceparent": f"00-{'cd' * 16}-{CLIENT_SPAN}-00"})
        new = _chat(server.url)
        _flush(server)
    assert boom.status_code == 500 and invalid.status_code == 400
    assert unsampled.status_code == new.status_code == 200

    req = _request_span(receiver.trace(CLIENT_TRACE))
    assert req["status"] == Status.STATUS_CODE_ERROR and req["status_message"] == "internal error"
    assert req["attrs"]["error.type"] == "error" and req["attrs"]["http.response.status_code"] == 500

    spans = receiver.trace("ab" * 16)
    bad = _request_span(spans)
    # A client's mistake is not a server error (HTTP semantic conventions), but it is marked; it ended while
    # reading and validating the body, so it has a tokenize stage and nothing after it.
    assert bad["status"] == Status.STATUS_CODE_UNSET and bad["attrs"]["error.type"] == "invalid"
    assert [s["name"] for s in spans if s is not bad] == ["tokenize"]

    # The client said "not sampled", and the ratio (0) dropped the new trace: neither is exported, both are answered.
    assert receiver.trace("cd" * 16) == []
    assert unsampled.headers["traceresponse"].endswith("-00")
    new_trace = new.headers["traceresponse"].split("-")[1]
    assert new.headers["traceresponse"].endswith("-00") and receiver.trace(new_trace) == []
    assert {s["trace_id"] for s in receiver.spans} == {CLIENT_TRACE, "ab" * 16}


class ForwardingEngine(FakeEngine):
    """A gateway in miniature: calls an upstream tailguard with the trace headers, then answers locally."""

    def __init__(self, upstream: str) -> None:
        super().__init__(FakeTiming(ttft=0.005, itl=0.001))
        self.upstream = upstream
        self.dead = f"http://127.0.0.1:{free_port()}/v1/completions"  # nothing listens there
        self.sent: list[dict[str, str]] = []

    async def generate(self, prompt_token_ids, sampling, request_id, priority=0,
                       arrival_time=None) -> AsyncIterator:
        url = self.upstream + "/v1/completions"
        async with httpx.AsyncClient(timeout=30) as client:
            # The first attempt fails before it is sent (a replica that refuses), the retry gets through: two calls.
            with contextlib.suppress(httpx.ConnectError), upstream_call({"url.full": self.dead}) as call:
                self.sent.append(dict(call.headers))
                await client.post(self.dead, json={}, headers=call.headers)
            with upstream_call({"url.full": url, "server.address": "127.0.0.1"}) as call:
                self.sent.append(dict(call.headers))
                r = await client.post(url, json={"model": "fake", "prompt": "hi", "max_tokens": 3},
                                      headers=call.headers)
                call.attributes["http.response.status_code"] = r.status_code
                r.raise_for_status()
        async for ev in super().generate(prompt_token_ids, sampling, request_id, priority, arrival_time):
            yield ev


def test_trace_propagates_through_a_gateway_to_its_upstream(tmp_path, receiver):
    receiver.clear()
    (tmp_path / "up").mkdir()
    (tmp_path / "gw").mkdir()
    with fake_server(tmp_path / "up", tracing=_tracing(receiver)) as upstream:
        gateway_engine = ForwardingEngine(upstream.url)
        with fake_server(tmp_path / "gw", engine=gateway_engine, tracing=_tracing(receiver)) as gateway:
            r = _chat(gateway.url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "k=v"})
            assert r.status_code == 200
            _flush(gateway)
        _flush(upstream)
    spans = receiver.trace(CLIENT_TRACE)
    servers = [s for s in spans if s["kind"] == Span.SPAN_KIND_SERVER]
    assert {s["name"] for s in servers} == {"chat fake", "text_completion fake"}
    gw = next(s for s in servers if s["name"] == "chat fake")
    up = next(s for s in servers if s["name"] == "text_completion fake")
    failed, call = sorted((s for s in spans if s["kind"] == Span.SPAN_KIND_CLIENT), key=lambda s: s["start"])
    # client -> gateway request span -> its upstream calls -> the upstream's request span -> its stages
    assert gw["parent"] == CLIENT_SPAN
    assert call["name"] == failed["name"] == "upstream"
    assert call["parent"] == failed["parent"] == gw["span_id"]
    assert failed["status"] == Status.STATUS_CODE_ERROR and failed["status_message"] == "ConnectError"
    assert call["status"] == Status.STATUS_CODE_UNSET
    assert call["attrs"] == {"url.full": upstream.url + "/v1/completions", "server.address": "127.0.0.1",
                             "http.response.status_code": 200}
    assert up["parent"] == call["span_id"]
    assert gateway_engine.sent == [{"traceparent": f"00-{CLIENT_TRACE}-{s['span_id']}-01", "tracestate": "k=v"}
                                   for s in (failed, call)]
    assert sorted(s["name"] for s in spans if s["parent"] == up["span_id"]) == sorted(STAGES)
    # The upstream call happened inside the gateway's request, and the upstream's request inside the call
    # (one machine, one wall clock; each server anchors its own spans).
    assert gw["start"] <= failed["start"] <= failed["end"] <= call["start"] <= call["end"] <= gw["end"]
    assert call["start"] - 5_000_000 <= up["start"] and up["end"] <= call["end"] + 5_000_000


def test_tracing_off_changes_nothing(tmp_path):
    with fake_server(tmp_path) as server:
        assert server.state.tracer is None
        r = _chat(server.url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        assert r.status_code == 200 and "traceresponse" not in r.headers
        assert not any(m.cls.__name__ == "TraceContextMiddleware" for m in server.app.user_middleware)
    # A gateway's calls outside a traced request send nothing and record nothing.
    assert upstream_headers() == {}
    with upstream_call({"url.full": "http://x"}) as call:
        assert call.headers == {}


def test_endpoint_from_settings_flag_and_environment(monkeypatch, tmp_path):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(var, raising=False)
    assert not ServerConfig.load(model="fake").tracing.enabled
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-eu")
    cfg = ServerConfig.load(model="fake")
    assert cfg.tracing.otlp_endpoint == "http://collector:4318/v1/traces"
    assert cfg.tracing.service_name == "gw-eu"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:4318/custom")
    assert ServerConfig.load(model="fake").tracing.otlp_endpoint == "http://other:4318/custom"
    # The flag (an override) wins over the environment.
    cfg = ServerConfig.load(model="fake", tracing={"otlp_endpoint": "http://flag:4318"})
    assert cfg.tracing.otlp_endpoint == "http://flag:4318"
    # The file's section and the environment combine; an empty section is no section.
    (tmp_path / "a.yaml").write_text("model: fake\ntracing:\n  sample_ratio: 0.25\n")
    cfg = ServerConfig.load(tmp_path / "a.yaml")
    assert cfg.tracing.sample_ratio == 0.25 and cfg.tracing.otlp_endpoint == "http://other:4318/custom"
    (tmp_path / "b.yaml").write_text("model: fake\ntracing:\n")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert not ServerConfig.load(tmp_path / "b.yaml").tracing.enabled
    with pytest.raises(ValueError, match="otlp_endpoint must be an http"):
        ServerConfig.load(model="fake", tracing={"otlp_endpoint": "collector:4318"})
    with pytest.raises(ValueError, match="sample_ratio"):
        ServerConfig.load(model="fake", tracing={"otlp_endpoint": "http://x", "sample_ratio": 1.5})



def test_serve_subprocess_exports_on_shutdown(tmp_path, receiver):
    """``tailguard serve --model fake --otlp-endpoint URL``: the flag reaches the exporter, and what is still queued
    at SIGTERM is exported before the process ends (the batch would otherwise wait 5 s)."""
    receiver.clear()
    proc, url = start_serve("--model", "fake", "--store", str(tmp_path / "store.sqlite3"), "--otlp-endpoint",
                            receiver.url, "--no-access-log")
    try:
        r = _chat(url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "X-Request-ID": "cli-1"})
        assert r.status_code == 200
    finally:
        stop_serve(proc)
    req = _request_span(receiver.trace(CLIENT_TRACE))
    assert req["attrs"]["tailguard.request_id"] == "cli-1" and req["parent"] == CLIENT_SPAN
    assert json.loads(json.dumps(req["attrs"]))["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]


def test_an_unreachable_collector_never_fails_or_holds_a_request(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with fake_server(tmp_path, tracing={"otlp_endpoint": dead, "export_timeout_s": 1}) as server:
        for i in range(40):
            r = _chat(server.url, {"X-Request-ID": f"lost-{i}"})
            assert r.status_code == 200 and "traceresponse" in r.headers
        settle(server)
        assert server.state.tracer.force_flush(30) is True  # the export failed and was given up, not hung
    # The lifespan shut the tracer down and the server stopped (its thread ended within ThreadedServer's 15 s).
    assert not server._thread.is_alive()
    assert server.state.tracer is None


# --- unit checks: an upstream call's status, a client's trace headers ---------------------------------------------
def _traced(fn: Any) -> RequestTrace:
    """Run ``fn()`` (a coroutine function) as a traced request's task would; the request's trace."""
    trace = RequestTrace(trace_id=int(CLIENT_TRACE, 16), span_id=int(CLIENT_SPAN, 16), sampled=True)
    token = tracing._current.set(trace)
    try:
        asyncio.run(fn())
    finally:
        tracing._current.reset(token)
    return trace


async def _proxy(events: int, fail_after: int | None = None) -> AsyncIterator[str]:
    """A gateway's stream: its upstream call spans the events it relays."""
    with upstream_call({"url.full": "http://upstream/v1/chat/completions"}):
        for i in range(events):
            if i == fail_after:
                raise httpx.ReadError("upstream went away")
            yield f"event {i}"


def _upstream_span_status(trace: RequestTrace) -> tuple[int, str]:
    tl = Timeline(request_id="r", endpoint="/v1/chat/completions", received=1.0, received_unix=time.time(),
                  tokenized=1.01, scheduled=1.02, first_token=1.03, last_token=1.04, token_times=[1.03, 1.04],
                  num_output_tokens=2)
    tl.finalize(200, Outcome.SUCCESS, at=1.05)
    tracer = RequestTracer(TracingConfig(), exporter=InMemorySpanExporter())
    try:
        [span] = [s for s in tracer.spans(tl, trace) if s.name == "upstream"]
    finally:
        tracer.shutdown()
    return span.status.status_code, span.status.description or ""


@pytest.mark.parametrize("read", [3, 1], ids=["closed after its last event", "client gone mid-stream"])
def test_an_upstream_stream_closed_by_its_reader_is_no_failed_call(read):
    async def consume() -> None:
        stream = _proxy(events=3)
        for _ in range(read):  # the server stops at the last event (finish_reason), without asking for another
            await anext(stream)
        await stream.aclose()  # GeneratorExit inside the call's block

    trace = _traced(consume)
    [call] = trace.upstream
    assert call.error is None and call.end is not None
    assert _upstream_span_status(trace) == (StatusCode.UNSET, "")


def test_an_upstream_stream_that_fails_marks_its_call_failed():
    async def consume() -> None:
        with contextlib.suppress(httpx.ReadError):
            async for _ in _proxy(events=3, fail_after=1):
                pass

    trace = _traced(consume)
    assert trace.upstream[0].error == "ReadError"
    assert _upstream_span_status(trace) == (StatusCode.ERROR, "ReadError")


_VALID_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.mark.parametrize(("traceparent", "tracestate", "joins", "state"), [
    (_VALID_PARENT, "k=v,vendor@sys=x y", True, {"k": "v", "vendor@sys": "x y"}),
    (_VALID_PARENT + "x" * 600, None, False, {}),  # over 512 characters
    (_VALID_PARENT + "-00", None, False, {}),  # version 00 has exactly four fields
    (f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-" + "a" * 600, None, False, {}),  # a later version, over 512 characters
    (f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-later-fields", "k=v", True, {"k": "v"}),  # a later version: joined
    (f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01", None, False, {}),  # version ff is invalid
    (f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01", None, False, {}),  # hex is lower case
    ("garbage", "k=v", False, {}),
    (_VALID_PARENT, ",".join(f"k{i}=v" for i in range(33)), True, {}),  # over 32 members: tracestate dropped
    (_VALID_PARENT, "k=" + "v" * 600, True, {}),  # over 512 characters
    (_VALID_PARENT, "k=v,BAD KEY=v", True, {}),  # a malformed member drops it whole
    (_VALID_PARENT, "k=v,empty=", True, {}),
    (_VALID_PARENT, "k=v,k=w", True, {}),  # a key twice
    (_VALID_PARENT, "k=v,,  l=w ", True, {"k": "v", "l": "w"}),  # empty members and spaces are allowed
], ids=["valid", "long-00", "00-with-more-fields", "long-later-version", "later-version", "version-ff", "upper-case",
        "garbage", "33-members", "long-tracestate", "malformed-member", "empty-value", "duplicate-key",
        "empty-members"])
def test_a_clients_trace_headers_never_log_and_decide_the_trace(caplog, traceparent, tracestate, joins, state):
    tracer = RequestTracer(TracingConfig(), exporter=InMemorySpanExporter())
    try:
        with caplog.at_level(logging.DEBUG):
            trace = tracer.begin(traceparent, tracestate)
    finally:
        tracer.shutdown()
    assert caplog.records == []
    assert (trace.parent is not None) == joins
    assert (trace.trace_id == int(CLIENT_TRACE, 16)) == joins  # a new trace otherwise
    assert dict(trace.trace_state) == state
    assert trace.new_upstream_call().headers.get("tracestate") == (",".join(f"{k}={v}" for k, v in state.items())
                                                                   or None)
