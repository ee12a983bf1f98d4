"""The gateway's direct relay (backends/upstream/relay.py, serving/client_relay.py): plain tokens written to the client from
the upstream read callback, everything else through the server's stream, in order.

The feed is tested with a scripted relay (which tokens it takes, what it leaves for the reader, in which order); the
whole path through a gateway in front of a scripted upstream, with the relay on and off: the same answer, byte for
byte apart from the ids, and the record's times for every token."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tailguard.backends.upstream.relay import UpstreamFeed
from tailguard.observe.timeline import Timeline
from tailguard.serving.client_relay import ClientRelay, RelayFlusher
from tests.serving.test_gateway import _upstream_chunk, gateway, record, scripted_upstream
from tests.serving_helpers import read_during


class ScriptedRelay:
    def __init__(self, refuse: set[str] | None = None) -> None:
        self.armed = True
        self.written: list[str] = []
        self.refuse = refuse or set()
        self.opening: Any = None
        self.first: list[str] = []

    def token(self, text: str, produced: float) -> bool:
        if text in self.refuse:
            return False
        self.written.append(text)
        return True

    def first_token(self, text: str) -> bool:
        self.first.append(text)
        self.opening = None
        return True


class Replica:
    outstanding_tokens = 10


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


ROLE = sse(_upstream_chunk({"role": "assistant", "content": ""}))
LAST = sse(_upstream_chunk({"content": "!"}, "stop"))


def payloads(feed: UpstreamFeed) -> list[bytes]:
    return [p for p, _ in feed.take()]


def test_plain_tokens_go_to_the_relay_and_the_rest_to_the_reader_in_order():
    relay, rep = ScriptedRelay(), Replica()
    feed = UpstreamFeed(chat=True, relay=relay, replica=rep)
    stream = ROLE + b"".join(sse(_upstream_chunk({"content": t})) for t in ("a", "b")) + LAST + sse(b"[DONE]")
    feed(stream[:7])  # a line cut anywhere waits for its end
    assert feed.take() == [] and relay.written == []
    feed(stream[7:])
    # The role chunk holds nothing for anyone: dropped. The first token is the reader's; behind it in the queue, the
    # tokens must wait too (no overtaking).
    got = payloads(feed)
    assert relay.written == [] and len(got) == 4 and got[-1] == b"[DONE]"
    assert json.loads(got[0])["choices"][0]["delta"]["content"] == "a"
    # With the queue empty, plain tokens go straight out; the last chunk (a finish reason) and [DONE] do not.
    feed(b"".join(sse(_upstream_chunk({"content": t})) for t in ("c", "d")) + LAST + sse(b"[DONE]"))
    assert relay.written == [] and feed.ended  # [DONE] came before: nothing after it is relayed
    feed2 = UpstreamFeed(chat=True, relay=relay, replica=rep, charge=10)
    # An attempt's first token is the reader's, even with the relay armed and nothing queued (the stall watch's
    # first-token phase must see it: a fallback's continuation starts with the relay armed).
    feed2(sse(_upstream_chunk({"content": "b0"})))
    assert relay.written == [] and [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads(feed2)] == \
        ["b0"]
    # Taken by the reader, b0 is on its way to the server's stream, which is no longer waiting: the relay is off, so
    # a token read now queues behind b0 instead of overtaking it (seen as "ABbacdef" in a stall fallback).
    assert not relay.armed
    feed2(sse(_upstream_chunk({"content": "b1"})))
    assert relay.written == [] and [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads(feed2)] == \
        ["b1"]
    relay.armed = True  # the server's stream wrote them and waits again
    feed2(b"".join(sse(_upstream_chunk({"content": t})) for t in ("c", "d")) + LAST + sse(b"[DONE]"))
    assert relay.written == ["c", "d"] and feed2.relayed == 2 and rep.outstanding_tokens == 8
    assert [json.loads(p)["choices"][0]["finish_reason"] for p in payloads(feed2)[:1]] == ["stop"]


def test_a_replica_answering_past_its_charge_never_counts_below_what_the_attempt_added():
    """An upstream that sends more tokens than max_tokens (the attempt's charge) must not leave its replica with
    negative outstanding tokens: routing takes the least loaded, and would send it everything from then on."""
    relay, rep = ScriptedRelay(), Replica()
    rep.outstanding_tokens = 3
    feed = UpstreamFeed(chat=True, relay=relay, replica=rep, charge=3)
    feed(sse(_upstream_chunk({"content": "t0"})))
    payloads(feed)
    relay.armed = True
    feed(b"".join(sse(_upstream_chunk({"content": f"t{i}"})) for i in range(1, 50)))
    assert feed.relayed == 49 and rep.outstanding_tokens == 0 and feed.left == 0
    feed.release(5)
    assert rep.outstanding_tokens == 0


def test_the_first_token_is_written_at_once_when_the_stream_waits_for_it_and_still_goes_to_the_reader():
    relay, rep_ = ScriptedRelay(), Replica()
    relay.armed = False  # before the first token the relay is never armed for the later tokens
    relay.opening = lambda text: text.encode()
    feed = UpstreamFeed(chat=True, relay=relay, replica=rep_)
    feed(ROLE + sse(_upstream_chunk({"content": "t0"})) + sse(_upstream_chunk({"content": "t1"})))
    assert relay.first == ["t0"] and relay.written == [] and feed.relayed == 0
    # The reader still gets it (the timeline, the stall watch, the retry rule), then the next one, in order.
    assert [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads(feed)] == ["t0", "t1"]
    # Only an attempt's first token, and only with nothing queued before it (an error, a last chunk).
    relay.opening = lambda text: text.encode()
    feed(sse(_upstream_chunk({"content": "t2"})))
    assert relay.first == ["t0"]
    late = UpstreamFeed(chat=True, relay=relay)
    late(sse(_upstream_chunk({"content": "x"}, "stop")) + sse(_upstream_chunk({"content": "y"})))
    assert relay.first == ["t0"] and len(payloads(late)) == 2


def test_a_disarmed_or_refusing_relay_leaves_tokens_to_the_reader():
    relay = ScriptedRelay(refuse={"b"})
    feed = UpstreamFeed(chat=True, relay=relay)
    feed(sse(_upstream_chunk({"content": "first"})))  # the attempt's first token: the reader's
    assert len(payloads(feed)) == 1
    relay.armed = True  # the server's stream wrote it and waits again
    feed(sse(_upstream_chunk({"content": "a"})) + sse(_upstream_chunk({"content": "b"}))
         + sse(_upstream_chunk({"content": "c"})))
    # "b" refused: queued, and "c" behind it queued too.
    assert relay.written == ["a"] and [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads(feed)] == \
        ["b", "c"]
    relay.armed = False
    feed(sse(_upstream_chunk({"content": "d"})))
    assert relay.written == ["a"] and len(payloads(feed)) == 1
    # No relay at all: the plain reader's queue.
    plain = UpstreamFeed(chat=False, relay=None)
    plain(b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n')
    assert plain.relayed == 0 and len(plain.take()) == 1


def test_the_last_line_without_its_end_is_given_at_the_end():
    feed = UpstreamFeed(chat=True, relay=None)
    feed(b"data: [DONE]")
    assert feed.take() == [] and [p for p, _ in feed.end()] == [b"[DONE]"]


def test_client_relay_only_over_uvicorns_own_send():
    async def send(message: dict) -> None:  # any other server, or a middleware's wrapper
        pass

    assert ClientRelay.for_send(send, RelayFlusher()) is None
    assert ClientRelay.for_send(object(), RelayFlusher()) is None


class FakeTransport:
    def __init__(self, log: list) -> None:
        self.log, self.closing = log, False

    def write(self, data: bytes) -> None:
        self.log.append(data)

    def is_closing(self) -> bool:
        return self.closing


class FakeFlow:
    write_paused = False


class FakeCycle:  # the attributes of uvicorn's response cycle the relay reads
    def __init__(self, transport: FakeTransport) -> None:
        self.transport, self.flow = transport, FakeFlow()
        self.disconnected = self.response_complete = False
        self.chunked_encoding = True


def _relay(log: list, flusher: RelayFlusher) -> tuple[ClientRelay, Timeline]:
    relay = ClientRelay(FakeCycle(FakeTransport(log)), flusher)
    tl = Timeline(request_id="r", endpoint="/v1/chat/completions")
    relay.bind(tl, lambda text: text.encode(), None)
    relay.armed = True
    return relay, tl


def _two_relays() -> tuple[list, RelayFlusher, tuple[ClientRelay, Timeline], tuple[ClientRelay, Timeline]]:
    """Two clients' relays on one loop's flusher, writing into one log."""
    log: list = []
    flusher = RelayFlusher()
    return log, flusher, _relay(log, flusher), _relay(log, flusher)


def test_relayed_chunks_leave_after_the_work_their_turn_made_ready():
    """A burst of tokens must not go ahead of a new request's first step or a first token (the TTFT path)."""
    async def main() -> list:
        log: list = []
        loop = asyncio.get_running_loop()
        relay, tl = _relay(log, RelayFlusher())

        def read_callback() -> None:
            assert relay.token("a", 1.0) and relay.token("bc", 1.1)
            loop.call_soon(log.append, "task made ready by the same turn")

        loop.call_soon(read_callback)
        await asyncio.sleep(0.01)
        assert tl.token_times == [1.0, 1.1] and len(tl.token_sent) == 2
        return log

    assert asyncio.run(main()) == ["task made ready by the same turn", b"1\r\na\r\n", b"2\r\nbc\r\n"]


def test_the_stream_settles_what_is_held_before_it_writes_and_a_gone_client_gets_nothing():
    async def main() -> None:
        log, flusher, (relay, tl), (other, _) = _two_relays()
        assert relay.token("a", 1.0) and other.token("b", 1.0)
        relay.settle()  # the server's stream is about to write: held chunks first, in order
        assert log == [b"1\r\na\r\n", b"1\r\nb\r\n"]
        relay._cycle.transport.closing = True
        assert relay.token("c", 2.0)
        await asyncio.sleep(0.01)
        assert len(log) == 2 and len(tl.token_sent) == 1  # never written, never counted as sent
        relay._cycle.disconnected = True
        assert not relay.token("d", 3.0)  # refused: the stream's own path sees the disconnect
        relay._cycle.disconnected, relay.armed = False, False
        assert not relay.token("e", 3.0)

    asyncio.run(main())


TEXTS = ["Hel", "lo, ", 'a "quoted"\nline', " caf\u00e9 \U0001f600", " back\\slash", " and", " more", "."]


@pytest.fixture(scope="module")
def spaced_stream() -> bytes:
    """Tokens a few milliseconds apart (written one chunk at a time): after the first, the relay's to take."""
    events = [_upstream_chunk({"role": "assistant", "content": ""})]
    events += [_upstream_chunk({"content": t}) for t in TEXTS[:-1]]
    events += [_upstream_chunk({"content": TEXTS[-1]}, "length"),
               {**_upstream_chunk({}), "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 8,
                                                               "total_tokens": 19}}]
    lines = [json.dumps(e).encode() for e in events] + [b"[DONE]"]
    width = max(len(x) for x in lines)
    # Padded to one length (blanks are allowed around JSON), so that a fixed write size is one event a write.
    return b"".join(sse(x.ljust(width)) for x in lines)


