"""The upstream backend: a request forwarded to a replica of an OpenAI-compatible engine, its stream read back as
token events, with a retry on another replica when one fails before the first token.

The client's JSON body is forwarded as it came (the gateway does not tokenize: the upstream owns its tokenizer), with
``stream`` forced on so that every token's arrival is timed, ``stream_options.include_usage`` so that the token
counts are the upstream's own, and the model name, ``max_tokens`` and (where the replica accepts it) ``priority`` set
by the gateway. Each content chunk is one event; the final event carries the usage the upstream reported.

The stream is read as bytes, whatever has arrived at each read (``backends/upstream/sse.py`` splits it into events and takes a
plain token chunk's text without a JSON parse); the tokens of one read go up together, stamped with the read's time.
The server re-encodes each token under the gateway's own id and the model name the client asked for (the upstream's
chunks carry its own), and writes the role chunk and the last chunks (usage, the ``tailguard`` object, a degraded
answer's marks) itself, so the upstream's bytes are never forwarded as they are: their parse is what was cut.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from tailguard import fast_json
from tailguard.backends.base import Submission, Submitted
from tailguard.backends.upstream.events import Opening, UpstreamError, UpstreamEvent
from tailguard.backends.upstream.fallback import UpstreamRequest, stall_fallback
from tailguard.backends.upstream.http1 import ConnectFailed, Sent
from tailguard.backends.upstream.pool import NoReplica, Replica, UpstreamPool
from tailguard.backends.upstream.quarantine import fingerprint
from tailguard.backends.upstream.relay import Relay, UpstreamFeed
from tailguard.backends.upstream.sse import DONE, read_chunk
from tailguard.engine.events import EngineStats, TokenEvent
from tailguard.engine.sequence import SamplingParams

log = logging.getLogger("tailguard.gateway")
perf_counter = time.perf_counter
UNKNOWN_TOKEN = -1  # an upstream chunk's token id is not known to the gateway


def _upstream_error(raw: bytes) -> dict[str, Any]:
    """An error body's message, type, param and code as the upstream wrote them: OpenAI's ``{"error": {...}}`` (also
    llama.cpp's), the flat ``{"object": "error", "message": ...}`` of vLLM and SGLang; a body that is not JSON is the
    message."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return {"message": raw[:1000].decode("utf-8", "replace").strip()}
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if not isinstance(err, dict):
        return {"message": str(err)[:1000]}
    out: dict[str, Any] = {"message": str(err.get("message") or err.get("detail") or err)[:1000]}
    for k in ("type", "param", "code"):
        v = err.get(k)
        if v is None or isinstance(v, (str, int)):
            out[k] = v
    return out


def _client_status(code: Any) -> int | None:
    """The 4xx an error event's ``code`` names (vLLM writes the status there), else None."""
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    return code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500 else None


@dataclass(slots=True)
class Forwarded:
    """The head of a forwarded answer: its status and content type, and the replica that sent it."""

    status: int
    content_type: str
    replica: str


class UpstreamBackend:
    """A ``Backend`` over a pool of upstream replicas. It takes the request as text, not token ids."""

    tokenizer = None  # the replicas tokenize

    def __init__(self, pool: UpstreamPool, model_name: str | None = None, max_model_len: int = 0) -> None:
        self.pool = pool
        self._name = model_name
        self.max_model_len = max_model_len

        self.error: BaseException | None = None  # never fatal: replicas come back
        # Called once per attempt with (replica, outcome, seconds from sending to the first token or None): the
        # server's gateway metrics (outcome: ok, error, refused, aborted).
        self.on_attempt: Callable[[str, str, float | None], None] | None = None

    def capacity(self) -> int:
        return self.pool.capacity

    def preempts(self) -> bool:
        """Only where every replica starts a higher-priority arrival by preempting (``preempts``: another tailguard).
        llama.cpp's server has no priorities; vLLM's priority scheduling orders its waiting queue and preempts only
        when its KV cache runs out, so a VIP request sent there waits for a batch stream to end (measured:
        benchmarks/lanes.py --engine vllm)."""
        reps = self.pool.replicas
        return bool(reps) and all(r.cfg.preempts for r in reps)

    def speculates(self) -> bool:
        return False  # whatever the replicas do, the gateway cannot rerun their output to audit it

    def predict_ttft(self, num_prompt_tokens: int, priority: int) -> float | None:
        return None  # a replica's queue and step times are its own (its /metrics says how many wait, not for how long)

    def submit(self, request: Submission) -> Submitted:
        """Send the request to a replica now (``open``), and return the stream that reads its answer; under a stall
        watch with a fallback, a stalled stream goes on at another replica (``fallback.py``)."""
        body = request.body
        if request.max_tokens_cap is not None:  # the policy's cap replaces the client's limit, under either name
            body = dict(body)
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = request.max_tokens_cap
        affinity = self.pool.affinity_key(request.session, request.prompt_text or "")
        opening = self.open(body, request.chat, request.request_id, priority=request.priority,
                            affinity_key=affinity, headers=request.headers)
        max_tokens = request.sampling.max_tokens
        up = UpstreamRequest(body, request.chat, request.request_id, max_tokens, priority=request.priority,
                             est_tokens=request.num_prompt_tokens + max_tokens, affinity_key=affinity,
                             headers=request.headers, relay=request.relay, opening=opening)
        events: AsyncGenerator[TokenEvent, None]
        if request.watch is not None and request.fallback is not None:
            events = stall_fallback(self, up, request.watch, request.fallback, wanted=request.wanted)
        else:
            events = up.send(self)
            if request.watch is not None:
                events = request.watch(events)
        return Submitted(events, opening.abandon) if opening is not None else Submitted(events)

    async def forward(self, path: str, body: dict[str, Any], headers: dict[str, str],
                      session: str | None = None) -> AsyncGenerator[Forwarded | bytes, None]:
        """A request the gateway passes on without reading its answer (``/v1/responses``, ``/v1/embeddings``): sent
        to the replica the routing picks; yields the answer's head (``Forwarded``), then its body as it arrives.
        One attempt: such answers are not replayed elsewhere once begun."""
        try:
            r = self.pool.pick(self.pool.affinity_key(session, ""), set())
        except NoReplica as exc:
            raise UpstreamError(503, str(exc), code="no_upstream", retry_after=1) from None
        out = dict(body)
        if r.model:
            out["model"] = r.model
        hdrs = {"Content-Type": "application/json", **r.headers(), **headers}
        r.in_flight += 1
        r.requests += 1
        r.breaker.begin()
        sent = perf_counter()
        first: float | None = None
        outcome = "aborted"
        try:
            async with r.conns.request("POST", path, fast_json.dumps(out), hdrs) as resp:
                first = perf_counter()
                yield Forwarded(resp.status, resp.headers.get("content-type") or "application/json", r.name)
                while data := await resp.read():
                    yield data
            if resp.status >= 500:
                outcome = "error"
                r.errors += 1
                r.last_error = f"answered {resp.status} on {path}"
                r.breaker.failure()
            else:
                outcome = "ok" if resp.status < 400 else "refused"
                r.breaker.success()
        except ConnectFailed as exc:
            outcome = "error"
            raise UpstreamError(502, f"upstream {r.name} connection failed: {exc}"[:400],
                                code="upstream_unreachable") from None
        except (OSError, ValueError) as exc:
            outcome = "error"
            r.breaker.failure()
            raise UpstreamError(502, f"upstream {r.name} failed: {type(exc).__name__}: {exc}"[:400],
                                code="upstream_unreachable", before_first_token=first is None) from None
        finally:
            r.breaker.trial = False
            r.in_flight -= 1
            if self.on_attempt is not None:
                self.on_attempt(r.name, outcome, None if first is None else first - sent)

    def unavailable(self) -> str | None:
        """Why ``/ready`` says no: no replica is available (the gateway itself stays live for ``/health``)."""
        if any(r.available for r in self.pool.replicas):
            return None
        return ("no upstream replica is available: " + "; ".join(
            f"{r.name}: {r.last_error or 'breaker ' + r.breaker.state}" for r in self.pool.replicas))

    @property
    def model_name(self) -> str:
        if self._name:
            return self._name
        for r in self.pool.replicas:
            if r.model:
                return r.model
        return "upstream"

    async def start(self) -> None:
        await self.pool.start()

    async def aclose(self) -> None:
        await self.pool.close()

    def shutdown(self) -> None:  # the pool is closed by ``aclose`` on the event loop
        pass

    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        pass  # the upstream validates against its own model

    def abort(self, request_id: str) -> None:
        pass  # closing the event stream closes the upstream connection, which aborts the request there

    def stalled(self, name: str | None) -> None:
        """A stream at replica ``name`` stalled (the stall watch gave up on it): a failure for its breaker, so that a
        replica that stalls every stream leaves the routing for the cooldown, as one that fails does. Not while it is
        the only one available: a stall may be overload, and a slow answer (or the template) beats a 503 for all."""
        r = next((x for x in self.pool.replicas if x.name == name), None)
        if r is None or not any(x.available for x in self.pool.replicas if x is not r):
            return
        r.errors += 1
        r.last_error = "a stream stalled (consecutive deadlines missed)"
        r.breaker.failure()

    def stats(self) -> EngineStats:
        reps = self.pool.replicas
        return EngineStats(running=sum(r.in_flight for r in reps), waiting=int(sum(r.upstream_waiting for r in reps)),
                           kv_blocks_total=0, kv_blocks_used=0, num_preemptions=0, steps=0)

    def open(self, body: dict[str, Any], chat: bool, request_id: str, *, priority: int = 0,
             affinity_key: str | None = None, headers: dict[str, str] | None = None) -> Opening | None:
        """Write the request's first attempt now, on an idle connection of the replica the routing picks, so that it
        leaves before the server builds the stream that will read its answer (that building, ~40 us of the request's
        turn on the event loop, and more under load, then overlaps the replica's work instead of preceding it); the
        ``Opening`` goes to ``generate_request``. None, and nothing written, when it cannot be as simple: a traced
        request (the call's span must exist first: its context travels in the request), no replica, no idle connection;
        ``generate_request`` then sends it as it always did."""
        tracing = sys.modules.get("tailguard.observe.tracing")  # loaded only when some server traces
        if tracing is not None and tracing.current_trace() is not None:
            return None
        q = self.pool.quarantine
        if q.refusing and q.left(fingerprint(body)) is not None:
            return None  # refused by ``generate_request``: it must not leave first
        try:
            r = self.pool.pick(affinity_key, set())
        except NoReplica:
            return None
        out, hdrs = self._outgoing(r, body, request_id, priority, headers)
        sent = r.conns.send_now("POST", _path(chat), fast_json.dumps(out), hdrs)
        return None if sent is None else Opening(r, out, hdrs, sent)

    @staticmethod
    def _outgoing(r: Replica, body: dict[str, Any], request_id: str, priority: int,
                  headers: dict[str, str] | None) -> tuple[dict[str, Any], dict[str, str]]:
        """The request's body and headers as replica ``r`` gets them."""
        out = dict(body)
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
        if r.model:
            out["model"] = r.model
        out.pop("priority", None)  # a client's own claim never travels on: the lane's, where the replica takes it
        if r.cfg.send_priority:
            out["priority"] = priority
        hdrs = {"Content-Type": "application/json", **r.headers(), **(headers or {})}
        upstream_id = _upstream_request_id(r.cfg.request_id, request_id)
        if upstream_id is not None:
            hdrs["X-Request-ID"] = upstream_id
        return out, hdrs

    async def generate_request(self, body: dict[str, Any], chat: bool, request_id: str, *, priority: int = 0,
                               est_tokens: int = 0, affinity_key: str | None = None,
                               headers: dict[str, str] | None = None, tried: list[str] | None = None,
                               exclude: set[str] | None = None, relay: Relay | None = None,
                               opening: Opening | None = None,
                               origin: dict[str, Any] | None = None) -> AsyncGenerator[UpstreamEvent, None]:
        """Stream the request's tokens from a replica; retry elsewhere while no token has come back.

        ``tried``: the caller's list, to which each replica is appended as it is sent the request (the last one is
        the replica streaming); ``exclude``: replicas not to use (the stall fallback's stalled one); ``relay``: the
        client's direct relay (``backends/upstream/relay.py``), which plain tokens may take instead of this stream;
        ``opening``: the first attempt, written already (``open``); ``origin``: the client's request when ``body`` is
        a continuation of it (its fingerprint is the request's, ``backends/upstream/quarantine.py``).

        A failure before the first token is retried on another replica up to ``routing.retries`` times, but a failure
        that implicates the request (the replica failed while holding it) only ``routing.failure_retries`` times, and
        never once the request is quarantined."""
        pool = self.pool
        path = _path(chat)
        tried = [] if tried is None else tried
        avoid = set(exclude or ())
        last: UpstreamError | None = None
        quarantine = pool.quarantine
        fp: str | None = None  # the request's fingerprint, computed only when the quarantine needs it
        if quarantine.holding:
            fp = fingerprint(origin if origin is not None else body)
            left = quarantine.refused(fp)
            if left is not None:
                if opening is not None:
                    opening.abandon()
                raise self._quarantined(left)
        implicated = 0
        for attempt in range(1, pool.routing.retries + 2):
            sent: Sent | None = None
            if opening is not None:
                r, out, hdrs, sent = opening.replica, opening.body, opening.headers, opening.sent
                opening = None
            else:
                try:
                    r = pool.pick(affinity_key, avoid)
                except NoReplica as exc:
                    if last is not None:
                        raise last from None
                    raise UpstreamError(503, str(exc), code="no_upstream", retry_after=5) from None
                out, hdrs = self._outgoing(r, body, request_id, priority, headers)
            tried.append(r.name)
            avoid.add(r.name)
            produced = False
            try:
                # Closed at once when the caller leaves: that closes the upstream connection (the abort there).
                async with aclosing(self._attempt(r, path, out, hdrs, request_id, est_tokens, chat, attempt,
                                                         relay, sent)) as reads:
                    async for events in reads:
                        produced = produced or events[0].token_id is not None
                        if events[-1].finished and quarantine.holding:  # before the last yield: it may be the end
                            quarantine.succeeded(fp or fingerprint(origin if origin is not None else body))
                        for ev in events:
                            yield ev
                return
            except UpstreamError as exc:
                held = False
                if exc.implicates:
                    implicated += 1
                    fp = fp or fingerprint(origin if origin is not None else body)
                    held = quarantine.failed(fp, r.name)
                    if held:
                        exc.message += (f"; replicas failed under this request {quarantine.after} times: it is "
                                        f"refused for {pool.routing.quarantine_s:g} s")
                if produced or not exc.before_first_token or exc.status < 500 and exc.status != 429:
                    exc.before_first_token = not produced
                    raise
                last = exc
                stop = held or (exc.implicates and implicated > pool.routing.failure_retries)
                log.warning("upstream %s failed before the first token (%s); %s", r.name, exc.message,
                            "the request is quarantined" if held else
                            "not retried: a replica failed under it already" if stop else
                            "retrying on another replica" if attempt <= pool.routing.retries else "giving up")
                if stop:
                    raise
        assert last is not None
        raise last

    def _quarantined(self, left: float) -> UpstreamError:
        q = self.pool.quarantine
        wait = max(1, math.ceil(left))
        return UpstreamError(422, f"this request was refused: replicas failed under it {q.after} times, so the "
                                  f"gateway will not send it again for {wait} s", code="request_quarantined",
                             retry_after=wait)

    async def _attempt(self, r: Replica, path: str, body: dict[str, Any], headers: dict[str, str],
                       request_id: str, est_tokens: int, chat: bool, attempt: int, relay: Relay | None = None,
                       written: Sent | None = None) -> AsyncGenerator[list[UpstreamEvent], None]:
        """One try at one replica: the token events of each read together (one resumption per read, not per token),
        then the final event alone."""
        r.in_flight += 1
        r.requests += 1
        r.outstanding_tokens += est_tokens
        r.breaker.begin()
        span = contextlib.ExitStack()
        call = span.enter_context(_upstream_call({"url.full": r.shown_url + path, "server.address": r.name}))
        if call is not None:
            headers = {**headers, **call.headers}  # our span is the upstream's parent
        sent = perf_counter() if written is None else written.at
        first: float | None = None
        n_out = 0
        usage: dict | None = None
        reasoning = 0  # chunks with reasoning text
        finish: str | None = None
        ok = False
        outcome = "aborted"  # the client went away mid-stream (the generator was closed)
        feed: UpstreamFeed | None = None
        try:
            try:
                payload = b"" if written is not None else fast_json.dumps(body)
                async with r.conns.request("POST", path, payload, headers, sent=written) as resp:
                    if call is not None:
                        call.attributes["http.response.status_code"] = resp.status
                    if resp.status != 200:
                        raw = await resp.read_all()
                        # The upstream's own 4xx goes to the client as it wrote it; anything else (5xx, a redirect,
                        # which is not followed: the url should name the final address) is the replica's failure,
                        # one that implicates the request unless the replica refused it unseen (503: not ready,
                        # overloaded; a 429 is a 4xx).
                        err = _upstream_error(raw)
                        message = f"upstream {r.name} answered {resp.status}: {err['message']}"
                        retry_after = _retry_after(resp.headers.get("retry-after"))
                        if 400 <= resp.status < 500:
                            raise UpstreamError(resp.status, message, code=err.get("code"), retry_after=retry_after,
                                                client_message=err["message"], type=err.get("type"),
                                                param=err.get("param"))
                        raise UpstreamError(502, message, code="upstream_error", retry_after=retry_after,
                                            implicates=resp.status != 503)
                    # The body goes to the feed as it arrives: plain tokens straight to the client when the relay
                    # is armed, everything else queued here, in order.
                    feed = UpstreamFeed(chat, relay, resp, r, charge=est_tokens)
                    resp.set_tap(feed)
                    yield [UpstreamEvent(request_id, None, "", perf_counter(), accepted=True)]
                    token_text = feed.token_text
                    while True:
                        # Whatever arrived since the last wake-up, at once: one resumption for the tokens it holds.
                        batch = feed.take()
                        if not batch:
                            if feed.failed is not None:
                                raise UpstreamError(502, f"upstream {r.name}: {feed.failed}", code="upstream_error",
                                                    before_first_token=first is None, implicates=True)
                            if resp.exc is not None:
                                raise resp.exc
                            if not resp.complete:
                                await resp.wait()
                                continue
                            batch = feed.end()  # a last line without its line end still counts
                            if not batch:
                                break
                        tokens: list[UpstreamEvent] = []
                        failed: UpstreamError | None = None  # raised after the tokens read before it are passed on
                        for payload, now in batch:
                            text = token_text(payload)
                            if text is None:
                                if payload == DONE:
                                    ok = True
                                    break
                                try:
                                    chunk = read_chunk(payload, chat)
                                except ValueError:
                                    failed = UpstreamError(502, f"upstream {r.name} sent unparsable SSE data",
                                                           implicates=True)
                                    break
                                if chunk.error is not None:
                                    failed = _event_error(r.name, chunk.error, chunk.error_body, first is None)
                                    break
                                usage = chunk.usage or usage
                                finish = chunk.finish_reason or finish
                                text = chunk.text
                                if chunk.passthrough is not None:  # a tool call, reasoning, logprobs: as written
                                    if first is None:
                                        first = now
                                        r.ttft_ewma = (now - sent) if r.ttft_ewma is None else \
                                            0.8 * r.ttft_ewma + 0.2 * (now - sent)
                                    reasoning += chunk.reasoning
                                    tokens.append(UpstreamEvent(request_id, UNKNOWN_TOKEN, text or "", now,
                                                                passthrough=chunk.passthrough))
                                    continue
                            if not text:  # a chunk without a token (the role chunk, a last chunk's usage)
                                continue
                            if first is None:
                                first = now
                                r.ttft_ewma = (now - sent) if r.ttft_ewma is None else \
                                    0.8 * r.ttft_ewma + 0.2 * (now - sent)
                            tokens.append(UpstreamEvent(request_id, UNKNOWN_TOKEN, text, now))
                        if tokens:
                            n_out += len(tokens)
                            feed.release(len(tokens))
                            yield tokens
                        if failed is not None:
                            raise failed
                        if ok:
                            break
                    resp.set_tap(None)  # what is left of the body (its end) is read the plain way
            except ConnectFailed as exc:  # nothing was sent: the request had no part in it
                raise UpstreamError(502, f"upstream {r.name} connection failed: {exc}"[:400],
                                    code="upstream_unreachable", before_first_token=first is None) from None
            except (OSError, ValueError) as exc:  # cut after the request went out: it may be what broke the replica
                raise UpstreamError(502, f"upstream {r.name} connection failed: {type(exc).__name__}: {exc}"[:400],
                                    code="upstream_unreachable", before_first_token=first is None,
                                    implicates=True) from None
            if not ok:
                raise UpstreamError(502, f"upstream {r.name} ended the stream without [DONE]",
                                    code="upstream_error", before_first_token=first is None, implicates=True)
            # The stream is complete: settled before the last event goes up, as its consumer may close this
            # generator at that yield (the lines after it would never run).
            outcome = "ok"
            r.breaker.success()
            now = perf_counter()
            yield [UpstreamEvent(
                request_id, None, "", now, finished=True, finish_reason=finish or "stop",  # type: ignore[arg-type]
                num_prompt_tokens=int((usage or {}).get("prompt_tokens") or 0),
                num_output_tokens=int((usage or {}).get("completion_tokens") or n_out + feed.relayed),
                first_token=first, replica=r.name, attempts=attempt, sent=sent, usage=usage,
                reasoning_chunks=reasoning,
            )]
        except UpstreamError as exc:
            outcome = "error" if exc.status >= 500 else "refused"
            if exc.status >= 500:
                r.errors += 1
                r.last_error = exc.message
                r.breaker.failure()
            else:
                r.breaker.success()  # the replica works; the request was refused
            raise
        finally:
            span.__exit__(*sys.exc_info())
            r.breaker.trial = False  # a trial the client abandoned decides nothing
            r.in_flight -= 1
            # what this attempt added and its tokens have not counted down (never more: a replica that answers
            # past max_tokens must not come out with less than nothing outstanding, and so draw all the traffic)
            r.outstanding_tokens -= feed.left if feed is not None else est_tokens
            if self.on_attempt is not None:
                self.on_attempt(r.name, outcome, None if first is None else first - sent)


def _event_error(name: str, message: str, body: dict[str, Any] | None, before_first_token: bool) -> UpstreamError:
    """An error event in an upstream's stream. One that names a 4xx (vLLM's, for a request it refuses once its stream
    has begun) is the client's, passed on as the upstream wrote it; any other is the replica's failure."""
    body = body or {}
    status = _client_status(body.get("code"))
    if status is not None:
        return UpstreamError(status, f"upstream {name} refused the request mid-stream: {message}",
                             code=body.get("code"), before_first_token=before_first_token, client_message=message,
                             type=body.get("type") if isinstance(body.get("type"), str) else None,
                             param=body.get("param"))
    return UpstreamError(502, f"upstream {name} failed mid-stream: {message}", code="upstream_error",
                         before_first_token=before_first_token, implicates=True)


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _upstream_request_id(mode: str, request_id: str) -> str | None:
    """The id the upstream sees: by default a UUID derived from ours (stable: the upstream's logs can be joined)."""
    if mode == "off":
        return None
    if mode == "same":
        return request_id
    # uuid.uuid5's value, built without the UUID object (a quarter of its cost, once per request)
    h = bytearray(hashlib.sha1(_NAMESPACE + request_id.encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50  # version 5
    h[8] = (h[8] & 0x3F) | 0x80  # RFC 4122 variant
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


_NAMESPACE = uuid.NAMESPACE_URL.bytes + b"tailguard:"


def _upstream_call(attributes: dict[str, Any]) -> Any:
    """A CLIENT span for one upstream call when tracing runs (its module is loaded only then), else nothing."""
    tracing = sys.modules.get("tailguard.observe.tracing")
    return tracing.upstream_call(attributes) if tracing is not None else contextlib.nullcontext(None)


def _retry_after(value: str | None) -> int | None:
    if value and value.strip().isdigit():
        return int(value.strip())
    return None
