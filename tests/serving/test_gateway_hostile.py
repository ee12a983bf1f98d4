"""The gateway under hostile conditions, over scripted upstreams on 127.0.0.1 (aiohttp apps that play an engine's
part: its model list, its health endpoints, and a completion handler each test writes):

- a query of death (a request that crashes the replica it reaches) is tried on two replicas at most, then refused at
  the gateway for a while;
- health is read where each engine kind says it (a replica whose engine died still lists its models), consecutive
  5xx open a replica's breaker, and the gateway's own /ready says 503 when no replica can serve;
- every lane over upstreams keeps time by default: a replica that stops sends keep-alives, then the answer goes on
  elsewhere or ends;
- an upstream's 4xx is the client's: passed on as the upstream wrote it, never counted against the SLO;
- /admin/upstreams refuses link-local and cloud metadata addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from tailguard.backends.upstream.pool import UpstreamConfig, UpstreamPool
from tailguard.policy import lanes as lanes_mod
from tailguard.serving.backend_factory import build_backend
from tailguard.serving.config import ServerConfig
from tailguard.serving.server import ThreadedServer
from tests.net import free_port
from tests.serving.test_gateway import _answers
from tests.serving_helpers import ADMIN, make_config, settle, wait_until

Handler = Callable[["Upstream", web.Request, dict], Awaitable[web.StreamResponse]]


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    obj = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Upstream:
    """A scripted OpenAI-compatible engine on a free loopback port, in a thread of its own.

    ``owned_by`` is what its /v1/models says (how the gateway tells the engine); ``status`` the status of each of its
    health endpoints; ``answer`` the completion handler; ``hits`` the bodies it was sent. Handlers that stall wait on
    ``release`` (set on the way out)."""

    def __init__(self, owned_by: str = "tailguard", answer: Handler | None = None, text: str = "ok") -> None:
        self.owned_by = owned_by
        self.status = {"/ready": 200, "/health": 200, "/v1/models": 200}
        self.answer: Handler = answer or tokens
        self.text = text  # what ``tokens`` answers, one character a token
        self.hits: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.release: asyncio.Event | None = None

    async def _probe(self, request: web.Request) -> web.Response:
        status = self.status.get(request.path, 404)
        if request.path == "/v1/models" and status == 200:
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model",
                                                                  "owned_by": self.owned_by}]})
        return web.json_response({"status": "ok" if status == 200 else "down"}, status=status)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.hits.append(body)
        return await self.answer(self, request, body)

    @contextlib.contextmanager
    def running(self) -> Iterator[Upstream]:
        app = web.Application()
        for path in ("/ready", "/health", "/v1/models"):
            app.router.add_get(path, self._probe)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        runner = web.AppRunner(app, shutdown_timeout=1.0)

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.release = asyncio.Event()
            self.loop.run_until_complete(runner.setup())
            self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            self.loop.run_forever()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            assert wait_until(lambda: _answers(self.url), timeout=10, interval=0.05)
            yield self
        finally:
            self.loop.call_soon_threadsafe(lambda: self.release.set())  # type: ignore[union-attr]
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            thread.join(10)


async def tokens(up: Upstream, request: web.Request, body: dict, stall_after: int | None = None
                 ) -> web.StreamResponse:
    """A streamed answer of ``up.text``; ``stall_after``: that many tokens, then nothing (a stopped replica)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        for i, ch in enumerate(up.text):
            if i == stall_after:
                assert up.release is not None
                await up.release.wait()
                return resp
            await resp.write(_chunk({"content": ch}))
        await resp.write(_chunk({}, "stop"))
        usage = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 3, "completion_tokens": len(up.text), "total_tokens": 3 + len(up.text)}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
    return resp


@contextlib.contextmanager
def gateway(tmp: Path, upstreams: list[str | dict], **cfg: Any) -> Iterator[ThreadedServer]:
    config = make_config(tmp, upstreams=[u if isinstance(u, dict) else {"url": u} for u in upstreams], **cfg)
    with ThreadedServer(config, engine_factory=lambda: build_backend(config)) as server:
        assert wait_until(lambda: server.state.ready, timeout=30)
        yield server


