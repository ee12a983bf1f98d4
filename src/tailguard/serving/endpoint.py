"""``POST /v1/chat/completions`` and ``POST /v1/completions``: read, decide, submit, answer.

One request goes through these steps, each in its own module: the exchange (``exchange.py``: the HTTP side and its
phases), the prompt (``prompt.py``: body, parse, size, tokenize), the traffic policy's decision
(``policy/decision.py``: lane, shedding, degradation, priority, rate limits, lane admission), the backend
(``backends/``: one ``Submission`` in, token events out, the same call for the embedded engine and upstream
replicas), and the answer (``respond.py``: SSE or JSON, the timeline's timestamps).

While the backend works, Starlette's disconnect listener runs beside the response the way ``StreamingResponse`` runs
it: it notices the client going away during the queue wait and prefill as well as mid-stream. On that signal the
request is aborted in the backend, and the response gets a moment (``ABORT_REPORT_WAIT_S``) to read the backend's
final event, which tells where the request was (scheduled, first token), before it is cancelled.

Every exit, success or failure, funnels through one ``finally`` that closes the timeline exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from tailguard.api_error import APIError
from tailguard.backends.base import Backend, EventStream, Submission, Submitted
from tailguard.backends.stall_watch import watch
from tailguard.backends.upstream.events import UpstreamError
from tailguard.engine.sequence import EngineClosed, RequestError, SamplingParams, SequenceFailed
from tailguard.engine.structured import is_grammar_limit
from tailguard.observe.metrics import clean_label
from tailguard.observe.sealing import TokenSeal, load_key, sampling_to_json
from tailguard.observe.timeline import Outcome, Timeline
from tailguard.policy.decision import clean_text
from tailguard.policy.lanes import LaneConfig
from tailguard.serving.choices import Choices, ChoicesResponder, choice_submissions
from tailguard.serving.client_relay import ClientRelay
from tailguard.serving.errors import outcome_of
from tailguard.serving.exchange import (
    Exchange,
    Incoming,
    Phase,
    forwarded_headers,
    identify,
    open_timeline,
    run_watched,
)
from tailguard.serving.prompt import PromptReader, prompt_text
from tailguard.serving.protocol import (
    OWN_FIELDS,
    Parsed,
    decode_json,
    parse_chat,
    parse_completion,
    parse_passthrough,
    refuse_oversized,
)
from tailguard.serving.respond import FallbackRecord, Responder
from tailguard.serving.state import ServerState

log = logging.getLogger("tailguard.server")
perf_counter = time.perf_counter

# How long an aborted request waits for the backend's final event (its timestamps) before it is recorded without.
ABORT_REPORT_WAIT_S = 0.5


@dataclass(slots=True)
class Prepared:
    """A validated request, its prompt tokenized (unless the backend tokenizes), ready to submit."""

    parsed: Parsed
    ids: list[int]
    text: str | None  # the prompt as text, when it came as text
    sampling: SamplingParams
    body: dict[str, Any]  # the request as the client sent it, less tailguard's own fields (what an upstream gets)


class Endpoint:
    """An inference endpoint's exchange from arrival to record: its timeline, its place among the requests a drain
    answers, every failure as the client's answer and the record's outcome, and what it held given back, once.
    ``_exchange`` is the endpoint's own work."""

    def __init__(self, state: ServerState, path: str) -> None:
        self.state = state
        self.path = path

    async def _exchange(self, ex: Exchange, request: Incoming) -> None:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = perf_counter()
        st = self.state
        request = Incoming(scope, receive)
        tl = open_timeline(st, request, self.path, received)
        ex = Exchange(st, send, tl)
        st.admission.in_flight += 1
        me = asyncio.current_task()
        st.admission.live[me] = ex  # what a drain on SIGTERM answers, waits for or ends (serving/drain.py)
        shutting_down = False
        try:
            await self._exchange(ex, request)
        except APIError as err:
            tl.error = clean_text(err.message, 1000)
            await ex.fail(err)
            tl.finalize(err.status, outcome_of(err))
        except ClientDisconnect:  # gone while we read its body
            answered = scope.get("tailguard.answered")  # or cut by the connection guard (a 408 for a slow body)
            if answered is not None:
                tl.error = "the request body arrived too slowly"
                tl.finalize(answered, Outcome.INVALID)
            else:
                tl.error = tl.error or "client disconnected"
                tl.finalize(499, Outcome.ABORTED)
        except UpstreamError as exc:
            tl.error = clean_text(exc.message, 1000)
            gm = st.gateway_metrics
            if gm is not None and ex.started:
                gm.interrupted.labels(gm.model, tl.lane).inc()
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
            # An upstream's own 4xx reaches the client as the upstream wrote it, and is the client's (invalid, or
            # rejected for a 429), never an error of the service's in the SLO.
            passed_on = APIError(exc.status, exc.client_message or f"{exc.message}; request id {tl.request_id}",
                                 type=exc.type, param=exc.param, code=exc.code, headers=headers)
            await ex.fail(passed_on)
            tl.finalize(exc.status, outcome_of(passed_on) if exc.status < 500 else Outcome.ERROR)
        except SequenceFailed as exc:  # this request alone failed inside the engine; the engine goes on
            tl.error = clean_text(str(exc), 1000)
            if is_grammar_limit(str(exc)):  # its own schema or grammar grew too complex: the client's error
                await ex.fail(APIError(400, f"{exc}; request id {tl.request_id}",
                                       code="grammar_too_complex"))
                tl.finalize(400, Outcome.INVALID)
            else:
                await ex.fail(APIError(500, f"the engine failed on this request ({exc}); request id "
                                            f"{tl.request_id}", code="engine_request_failed"))
                tl.finalize(500, Outcome.ERROR)
        except EngineClosed as exc:  # the engine stopped under this request: say so, as a 503 the client may retry
            tl.error = clean_text(str(exc), 1000)
            await ex.fail(APIError(503, f"the engine is not running ({exc}); request id {tl.request_id}",
                                   code="engine_unavailable", headers={"Retry-After": "5"}))
            tl.finalize(503, Outcome.ERROR)
        except asyncio.CancelledError:
            drain = st.admission.drain
            cut = drain.cut_error() if drain is not None else None
            if cut is None:
                tl.error = "cancelled by the server (shutdown)"
                tl.finalize(503, Outcome.ABORTED)
                shutting_down = True
                raise
            answer, outcome = cut  # the drain ended it: the client gets its answer, the record says the same
            tl.error = answer.message
            try:
                await ex.fail(answer)
            finally:
                tl.finalize(answer.status, outcome)
        except Exception:
            log.exception("request %s failed", tl.request_id)
            tl.error = "internal error"
            await ex.fail(APIError(500, f"internal server error; request id {tl.request_id}"))
            tl.finalize(500, Outcome.ERROR)
        finally:
            # Begun and not ended by its [DONE] (an upstream or the engine failed, a drain cut it), the client there.
            tl.interrupted = bool(tl.stream and tl.token_sent and tl.outcome is not Outcome.SUCCESS
                                  and tl.status != 499)
            st.admission.live.pop(me, None)
            ex.move(Phase.CLOSED)  # gives the queue slot back if the request still held one
            st.policy.release(ex.decision, tl.num_output_tokens)  # its lane slot, the tokens it never produced
            if shutting_down:
                try:
                    st.close_record(tl)
                finally:
                    # Last, so that "nothing in flight" means every record has reached the store's queue.
                    st.admission.in_flight -= 1
            else:
                st.close_record_soon(tl)  # and in_flight with it, after the work this turn made ready