def _answer(url: str) -> tuple[httpx.Response, list[dict]]:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    data = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return r, [json.loads(x) for x in data[:-1]]


def test_the_relay_gives_the_same_answer_and_times_every_token(tmp_path, spaced_stream):
    answers = {}
    for on in (True, False):
        # One event a write, 20 ms apart: each token arrives alone, while the server's stream waits.
        size = spaced_stream.index(b"\n\n") + 2
        with scripted_upstream(spaced_stream, size, pause_s=0.02) as up, \
                gateway(tmp_path, [up], direct_relay=on) as gw:
            r, chunks = _answer(gw.url)
            rec = record(gw, r)
        for c in chunks:  # the gateway's own id and creation time differ between the two answers
            c.pop("id")
            c.pop("created")
            c.pop("tailguard", None)
        answers[on] = chunks
        assert rec["output_tokens"] == 8
        # Every token on the timeline: when it came from the replica, and when it left, in order.
        assert len(rec["token_times"]) == 8 and len(rec["token_sent"]) == 8
        assert rec["token_sent"] == sorted(rec["token_sent"]) and rec["token_times"] == sorted(rec["token_times"])
        assert all(s >= t for s, t in zip(rec["token_sent"], rec["token_times"], strict=True))
        direct = rec["gateway"].get("direct_tokens", 0)
        # On: all but the first token (it opens the response) and the last (it carries the finish reason).
        assert direct == (len(TEXTS) - 2 if on else 0)
        # The first token itself, with the role chunk, was written from the upstream's read (on).
        assert rec["gateway"].get("first_token_direct", False) is on
    assert answers[True] == answers[False]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in answers[True] if c["choices"]) == \
        "".join(TEXTS)


