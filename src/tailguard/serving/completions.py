"""``POST /v1/chat/completions`` and ``POST /v1/completions`` as raw ASGI endpoints.

Raw ASGI (not a framework response class) for three reasons: the hot per-token path stays a single ``send``; the
request's body is read by us, so a task can then watch ``receive`` for the client going away, during the queue wait
and prefill as well as mid-stream; and every exit, success or failure, funnels through one ``finally`` that closes
the timeline exactly once.

The path of a request: fingerprint (id, user, business type) -> read and validate -> tokenize -> context check ->
admission (bounded queue) -> engine -> SSE chunks or one JSON body -> record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from tailguard.engine.request import RequestError, SamplingParams
from tailguard.observe.metrics import clean_label
from tailguard.observe.timeline import Outcome, Timeline
from tailguard.serving.errors import APIError
from tailguard.serving.protocol import Parsed, decode_json, parse_chat, parse_completion
from tailguard.serving.responses import (
    DONE,
    ChatFormat,
    CompletionFormat,
    chat_logprobs,
    completion_logprobs,
    sse_error,
)
from tailguard.serving.state import ServerState

log = logging.getLogger("tailguard.server")
perf_counter = time.perf_counter

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@\-]{1,128}$")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def _degraded_headers(tl: Timeline) -> list[tuple[bytes, bytes]]:
    """``X-Tailguard-Degraded: template; tier=red; action=<id>`` on an answer the SLO monitor degraded."""
    a = tl.slo_action
    if a is None or a.get("action") != "degrade":
        return []
    return [(b"x-tailguard-degraded", f"{a['mode']}; tier={a['tier']}; action={a['action_id']}".encode())]


class ClientGone(Exception):
    """The client closed the connection."""


def new_request_id() -> str:
    return secrets.token_hex(12)


def _headers(scope: dict) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in scope.get("headers", ()):
        out[k.decode("latin-1").lower()] = v.decode("latin-1")
    return out


def _clean_str(value: str | None, limit: int = 256) -> str | None:
    if not value:
        return None
    # Lone surrogates (legal in JSON escapes) cannot be stored as UTF-8: replace them.
    return value[:limit].encode("utf-8", "replace").decode("utf-8")


@dataclass
class _Exchange:
    """One HTTP exchange: the ASGI callables, the timeline and whether the client is still there."""

    scope: dict
    receive: Any
    send: Any
    tl: Timeline
    started: bool = False  # response headers sent
    done: bool = False  # the last byte is about to be / has been sent
    gone: bool = False  # the client disconnected
    in_queue: bool = False
    watcher: asyncio.Task | None = None
    output: list[str] = field(default_factory=list)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [*headers, (b"x-request-id", self.tl.request_id.encode())]})

    async def send_error(self, err: APIError) -> None:
        if self.started or self.gone:
            return
        body = err.body()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        self.done = True
        await self.start(err.status, headers)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    def watch_disconnect(self) -> None:
        task = asyncio.current_task()

        async def watch() -> None:
            try:
                while True:
                    msg = await self.receive()
                    if msg["type"] == "http.disconnect":
                        # uvicorn also reports "disconnect" once the response is complete: only act before that.
                        if not self.done:
                            self.gone = True
                            if task is not None:
                                task.cancel()
                        return
            except Exception:  # noqa: BLE001 - a broken receive channel only means we stop watching
                return

        self.watcher = asyncio.get_running_loop().create_task(watch())

    def stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None


class CompletionEndpoint:
    def __init__(self, state: ServerState, chat: bool) -> None:
        self.state = state
        self.chat = chat
        self.endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        self._seq = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        received = perf_counter()
        st = self.state
        hdrs = _headers(scope)
        rid = hdrs.get("x-request-id", "")
        if not REQUEST_ID.match(rid):
            rid = new_request_id()
        tl = Timeline(request_id=rid, endpoint=self.endpoint, received=received, model=st.model_label)
        tl.business_type = st.metrics.business_type(hdrs.get("x-business-type")) if st.metrics else "default"
        tl.user = _clean_str(hdrs.get("x-user-id"))
        tl.lane = clean_label(hdrs.get("x-lane"))
        tl.client = clean_label(hdrs.get("x-client"))
        tl.region = clean_label(hdrs.get("x-region"))
        ex = _Exchange(scope, receive, send, tl)
        st.admission.in_flight += 1
        task = asyncio.current_task()
        try:
            await self._serve(ex, hdrs)
        except APIError as err:
            tl.error = _clean_str(err.message, 1000)
            if ex.started and not ex.done:
                # Mid-stream (the engine refused after tokens went out): the status is sent; end the stream.
                ex.done = True
                await self._send_quietly(ex, sse_error(err.message, err.type, err.code))
            else:
                await ex.send_error(err)
            tl.finalize(err.status, err.outcome)
        except ClientGone:
            tl.finalize(499, Outcome.ABORTED)
        except asyncio.CancelledError:
            if not ex.gone:
                tl.error = "cancelled by the server (shutdown)"
                tl.finalize(503, Outcome.ABORTED)
                raise
            # Our own watcher cancelled us because the client left: absorb it, this task goes on to record.
            if task is not None:
                task.uncancel()
            tl.error = tl.error or "client disconnected"
            tl.finalize(499, Outcome.ABORTED)
        except Exception:
            log.exception("request %s failed", rid)
            tl.error = "internal error"
            if ex.started and not ex.done:
                # Headers are out: tell the client in the stream; it cannot get a status code any more.
                ex.done = True
                await self._send_quietly(ex, sse_error(f"internal error; request id {rid}"))
            else:
                await ex.send_error(APIError(500, f"internal server error; request id {rid}"))
            tl.finalize(500, Outcome.ERROR)
        finally:
            ex.stop_watching()
            if ex.in_queue:
                st.admission.leave()
            try:
                st.close_record(tl)
            finally:
                # Last, so that "nothing in flight" means every record has reached the store's queue.
                st.admission.in_flight -= 1

    @staticmethod
    async def _send_quietly(ex: _Exchange, body: bytes) -> None:
        with contextlib.suppress(Exception):  # the connection may be gone already
            await ex.send({"type": "http.response.body", "body": body, "more_body": False})

    # --- the request --------------------------------------------------------------------------------------------------
    async def _read_body(self, ex: _Exchange, hdrs: dict[str, str]) -> bytes:
        limit = self.state.config.max_body_bytes
        declared = hdrs.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes")
        chunks, size = [], 0
        while True:
            msg = await ex.receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes")
            chunks.append(body)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def _tokenize(self, p: Parsed) -> tuple[list[int], str | None]:
        tok = self.state.engine.tokenizer

        def run() -> tuple[list[int], str | None]:
            if p.prompt_token_ids is not None:
                return p.prompt_token_ids, None
            text = tok.render_chat(p.messages) if p.messages is not None else p.prompt or ""
            return tok.encode(text), text

        size = sum(len(m["content"]) for m in p.messages) if p.messages is not None else len(p.prompt or "")
        try:
            if size > self.state.config.tokenize_in_thread_chars:
                return await asyncio.to_thread(run)  # a long prompt would stall every other stream
            return run()
        except APIError:
            raise
        except UnicodeEncodeError as exc:  # a lone surrogate: a legal JSON escape, but not Unicode text
            bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()[:40]
            raise APIError(400, f"the prompt is not valid Unicode text: it holds the lone surrogate {bad}",
                           param="messages" if self.chat else "prompt") from None
        except Exception as exc:  # noqa: BLE001 - whatever the template or tokenizer rejects is the input's fault
            raise APIError(400, f"the prompt could not be tokenized: {type(exc).__name__}: {str(exc)[:200]}",
                           param="messages" if self.chat else "prompt") from None

    async def _serve(self, ex: _Exchange, hdrs: dict[str, str]) -> None:
        st, tl = self.state, ex.tl
        if not st.authorized(hdrs.get("authorization")):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        engine = st.engine
        if engine is None or not st.ready:
            msg = f"the model failed to load: {st.load_error}" if st.load_error else "the model is still loading"
            raise APIError(503, msg, code="model_not_ready", headers={"Retry-After": "5"})
        body = await self._read_body(ex, hdrs)
        mon = st.slo
        # The SLO actions match the business type the client sent, not its metric label: the label set is capped
        # (an allowlist, or the first 32 types seen), and a type counted as "other" must still be shed or degraded.
        btype = clean_label(hdrs.get("x-business-type"))
        if mon is not None:
            shed = mon.shed_for(btype, tl.lane)
            if shed is not None:
                # Orange: non-core traffic is refused before it costs a parse, a tokenize or a queue slot.
                tl.slo_action = {k: shed[k] for k in ("action", "tier", "scope", "action_id")}
                wait = max(1, math.ceil(shed["retry_after_s"]))
                raise APIError(shed["status"], f"the service is shedding non-core traffic (SLO tier {shed['tier']}, "
                                               f"business type {btype!r}, lane {tl.lane!r}); retry in "
                                               f"{wait} s", code="slo_shed", headers={"Retry-After": str(wait)})
        data = decode_json(body)
        p = parse_chat(data) if self.chat else parse_completion(data, engine.tokenizer.vocab_size)
        tl.stream = p.stream
        if p.model not in st.model_names:
            raise APIError(404, f"The model `{_clean_str(p.model, 200)}` does not exist; this server has: "
                                f"{', '.join(st.model_names)}", param="model", code="model_not_found")
        tl.user = _clean_str(p.user) or tl.user
        ids, text = await self._tokenize(p)
        tl.tokenized = perf_counter()
        tl.num_prompt_tokens = len(ids)
        max_tokens = p.max_tokens
        if max_tokens is None:
            max_tokens = st.config.default_max_tokens or max(1, engine.max_model_len - len(ids))
        deg = mon.degradation_for(btype, tl.lane, tl.client, tl.region, len(ids)) if mon else None
        if deg is not None:
            tl.slo_action = {"action": "degrade", "mode": deg.mode, "tier": deg.tier, "scope": deg.scope,
                             "action_id": deg.action_id, "reason": deg.reason}
            if deg.mode == "truncate":
                max_tokens = min(max_tokens, deg.max_tokens)
        p.max_tokens = max_tokens
        tl.sampling = p.sampling_record()
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
            stop=p.stop, ignore_eos=p.ignore_eos, min_tokens=min(p.min_tokens, max_tokens), logprobs=p.logprobs,
        )
        try:
            engine.check_request(len(ids), sampling)
        except RequestError as exc:
            msg = str(exc)
            long = "context" in msg or "KV" in msg or "empty" in msg
            raise APIError(400, msg, param=("messages" if self.chat else "prompt") if long else None,
                           code="context_length_exceeded" if "context" in msg else "invalid_value") from None
        if deg is not None and deg.mode == "template":
            await self._template(ex, p, deg.template)
            return
        if not st.admission.try_enter():
            wait = st.admission.retry_after()
            raise APIError(429, f"the server's waiting queue is full ({st.admission.capacity} requests); retry in "
                                f"{wait} s", code="queue_full", headers={"Retry-After": str(wait)})
        ex.in_queue = True
        tl.resources = st.resources()
        if st.config.store_text:
            tl.prompt_text = text if text is not None else engine.tokenizer.decode(ids)
            tl.prompt_token_ids = ids
            if p.logprobs is not None:
                tl.logprobs = []
        engine_id = tl.request_id
        if engine_id in st.active_ids:  # a client reused its X-Request-ID while the first is still running
            self._seq += 1
            engine_id = f"{engine_id}#{self._seq}"
        st.active_ids.add(engine_id)
        ex.watch_disconnect()
        tl.queued = perf_counter()
        try:
            agen = engine.generate(ids, sampling, engine_id, arrival_time=tl.received)
            async with aclosing(agen):  # leaving early (error, disconnect) aborts the request in the engine
                if p.stream:
                    await self._stream(ex, p, agen)
                else:
                    await self._full(ex, p, agen)
        except RequestError as exc:
            raise APIError(400, str(exc)) from None
        finally:
            st.active_ids.discard(engine_id)

    # --- the engine's events --------------------------------------------------------------------------------------------
    def _first_event(self, ex: _Exchange) -> None:
        if ex.in_queue:
            ex.in_queue = False
            self.state.admission.leave()

    def _take(self, ex: _Exchange, ev: Any, first: bool, lp_items: list | None) -> bool:
        """Put one engine event on the timeline (and its logprobs in ``lp_items`` and the audit); True for a token."""
        tl = ex.tl
        if first:
            self._first_event(ex)
            if ev.token_id is not None:
                tl.first_token = ev.time
        if ev.token_id is None:
            return False
        tl.token_times.append(ev.time)
        if lp_items is not None:
            lp_items.append((ev.token_id, ev.logprob, ev.top_logprobs))
            if tl.logprobs is not None:
                tl.logprobs.append({"id": ev.token_id, "logprob": ev.logprob, "top": ev.top_logprobs})
        return True

    def _format(self, tl: Timeline, p: Parsed) -> ChatFormat | CompletionFormat:
        return (ChatFormat if self.chat else CompletionFormat)(tl.request_id, p.model, int(time.time()))

    @staticmethod
    def _final(tl: Timeline, ev: Any) -> str:
        tl.last_token = ev.time
        if ev.first_scheduled is not None:
            tl.scheduled = ev.first_scheduled
        if ev.first_token is not None:
            tl.first_token = ev.first_token
        tl.num_prompt_tokens = ev.num_prompt_tokens or tl.num_prompt_tokens
        tl.num_output_tokens = ev.num_output_tokens or len(tl.token_times)
        tl.num_preemptions = getattr(ev, "num_preemptions", 0)
        reason = ev.finish_reason.value if hasattr(ev.finish_reason, "value") else str(ev.finish_reason)
        if reason not in ("stop", "length"):
            raise RuntimeError(f"the engine ended the request with finish reason {reason!r}")
        tl.finish_reason = reason
        return reason

    def _usage(self, tl: Timeline) -> dict[str, int]:
        return {"prompt_tokens": tl.num_prompt_tokens, "completion_tokens": tl.num_output_tokens,
                "total_tokens": tl.num_prompt_tokens + tl.num_output_tokens}

    def _logprobs(self, items: list, offset: int = 0) -> dict | None:
        tt = self.state.token_text
        if self.chat:
            return chat_logprobs(tt, items)
        return completion_logprobs(tt, items, offset)

    async def _stream(self, ex: _Exchange, p: Parsed, agen: Any) -> None:
        tl, send = ex.tl, ex.send
        fmt = self._format(tl, p)
        want_lp = p.logprobs is not None
        keep_text = self.state.config.store_text
        pending = 0  # tokens produced but not yet sent (a token may carry no visible text yet)
        lp_items: list = []
        offset = 0
        first = True
        final = None
        async for ev in agen:
            if self._take(ex, ev, first, lp_items if want_lp else None):
                pending += 1
            first = False
            if ev.finished:
                final = ev
                break
            text = ev.text
            if not text:
                continue
            if keep_text:
                ex.output.append(text)
            if want_lp:
                chunk = fmt.content_logprobs(text, self._logprobs(lp_items, offset))
                offset += len(text)
                lp_items = []
            else:
                chunk = fmt.content(text)
            if not ex.started:
                await ex.start(200, _SSE_HEADERS + _degraded_headers(tl))
                chunk = fmt.role() + chunk
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            tl.add_tokens_sent(pending, perf_counter())
            pending = 0
        if final is None:
            raise RuntimeError("the engine's stream ended without a final event")
        reason = self._final(tl, final)
        if keep_text and final.text:
            ex.output.append(final.text)
        if keep_text:
            tl.output_text = "".join(ex.output)
        lp = self._logprobs(lp_items, offset) if want_lp and lp_items else None
        if p.include_usage:
            body = fmt.finish(final.text, reason, lp) + fmt.usage(self._usage(tl), tailguard=tl.stage_object())
        else:
            body = fmt.finish(final.text, reason, lp, tailguard=tl.stage_object())
        if not ex.started:
            await ex.start(200, _SSE_HEADERS + _degraded_headers(tl))
            body = fmt.role() + body
        ex.done = True
        await send({"type": "http.response.body", "body": body + DONE, "more_body": False})
        now = perf_counter()
        tl.add_tokens_sent(pending, now)
        tl.finalize(200, Outcome.SUCCESS, at=now)

    async def _full(self, ex: _Exchange, p: Parsed, agen: Any) -> None:
        tl = ex.tl
        fmt = self._format(tl, p)
        want_lp = p.logprobs is not None
        texts: list[str] = []
        lp_items: list = []
        first = True
        final = None
        async for ev in agen:
            self._take(ex, ev, first, lp_items if want_lp else None)
            first = False
            if ev.text:
                texts.append(ev.text)
            if ev.finished:
                final = ev
                break
        if final is None:
            raise RuntimeError("the engine's stream ended without a final event")
        reason = self._final(tl, final)
        text = "".join(texts)
        if self.state.config.store_text:
            tl.output_text = text
        lp = self._logprobs(lp_items) if want_lp else None
        obj = fmt.full(text, reason, self._usage(tl), lp, tailguard=tl.stage_object())
        body = json.dumps(obj, ensure_ascii=False).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"server-timing", tl.server_timing().encode()), *_degraded_headers(tl)]
        ex.done = True
        await ex.start(200, headers)
        await ex.send({"type": "http.response.body", "body": body, "more_body": False})
        tl.finalize(200, Outcome.SUCCESS)

    async def _template(self, ex: _Exchange, p: Parsed, text: str) -> None:
        """Red: answer with the degradation template, without the engine (and without a queue slot)."""
        tl = ex.tl
        now = perf_counter()
        tl.synthetic = True  # counted as a degraded answer, never as a latency sample
        tl.scheduled = tl.first_token = tl.last_token = now
        tl.num_output_tokens = len(self.state.engine.tokenizer.encode(text))
        tl.finish_reason = "stop"
        if self.state.config.store_text:
            tl.output_text = text
        fmt = self._format(tl, p)
        if p.stream:
            await ex.start(200, _SSE_HEADERS + _degraded_headers(tl))
            tail = fmt.finish("", "stop", None, tailguard=tl.stage_object()) if not p.include_usage else (
                fmt.finish("", "stop", None) + fmt.usage(self._usage(tl), tailguard=tl.stage_object()))
            ex.done = True
            await ex.send({"type": "http.response.body", "body": fmt.role() + fmt.content(text) + tail + DONE,
                           "more_body": False})
        else:
            obj = fmt.full(text, "stop", self._usage(tl), None, tailguard=tl.stage_object())
            body = json.dumps(obj, ensure_ascii=False).encode()
            ex.done = True
            await ex.start(200, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                 *_degraded_headers(tl)])
            await ex.send({"type": "http.response.body", "body": body, "more_body": False})
        tl.finalize(200, Outcome.SUCCESS)