class CompletionEndpoint(Endpoint):
    def __init__(self, state: ServerState, chat: bool) -> None:
        super().__init__(state, "/v1/chat/completions" if chat else "/v1/completions")
        self.chat = chat
        self._seq = 0
        self.prompts = PromptReader(state, chat)
        self.answers = Responder(state, chat)
        key = load_key(state.config.seal_key_file)
        self.seal = TokenSeal(key) if key else None  # a bad key stops the server at its start, not a request

    # --- the exchange -------------------------------------------------------------------------------------------------
    async def _exchange(self, ex: Exchange, request: Incoming) -> None:
        st, tl, policy, d = self.state, ex.tl, self.state.policy, ex.decision
        identify(st, ex, request)
        backend = st.engine
        if backend is None or not st.ready:
            msg = f"the model failed to load: {st.load_error}" if st.load_error else "the model is still loading"
            raise APIError(503, msg, code="model_not_ready", headers={"Retry-After": "5"})
        body = await self.prompts.read_body(request, self.prompts.body_limit(backend))
        tl.body_arrived(perf_counter())
        # The SLO actions match the business type the client sent, not its metric label: the label set is capped
        # (an allowlist, or the first 32 types seen), and a type counted as "other" must still be shed or degraded.
        btype = clean_label(request.headers.get("x-business-type"))
        policy.shed(d, tl, btype)
        prep = await self._prepare(ex, backend, body, btype)
        if d.degradation is not None and d.degradation.mode == "template":
            await self.answers.template(ex, prep.parsed, d.degradation.template)
            return
        max_tokens = prep.sampling.max_tokens * prep.parsed.n  # every choice may produce them all
        await policy.charge(d, tl, max_tokens)
        priority = policy.priority(d, tl, prep.parsed.priority)
        targeted = d.lane is not None and d.lane.ttft_target_s is not None
        if targeted:  # the backend's queue alone misses the target: no wait in the lane's queue first
            policy.refuse_late(d, tl, backend.predict_ttft(tl.num_prompt_tokens, priority), perf_counter())
        await policy.admit(d, tl, tl.num_prompt_tokens + max_tokens)
        if targeted and d.lane_waited:  # again, with the time it waited for its lane and the backend as it is now
            policy.refuse_late(d, tl, backend.predict_ttft(tl.num_prompt_tokens, priority), perf_counter())
        ex.enqueue()
        if st.batch_cap is not None:  # the forecast counts the load the engine is offered, when it arrived
            st.batch_cap.record_arrival(tl.received)
        tl.resources = st.resources()
        p, ids = prep.parsed, prep.ids
        if st.config.store_text:
            tl.prompt_text = prep.text if prep.text is not None or backend.tokenizer is None \
                else backend.tokenizer.decode(ids)
            tl.prompt_token_ids = ids
            if p.logprobs is not None:
                tl.logprobs = []
        if self.seal is not None and backend.tokenizer is not None:
            self._seal(ex, prep)
        engine_id = tl.request_id
        if engine_id in st.active_ids:  # a client reused its X-Request-ID while the first is still running
            self._seq += 1
            engine_id = f"{engine_id}#{self._seq}"
        st.active_ids.add(engine_id)
        tl.queued = perf_counter()
        lane = d.lane
        sub = Submission(
            engine_id, self.chat, prep.sampling, ids, tl.num_prompt_tokens, prompt_text=prep.text, body=prep.body,
            max_tokens_cap=d.max_tokens_cap, priority=priority, arrival_time=tl.received)
        submitted: Submitted | None = None
        try:
            if backend.tokenizer is None:  # replicas: routed by session, with the trace context
                sub.session = p.user or request.headers.get("x-session-id")
                sub.headers = forwarded_headers(request)
                if p.stream and p.n == 1 and self._relays(lane, p):
                    ex.relay = sub.relay = ClientRelay.for_send(ex.send, st.relay_flusher)
            if lane is not None and lane.watches:
                sub.watch = partial(watch, ttft_deadline=lane.ttft_deadline_s, itl_deadline=lane.itl_deadline_s,
                                    misses=lane.stall_misses, keepalive=lane.keepalive_s if p.stream else None,
                                    on_miss=self._on_miss(tl), relay=ex.relay)
                if lane.stall_fallback == "replica" and (lane.ttft_deadline_s or lane.itl_deadline_s) and p.n == 1:
                    # A stall continues the answer on another replica (the template only when that fails too).
                    sub.fallback = FallbackRecord(tl, st.gateway_metrics)
                    sub.wanted = lambda: ex.phase < Phase.ABANDONED
            if p.n > 1:
                await self._choices(ex, request, backend, sub, p)
            else:
                submitted = backend.submit(sub)
                await self._answer(ex, request, backend, engine_id, p, submitted.events)
        except RequestError as exc:
            raise APIError(400, str(exc)) from None
        finally:
            st.active_ids.discard(engine_id)
            if submitted is not None:
                submitted.release()  # what the backend started ahead and nothing took up
        if ex.phase is Phase.ABANDONED:  # the backend said nothing in time: where it was is what we saw
            self.answers.abandoned(ex, None)
        elif ex.audit_ids is not None and tl.spec_proposed and tl.outcome is Outcome.SUCCESS and not tl.degraded:
            assert st.audit is not None
            st.audit.submit(backend, tl.request_id, ids, prep.sampling, ex.audit_ids)

    def _seal(self, ex: Exchange, prep: Prepared) -> None:
        """Keep what a rebuild needs, sealed by the store: the token ids in and out, the sampling and its seed."""
        sampling = prep.sampling
        seed_given = sampling.seed is not None
        if not seed_given and not sampling.greedy:
            # A seed of its own, drawn at random: the answer is as random as the shared generator's, and repeatable.
            sampling.seed = secrets.randbits(63)
        out = ex.output_ids = []
        payload = {"prompt_ids": prep.ids, "output_ids": out, "sampling": sampling_to_json(sampling),
                   "seed_given": seed_given, "chat": self.chat}
        seal = self.seal
        assert seal is not None
        ex.tl.sealed = lambda: seal.seal(payload)

    @staticmethod
    async def _watched(ex: Exchange, request: Incoming, respond: Callable[[], Awaitable[None]],
                       abort: Callable[[], None]) -> None:
        """Answer while watching for the client to leave; on that signal ``abort`` the work in the backend."""

        def on_disconnect() -> bool:
            if not ex.abandon():
                return False  # the answer was complete: uvicorn reports every closed connection
            abort()
            return True

        try:
            await run_watched(respond, request.receive, on_disconnect, ABORT_REPORT_WAIT_S)
        except OSError:  # an ASGI 2.4 server may report a gone client as a failed send
            if not on_disconnect():
                raise

    async def _answer(self, ex: Exchange, request: Incoming, backend: Backend, engine_id: str, p: Parsed,
                      events: EventStream) -> None:
        respond = self.answers.stream if p.stream else self.answers.full
        async with aclosing(events):  # leaving early aborts the request
            await self._watched(ex, request, lambda: respond(ex, p, events), lambda: backend.abort(engine_id))

    async def _choices(self, ex: Exchange, request: Incoming, backend: Backend, first: Submission, p: Parsed) -> None:
        """Several choices (``n`` > 1): one submission each, merged into one answer (``choices.py``)."""
        st = self.state
        subs = choice_submissions(first, p.n)
        extra_ids = [s.request_id for s in subs[1:]]
        st.active_ids.update(extra_ids)
        choices = Choices(backend, subs, wanted=lambda: ex.phase < Phase.ABANDONED)
        merged = choices.events()
        responder = ChoicesResponder(self.answers)
        respond = responder.stream if p.stream else responder.full
        try:
            async with aclosing(merged):  # leaving early closes every choice's events, which aborts them
                await self._watched(ex, request, lambda: respond(ex, p, merged), choices.abort)
        finally:
            st.active_ids.difference_update(extra_ids)
            choices.release()

    def _relays(self, lane: LaneConfig | None, p: Parsed) -> bool:
        """Whether plain tokens may take the direct relay: not when something holds or rewrites each token after
        the first (pacing, flushing every N, logprobs). The stall watch counts the relay's tokens (its
        ``on_token``) and a stall fallback continues from its texts (``sink``); after the first token no loop turn
        passes between their generators and the stream (no task of their own), which keeps the relay's order."""
        return self.state.config.direct_relay and p.logprobs is None and (
            lane is None or (not lane.pace_itl_s and lane.flush_every <= 1))

    def _on_miss(self, tl: Timeline) -> Callable[[str], None]:
        gm = self.state.gateway_metrics

        def miss(kind: str) -> None:
            g = tl.gateway = tl.gateway or {}
            g[f"{kind}_misses"] = g.get(f"{kind}_misses", 0) + 1
            if gm is not None:
                gm.stalls.labels(gm.model, tl.lane, kind).inc()
        return miss

    async def _prepare(self, ex: Exchange, backend: Backend, body: bytes, btype: str) -> Prepared:
        """Parse and check the request, tokenize its prompt (unless the backend does), and decide its limits."""
        st, tl, d = self.state, ex.tl, ex.decision
        data = decode_json(body)
        takes_text = backend.tokenizer is None
        if takes_text:  # upstream replicas: the API passes through; only the gateway's own fields are checked
            p = parse_passthrough(data, self.chat)
        else:
            assert backend.tokenizer is not None
            refuse_oversized(data, self.chat, backend.max_model_len, backend.tokenizer.vocab_size)
            p = parse_chat(data) if self.chat else parse_completion(data, backend.tokenizer.vocab_size)
        tl.stream = p.stream
        if p.model not in st.model_names:
            raise APIError(404, f"The model `{clean_text(p.model, 200)}` does not exist; this server has: "
                                f"{', '.join(st.model_names)}", param="model", code="model_not_found")
        tl.user = clean_text(p.user) or tl.user
        if takes_text:
            # The upstream tokenizes: the prompt's size is estimated (4 characters a token) for admission and
            # routing, and replaced by the upstream's own count when its usage comes back.
            ids: list[int] = []
            text: str | None = prompt_text(p)
            tl.num_prompt_tokens = max(1, len(text or "") // 4)
        else:
            self.prompts.check_prompt_size(backend, p)
            ids, text = await self.prompts.tokenize(backend, p)
            tl.num_prompt_tokens = len(ids)
        tl.tokenized = perf_counter()
        requested = p.max_tokens
        if requested is None:
            requested = st.config.default_max_tokens or (
                256 if takes_text else max(1, backend.max_model_len - len(ids)))
        max_tokens = st.policy.degrade(d, tl, btype, len(ids), requested)
        p.max_tokens = max_tokens
        tl.sampling = p.sampling_record()
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
            stop=p.stop, ignore_eos=p.ignore_eos, min_tokens=min(p.min_tokens, max_tokens), logprobs=p.logprobs,
            speculative=p.speculative, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, structured=p.structured,
        )
        if takes_text:
            data = {k: v for k, v in data.items() if k not in OWN_FIELDS}  # tailguard's own: not for the upstream
            return Prepared(p, ids, text, sampling, data)
        if st.audit is not None and p.n == 1 and st.audit.wants(sampling):
            ex.audit_ids = []
        try:
            backend.check_request(len(ids), sampling)
        except RequestError as exc:
            msg = str(exc)
            long = "context" in msg or "KV" in msg or "empty" in msg
            raise APIError(400, msg, param=("messages" if self.chat else "prompt") if long else None,
                           code="context_length_exceeded" if "context" in msg else "invalid_value") from None
        return Prepared(p, ids, text, sampling, data)