@pytest.mark.parametrize(("lane", "relayed"), [
    ({"ttft_deadline_s": 5.0, "keepalive_s": 1.0}, True),  # both act before the first token only: the relay arms after
    ({"itl_deadline_s": 5.0, "ttft_deadline_s": 5.0}, True),  # the watch is told of each relayed token
    ({"pace_itl_s": 0.05}, False),
    ({"flush_every": 3}, False),
])
def test_which_lanes_take_the_relay(tmp_path, spaced_stream, lane, relayed):
    size = spaced_stream.index(b"\n\n") + 2
    lanes = {"standard": {"priority": 1, **lane}}
    with scripted_upstream(spaced_stream, size, pause_s=0.02) as up, gateway(tmp_path, [up], lanes=lanes) as gw:
        r, chunks = _answer(gw.url)
        rec = record(gw, r)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(TEXTS) and rec["output_tokens"] == 8
    assert bool(rec["gateway"].get("direct_tokens")) is relayed


def _stalls_then_falls_back(tmp_path, stream: bytes, lanes: dict, healthy_pause_s: float,
                            bodies: list[dict] | None = None) -> tuple[httpx.Response, dict]:
    """One streamed answer from a replica that stalls after its fifth write (the role chunk and four tokens, 20 ms
    apart), continued on a healthy one writing every ``healthy_pause_s``; the answer and its record."""
    size = stream.index(b"\n\n") + 2
    with scripted_upstream(stream, size, pause_s=0.02, stall_after=5, stall_s=3.0) as stalls, \
            scripted_upstream(stream, size, pause_s=healthy_pause_s, bodies=bodies) as healthy, \
            gateway(tmp_path, [stalls, healthy], lanes=lanes, routing={"policy": "prefix"}) as gw:
        pool = gw.state.engine.pool
        name = next(rep.name for rep in pool.replicas if rep.url.rstrip("/") == stalls)
        user = next(f"u{i}" for i in range(500) if pool.pick(pool.affinity_key(f"u{i}", "")).name == name)
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
            "user": user})
        assert r.status_code == 200, r.text
        return r, record(gw, r)