def chat(url: str, content: str = "hello", stream: bool = False, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "stream": stream,
            **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=20)


def record(server: ThreadedServer, r: httpx.Response) -> dict:
    settle(server)
    rec = server.state.store.get(r.headers["x-request-id"])
    assert rec is not None
    return rec


# --- (a) a query of death ---------------------------------------------------------------------------------------------
async def _reset(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
    """The engine dies under the request: the connection is cut before any answer."""
    assert request.transport is not None
    request.transport.abort()
    return web.Response()


async def _engine_error(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
    return web.json_response({"error": {"message": "engine crashed", "type": "server_error"}}, status=500)


@pytest.mark.parametrize("crash", [_reset, _engine_error], ids=["connection_reset", "http_500"])
def test_a_query_of_death_reaches_two_replicas_at_most_then_is_refused_at_the_gateway(tmp_path, crash):
    async def poisoned(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
        if "POISON" in json.dumps(body):
            return await crash(up, request, body)
        return await tokens(up, request, body)

    ups = [Upstream(answer=poisoned) for _ in range(4)]
    with contextlib.ExitStack() as stack:
        for up in ups:
            stack.enter_context(up.running())
        gw = stack.enter_context(gateway(tmp_path, [u.url for u in ups], routing={"retries": 3}))
        r = chat(gw.url, "POISON", max_tokens=8)
        assert r.status_code == 502, r.text
        poisoned_hits = sum(1 for up in ups for b in up.hits if "POISON" in json.dumps(b))
        assert poisoned_hits == 2  # retried once after the first replica failed under it, not on the whole fleet
        assert record(gw, r)["outcome"] == "error"  # the replicas' failure is the service's
        assert "refused for 300 s" in r.json()["error"]["message"]
        # The same request again, streamed or not, from another user: refused at the gateway, no replica sees it.
        for again in (chat(gw.url, "POISON"), chat(gw.url, "POISON", stream=True, user="someone-else")):
            assert again.status_code == 422, again.text
            err = again.json()["error"]
            assert err["code"] == "request_quarantined" and err["type"] == "invalid_request_error"
            assert 1 <= int(again.headers["retry-after"]) <= 300
            assert record(gw, again)["outcome"] == "invalid"
        assert sum(1 for up in ups for b in up.hits if "POISON" in json.dumps(b)) == 2
        # Every other request is served as before.
        ok = [chat(gw.url, f"fine {i}") for i in range(6)]
        assert all(x.status_code == 200 for x in ok), [x.text for x in ok]
        httpx.get(gw.url + "/metrics")  # samples the gateway's counters
        reg = gw.state.metrics.registry
        assert reg.get_sample_value("tailguard_upstream_quarantine_requests_total",
                                    {"model": "m", "event": "refused"}) == 2


def test_replicas_that_merely_cannot_take_a_request_do_not_implicate_it(tmp_path):
    """No connection, a 503 (not ready, overloaded): the replica never held the request, which goes on to the
    next replica as before (all retries) and is not held against it."""
    async def unavailable(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
        return web.json_response({"error": {"message": "not ready"}}, status=503)

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Upstream(answer=unavailable).running() as busy, Upstream().running() as good, \
            gateway(tmp_path, [dead, busy.url, good.url], routing={"health_interval_s": 60}) as gw:
        pool = gw.state.engine.pool
        for rep in pool.replicas:
            rep.healthy = True  # as if the checks had not noticed yet
        by_url = {rep.url: rep for rep in pool.replicas}
        by_url[good.url].outstanding_tokens += 10 ** 9  # the two that fail are tried first
        by_url[busy.url].outstanding_tokens += 10 ** 6
        r = chat(gw.url, "anything")
        assert r.status_code == 200, r.text
        assert record(gw, r)["gateway"]["attempts"] == 3
        assert not pool.quarantine.entries  # nothing held against the request


# --- (b) health ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("owned_by", "kind", "down"), [
    ("tailguard", "tailguard", {"/ready": 503, "/health": 503}),  # its engine died: /v1/models still answers
    ("vllm", "vllm", {"/health": 500}),
    ("sglang", "sglang", {"/health": 503}),
    ("llamacpp", "llamacpp", {"/health": 503}),  # still loading its model
    ("acme", "vllm", {"/health": 500}),  # an engine the gateway cannot tell: its kind configured
])
def test_health_is_read_where_each_engine_kind_says_it(tmp_path, owned_by, kind, down):
    with Upstream(owned_by=owned_by).running() as up:
        up.status.update(down)
        spec: dict[str, Any] = {"url": up.url}
        if owned_by == "acme":
            spec["kind"] = kind
        with gateway(tmp_path, [spec], routing={"health_interval_s": 0.1}) as gw:
            rep = gw.state.engine.pool.replicas[0]
            assert rep.healthy is False
            ready = httpx.get(gw.url + "/ready")
            assert ready.status_code == 503 and "health check" in ready.json()["error"]
            assert rep.kind == kind
            assert chat(gw.url).status_code == 503
            up.status.update({k: 200 for k in down})  # the engine is back
            assert wait_until(lambda: rep.healthy, timeout=5)
            assert httpx.get(gw.url + "/ready").status_code == 200
            assert chat(gw.url).status_code == 200
            listed = httpx.get(gw.url + "/admin/upstreams", headers=ADMIN).json()["data"]
            assert listed[0]["kind"] == kind


def test_consecutive_engine_failures_open_the_breaker_and_a_passing_health_check_does_not_close_it(tmp_path):
    """The replica answers its health check and fails every request: its breaker opens after breaker_failures and
    stays open through the health checks (only its cooldown's trial may close it); the gateway is not ready."""
    with Upstream(answer=_engine_error).running() as up, \
            gateway(tmp_path, [up.url], routing={"health_interval_s": 0.05, "breaker_failures": 3,
                                                 "breaker_cooldown_s": 60}) as gw:
        rep = gw.state.engine.pool.replicas[0]
        codes = [chat(gw.url, f"q{i}").status_code for i in range(3)]
        assert codes == [502, 502, 502]
        assert rep.breaker.state == "open"
        time.sleep(0.5)  # ten health checks, each passing
        assert rep.healthy and rep.breaker.state == "open"
        assert httpx.get(gw.url + "/ready").status_code == 503
        r = chat(gw.url, "one more")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_upstream"
        assert len(up.hits) == 3


# --- (c) no silent stream ------------------------------------------------------------------------------------------------
def test_every_lane_over_upstreams_keeps_time_by_default(tmp_path):
    over = ServerConfig(upstreams=[{"url": "http://127.0.0.1:9"}],
                        lanes={"standard": {"priority": 1}, "raw": {"priority": 2, "itl_deadline_s": None},
                               "tight": {"priority": 3, "ttft_deadline_s": 2.0}}, default_lane="standard")
    lanes = over.lane_configs()
    std = lanes["standard"]
    assert (std.ttft_deadline_s, std.itl_deadline_s, std.keepalive_s) == (15.0, 3.0, 5.0)
    assert std.stall_fallback == "replica"
    assert lanes["raw"].itl_deadline_s is None and lanes["raw"].ttft_deadline_s == 15.0  # null: switched off
    assert lanes["tight"].ttft_deadline_s == 2.0
    defaults = ServerConfig(upstreams=[{"url": "http://127.0.0.1:9"}]).lane_configs()
    assert all(lane.ttft_deadline_s and lane.itl_deadline_s and lane.keepalive_s for lane in defaults.values())
    embedded = ServerConfig(keys_file=None, lanes={"standard": {"priority": 1}}).lane_configs()
    assert embedded["standard"].ttft_deadline_s is None  # the embedded engine's lanes are as configured


@pytest.fixture
def quick_deadlines(monkeypatch):
    """The upstream defaults, scaled down so that a stall is seen in a fraction of a second."""
    monkeypatch.setattr(lanes_mod, "UPSTREAM_TTFT_DEADLINE_S", 0.3, raising=False)
    monkeypatch.setattr(lanes_mod, "UPSTREAM_ITL_DEADLINE_S", 0.2, raising=False)
    monkeypatch.setattr(lanes_mod, "UPSTREAM_KEEPALIVE_S", 0.1, raising=False)


def test_a_stopped_replica_sends_keepalives_then_the_stream_ends(tmp_path, quick_deadlines):
    async def stopped(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
        return await tokens(up, request, body, stall_after=0)  # the head, the role chunk, then nothing

    with Upstream(answer=stopped).running() as up, gateway(tmp_path, [up.url]) as gw:
        t0 = time.perf_counter()
        r = chat(gw.url, stream=True)
        took = time.perf_counter() - t0
        assert r.status_code == 200 and took < 5  # not the client's 20 s timeout
        lines = [x for x in r.text.splitlines() if x]
        assert lines[0] == ": keep-alive"  # bytes while the first token was pending
        assert "service is overloaded" in r.text and lines[-1] == "data: [DONE]"
        rec = record(gw, r)
        assert rec["degraded"] is True and rec["gateway"]["ttft_misses"] == 3


def test_a_replica_stopped_mid_stream_hands_the_answer_to_another(tmp_path, quick_deadlines):
    async def stops_after_two(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
        return await tokens(up, request, body, stall_after=2)

    with Upstream(answer=stops_after_two, text="ABCDEFGH").running() as stuck, \
            Upstream(text="abcdef").running() as good, gateway(tmp_path, [stuck.url, good.url]) as gw:
        pool = gw.state.engine.pool
        next(r for r in pool.replicas if r.url == good.url).outstanding_tokens += 10 ** 9  # the stuck one first
        r = chat(gw.url, stream=True)
        assert r.status_code == 200
        data = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
        assert data[-1] == "[DONE]"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, data[:-1])
                       if c.get("choices"))
        assert text == "AB" + "abcdef"  # two tokens, then the continuation at the healthy replica
        assert record(gw, r)["gateway"]["fallback"]["outcome"] == "ok"


# --- (d) errors charged to who caused them ---------------------------------------------------------------------------------
VLLM_400 = {"object": "error", "message": "prompt must not be empty", "type": "BadRequestError", "param": "prompt",
            "code": 400}


async def _refuse(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
    return web.json_response(VLLM_400, status=400)


def test_an_upstream_refusal_reaches_the_client_unchanged_and_is_not_a_service_error(tmp_path):
    with Upstream(owned_by="vllm", answer=_refuse).running() as up, gateway(tmp_path, [up.url]) as gw:
        out = [chat(gw.url, f"bad {i}", stream=i % 2 == 1) for i in range(40)]
        for r in out:
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {k: VLLM_400[k] for k in ("message", "type", "param", "code")}
        recs = [record(gw, r) for r in out]
        assert {rec["outcome"] for rec in recs} == {"invalid"}
        rep = gw.state.engine.pool.replicas[0]
        assert rep.breaker.state == "closed" and rep.errors == 0  # the replica did nothing wrong
        ev = gw.state.slo.evaluate()
        assert all(v["error_rate"] in (None, 0.0) for v in ev.scopes.values())  # never in the error ratio
        text = httpx.get(gw.url + "/metrics").text
        assert 'outcome="error"' not in "\n".join(x for x in text.splitlines() if x.startswith("tailguard_requests_total"))


def test_invalid_requests_through_a_tailguard_replica_stay_the_clients(tmp_path):
    """The report's case: ``{"prompt": [[]]}`` through the gateway to a real ``tailguard serve`` replica, forty
    times. Each is the replica's own 400, word for word; the SLO's error ratio stays at zero."""
    from tests.serving.test_gateway import replica

    with replica(tmp_path, "a", ttft=0.005, itl=0.001) as a, gateway(tmp_path, [a.url]) as gw:
        direct = httpx.post(a.url + "/v1/completions", json={"model": "fake", "prompt": [[]]}, timeout=20)
        assert direct.status_code == 400
        good = [httpx.post(gw.url + "/v1/completions", json={"model": "fake", "prompt": "Once", "max_tokens": 2},
                           timeout=20) for _ in range(4)]
        assert all(r.status_code == 200 for r in good)
        bad = [httpx.post(gw.url + "/v1/completions", json={"model": "fake", "prompt": [[]], "stream": i % 2 == 1},
                          timeout=20) for i in range(40)]
        assert all(r.status_code == 400 and r.json() == direct.json() for r in bad), bad[0].text
        assert {record(gw, r)["outcome"] for r in bad} == {"invalid"}
        scopes = gw.state.slo.evaluate().scopes
        assert scopes and all(v["error_rate"] in (None, 0.0) for v in scopes.values())
        assert any(v["error_rate"] == 0.0 for v in scopes.values())  # 4 served, none failed


def test_an_upstream_refusal_after_the_streams_status_went_out_is_passed_on_in_the_error_event(tmp_path):
    async def slow_refusal(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
        if body["messages"][0]["content"] == "event":  # vLLM's way once its stream has begun: an error event
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps({"error": VLLM_400}).encode() + b"\n\n")
            await resp.write_eof()
            return resp
        await asyncio.sleep(0.4)  # the gateway's keep-alive has sent the stream's 200 by then
        return web.json_response(VLLM_400, status=400)

    lanes = {"standard": {"priority": 1, "keepalive_s": 0.1}}
    with Upstream(answer=slow_refusal).running() as up, gateway(tmp_path, [up.url], lanes=lanes) as gw:
        for content in ("late", "event"):
            r = chat(gw.url, content, stream=True)
            assert r.status_code == 200
            data = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
            assert data[-1] == "[DONE]"
            err = json.loads(data[-2])["error"]
            assert (err["message"], err["type"], err["code"]) == (VLLM_400["message"], "BadRequestError", 400)
            assert record(gw, r)["outcome"] == "invalid"


# --- (e) /admin/upstreams ------------------------------------------------------------------------------------------------
def test_admin_refuses_link_local_upstreams(tmp_path):
    with Upstream().running() as up, gateway(tmp_path, [up.url]) as gw:
        for url in ("http://169.254.10.10:8000", "http://[fe80::1]:8000"):
            r = httpx.post(gw.url + "/admin/upstreams", json={"url": url}, headers=ADMIN, timeout=10)
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "upstream_forbidden" and "link-local" in r.json()["error"]["message"]
        assert [x["url"] for x in httpx.get(gw.url + "/admin/upstreams", headers=ADMIN).json()["data"]] == [up.url]


@pytest.mark.parametrize(("url", "refused"), [
    ("http://169.254.169.254/latest", "cloud metadata"),
    ("http://[fd00:ec2::254]", "cloud metadata"),
    ("http://metadata.google.internal", "cloud metadata"),
    ("http://METADATA.Google.Internal.:80", "cloud metadata"),
    ("http://[::ffff:169.254.169.254]", "cloud metadata"),
    ("http://2852039166", "cloud metadata"),  # 169.254.169.254 spelt as one number
    ("http://169.254.1.1:8000", "link-local"),
    ("http://[fe80::1%25eth0]:8000", "link-local"),
    ("http://127.0.0.1:8000", None),
    ("http://10.1.2.3:8000", None),
    ("http://[fd00::1]:8000", None),
])
def test_link_local_and_metadata_addresses_are_told_apart(url, refused):
    from tailguard.backends.upstream.pool import forbidden_address

    why = asyncio.run(forbidden_address(url))
    assert (why is None) if refused is None else (why is not None and refused in why), why


def test_link_local_upstreams_are_added_when_the_config_allows_them():
    async def add(allow: bool) -> str:
        pool = UpstreamPool([UpstreamConfig(url="http://127.0.0.1:9")], routing=None)
        pool.routing.allow_link_local = allow
        try:
            await pool.add(UpstreamConfig(url="http://169.254.169.254"))  # no session: nothing is sent
        except ValueError as exc:
            return type(exc).__name__
        return "added"

    assert asyncio.run(add(False)) == "UpstreamForbidden"
    assert asyncio.run(add(True)) == "added"


def test_the_quarantine_keys_requests_by_their_canonical_body_and_forgets_in_time():
    from tailguard.backends.upstream.quarantine import Quarantine, fingerprint

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "temperature": 0}
    same = {"temperature": 0, "max_tokens": 8, "messages": [{"content": "x", "role": "user"}], "model": "other",
            "stream": True, "stream_options": {"include_usage": True}, "user": "u2", "priority": -3}
    assert fingerprint(same) == fingerprint(body)  # key order and fields that change nothing
    assert fingerprint({**body, "max_tokens": 9}) != fingerprint(body)
    assert fingerprint({**body, "messages": [{"role": "user", "content": "x\ud800"}]})  # a lone surrogate hashes

    now = [0.0]
    q = Quarantine(after=2, ttl_s=300, max_entries=3, clock=lambda: now[0])
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    assert not q.holding and q.left(a) is None
    assert q.failed(a, "r1") is False and q.holding and q.left(a) is None and q.refusing == 0
    q.succeeded(a)  # it completed elsewhere: the failure was not its doing
    assert not q.holding
    assert q.failed(a, "r1") is False and q.failed(a, "r1") is True  # one replica twice counts too
    assert q.refusing == 1 and q.refused(a) == 300 and q.refused_total == 1
    q.succeeded(a)  # a quarantine is not lifted by a success
    now[0] = 299.0
    assert q.left(a) == pytest.approx(1.0)
    now[0] = 300.5
    assert q.left(a) is None and q.refusing == 0 and not q.holding
    for fp in (a, b, c, "d" * 32):  # bounded: the oldest goes first
        q.failed(fp, "r1")
    assert list(q.entries) == [b, c, "d" * 32]
    now[0] = 601.0
    assert not q.holding  # failures are forgotten after the ttl
    assert Quarantine(after=0).failed(a, "r1") is False  # off


# --- (f) what an upstream sends is bounded and checked -----------------------------------------------------------------
async def _endless_line(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
    """A data line that never ends: 6 MiB of it, 64 KiB a write, then the replica waits."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "')
        for _ in range(96):
            await resp.write(b"x" * 65536)
        assert up.release is not None
        await up.release.wait()
    return resp


async def _past_max_tokens(up: Upstream, request: web.Request, body: dict) -> web.StreamResponse:
    up.text = "y" * 400  # 400 tokens for max_tokens 8
    return await tokens(up, request, body)


def test_an_upstream_line_that_never_ends_fails_its_attempt_and_nobody_else_waits(tmp_path):
    bad, good = Upstream(answer=_endless_line), Upstream()
    with bad.running(), good.running(), gateway(tmp_path, [bad.url], routing={"retries": 0}) as gw:
        t = time.perf_counter()
        r = chat(gw.url, "endless", stream=True)
        assert time.perf_counter() - t < 10
        assert r.status_code == 200 and '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        assert "SSE line longer than" in r.text
        assert record(gw, r)["status"] == 502
        assert httpx.get(gw.url + "/health", timeout=5).status_code == 200


def test_a_replica_that_answers_past_max_tokens_does_not_draw_all_the_traffic(tmp_path):
    over, fair = Upstream(answer=_past_max_tokens), Upstream()
    with over.running(), fair.running(), gateway(tmp_path, [over.url, fair.url],
                                                 routing={"health_interval_s": 60}) as gw:
        for i in range(6):
            assert chat(gw.url, f"warm {i}", stream=True).status_code == 200
        replicas = gw.state.engine.pool.replicas
        assert all(r.outstanding_tokens == 0 for r in replicas), [(r.name, r.outstanding_tokens) for r in replicas]
        before = len(fair.hits)
        for i in range(20):
            assert chat(gw.url, f"after {i}").status_code == 200
        assert len(fair.hits) - before >= 4  # both replicas still share the load