def test_the_stall_watch_counts_relayed_tokens_and_a_fallback_continues_from_their_text(tmp_path, spaced_stream):
    """Tokens 20 ms apart under a 50 ms inter-token deadline: never a stall, though none passes the watch itself.
    Then a replica that stalls after four tokens (relayed directly): the continuation sent to the other replica
    carries their text."""
    size = spaced_stream.index(b"\n\n") + 2
    lanes = {"standard": {"priority": 1, "itl_deadline_s": 0.05, "ttft_deadline_s": 5.0}}
    with scripted_upstream(spaced_stream, size, pause_s=0.02) as up, gateway(tmp_path, [up], lanes=lanes) as gw:
        r, chunks = _answer(gw.url)
        rec = record(gw, r)
    assert not rec["degraded"] and rec["gateway"].get("direct_tokens") == len(TEXTS) - 2
    assert "itl_misses" not in rec["gateway"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "".join(TEXTS)

    bodies: list[dict] = []
    _, rec = _stalls_then_falls_back(tmp_path, spaced_stream, lanes, healthy_pause_s=0.02, bodies=bodies)
    assert rec["slo_action"]["mode"] == "fallback" and rec["gateway"]["fallback"]["after_tokens"] == 4
    cont = bodies[-1]
    assert cont["messages"][-1] == {"role": "assistant", "content": "".join(TEXTS[:4])}
    assert cont["continue_final_message"] is True and cont["max_tokens"] == 4


def test_a_continuation_is_watched_from_its_own_first_token_and_its_relayed_tokens_are_counted(tmp_path,
                                                                                                spaced_stream):
    """A fallback's continuation starts while the client's relay is armed. Its first token must still reach the stall
    watch (whose first-token phase is told of no relayed token): else a continuation longer than the TTFT deadlines
    was declared stalled too. And the record's direct_tokens counts the relayed tokens of both attempts."""
    lanes = {"standard": {"priority": 1, "itl_deadline_s": 0.2, "ttft_deadline_s": 0.1}}
    # The continuation's 8 tokens take ~0.5 s, past three 0.1 s first-token deadlines.
    r, rec = _stalls_then_falls_back(tmp_path, spaced_stream, lanes, healthy_pause_s=0.06)
    data = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in data if c["choices"])
    assert rec["gateway"]["fallback"]["outcome"] == "ok", rec["gateway"]
    assert text == "".join(TEXTS[:4]) + "".join(TEXTS)  # this scripted replica ignores the continuation's limit
    # The continuation alone could relay 6 (not its first token, not the last with the finish reason).
    assert rec["gateway"]["direct_tokens"] > 6


def test_a_relay_that_fails_leaves_the_token_to_the_reader():
    class Broken(ScriptedRelay):
        def token(self, text: str, produced: float) -> bool:
            raise RuntimeError("boom")

    relay = Broken()
    feed = UpstreamFeed(chat=True, relay=relay)
    feed(sse(_upstream_chunk({"content": "first"})))  # the attempt's first token: the reader's
    assert len(feed.take()) == 1
    assert feed(sse(_upstream_chunk({"content": "a"})) + sse(_upstream_chunk({"content": "b"})))
    assert not relay.armed and feed.relayed == 0 and len(feed.take()) == 2


def test_client_relay_writes_the_first_token_with_the_role_chunk_at_once():
    log: list = []
    relay, tl = _relay(log, RelayFlusher())
    assert not relay.first_token("x")  # not opened by the stream: nothing written
    relay.opening = lambda text: b"ROLE|" + text.encode()
    relay._cycle.flow.write_paused = True
    assert not relay.first_token("x") and log == []  # the client is behind: the stream's send waits, not this
    relay._cycle.flow.write_paused = False
    assert relay.first_token("tok")
    assert log == [b"8\r\nROLE|tok\r\n"] and relay.first_sent is not None and relay.opening is None
    assert not relay.first_token("again") and len(log) == 1  # once
    assert tl.token_times == [] and tl.token_sent == []  # the stream puts the token on the timeline


def test_a_failed_write_costs_only_its_own_stream():
    async def main() -> None:
        log, flusher, (bad, bad_tl), (good, good_tl) = _two_relays()

        def fail(data: bytes) -> None:
            raise OSError("broken pipe")

        bad._cycle.transport.write = fail
        assert bad.token("x", 1.0) and good.token("y", 1.0)
        flusher.flush()
        assert log == [b"1\r\ny\r\n"] and len(good_tl.token_sent) == 1 and bad_tl.token_sent == []

    asyncio.run(main())


# --- the stream starts when the replica accepts ---------------------------------------------------------------------
def _lines_with_times(url: str) -> tuple[httpx.Response, float, list[tuple[float, str]]]:
    """The response, when its head arrived, and each data line with its arrival time."""
    import time

    out = []
    with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}) as r:
        head = time.perf_counter()
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append((time.perf_counter(), line[6:]))
        return r, head, out


def test_the_status_leaves_at_the_replicas_head_and_the_queue_slot_is_kept_until_the_first_token(tmp_path,
                                                                                                 spaced_stream):
    size = spaced_stream.index(b"\n\n") + 2
    # The replica writes its role chunk (its head goes with it), then takes 1.5 s to its first token.
    with scripted_upstream(spaced_stream, size, pause_s=0.01, stall_after=1, stall_s=1.5) as up, \
            gateway(tmp_path, [up]) as gw:
        with read_during(0.75, lambda: gw.state.admission.depth) as depth_during:
            resp, head, lines = _lines_with_times(gw.url)
        assert resp.status_code == 200 and lines[-1][1] == "[DONE]"
        # The status and headers came while the replica was still silent, long before the first token ...
        assert lines[0][0] - head > 0.75
        # ... but the role chunk waited for the first token, and left with it: a client timing its first SSE event
        # still times the first token.
        chunks = [json.loads(x) for _, x in lines[:-1]]
        roles = [i for i, c in enumerate(chunks) if c["choices"] and "role" in c["choices"][0]["delta"]]
        assert roles == [0] and chunks[1]["choices"][0]["delta"]["content"] == TEXTS[0]
        assert lines[1][0] - lines[0][0] < 0.5
        # The request held its queue slot all along: it waits for the engine until its first token.
        assert depth_during == [1] and gw.state.admission.depth == 0
        rec = record(gw, resp)
        assert rec["status"] == 200 and rec["output_tokens"] == 8 and rec["ttft"] > 1.0


def test_a_replica_that_dies_after_its_head_is_retried_and_else_ends_the_stream_with_an_error_event(
        tmp_path, spaced_stream):
    size = spaced_stream.index(b"\n\n") + 2
    # Alone: the status (200) is out once the head came; the failure is an error event, then [DONE].
    with scripted_upstream(spaced_stream, size, die_after=1) as dying, gateway(tmp_path, [dying]) as gw:
        resp, _, lines = _lines_with_times(gw.url)
        assert resp.status_code == 200 and lines[-1][1] == "[DONE]"
        err = json.loads(lines[-2][1])["error"]
        assert err["code"] in ("upstream_unreachable", "upstream_error")
        assert gw.state.admission.depth == 0 and record(gw, resp)["status"] == 502
    # With a live replica beside it: retried there, the client sees one whole answer with one role chunk.
    with scripted_upstream(spaced_stream, size, die_after=1) as dying, \
            scripted_upstream(spaced_stream, size, pause_s=0.002) as live, \
            gateway(tmp_path, [dying, live], routing={"health_interval_s": 60, "breaker_failures": 100}) as gw:
        attempts = []
        for _ in range(40):  # power-of-two choices between two idle replicas is a coin toss
            resp, _, lines = _lines_with_times(gw.url)
            chunks = [json.loads(x) for _, x in lines[:-1]]
            assert resp.status_code == 200 and lines[-1][1] == "[DONE]", lines
            assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
                "".join(TEXTS)
            rec = record(gw, resp)
            attempts.append(rec["gateway"]["attempts"])
            if 2 in attempts:
                break
        assert 2 in attempts
