"""OpenTelemetry traces of requests, built from their timelines and exported over OTLP/HTTP (docs/observability.md).

One span per request (kind SERVER, named ``chat MODEL`` or ``text_completion MODEL`` as the gen_ai semantic
conventions name spans) with a child span per stage that the request reached (``tokenize``, ``queue``, ``prefill``,
``decode``, ``stream``), and a CLIENT child ``upstream`` for each call a gateway made to another server for it.

The spans are not timed by the SDK: they are made once, when the record closes, from the timeline's monotonic
boundaries (the same ones the metrics, the store and ``Server-Timing`` use), converted to epoch nanoseconds through
one anchor per request (the wall clock read at arrival). So the children tile the request span exactly, as the
stages tile E2E. A finished request goes to a ``BatchSpanProcessor``'s queue; its thread makes the spans and exports
them, never the request's task.

W3C Trace Context: :class:`TraceContextMiddleware` reads the client's ``traceparent`` (and ``tracestate``), so the
request span becomes a child of the client's span, and answers with ``traceresponse`` (Trace Context Level 2: the
server span's id). A gateway sends the headers of :func:`upstream_call` (or :func:`upstream_headers`) to its
upstream, so the upstream's request span is a child of this one's ``upstream`` span.

Nothing here is imported, installed or run when no OTLP endpoint is configured.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

from tailguard import __version__
from tailguard.observe.timeline import STAGES, Outcome, Timeline

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from tailguard.observe.tracing_config import TracingConfig

__all__ = [
    "TRACED_PATHS",
    "RequestTrace",
    "RequestTracer",
    "TraceContextMiddleware",
    "UpstreamCall",
    "current_trace",
    "traces_url",
    "upstream_call",
    "upstream_headers",
]

log = logging.getLogger("tailguard.tracing")

# The endpoints that keep a timeline: the only ones with a span (scrapes of /metrics and probes make none).
TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
GEN_AI_SYSTEM = "tailguard"
REQUESTS_PER_POST = 16  # requests (about 6 spans each) encoded and sent at a time by the export thread
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_PROPAGATOR = TraceContextTextMapPropagator()
_IDS = RandomIdGenerator()

# W3C Trace Context, checked before the propagator sees a client's headers: it logs a warning for each header it
# refuses, and a client's headers must not make a log line per request.
_MAX_HEADER_CHARS = 512  # W3C: a traceparent of a later version, and the tracestate we pass on, at most
_MAX_TRACESTATE_MEMBERS = 32
_TRACEPARENT_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")  # version 00: exactly these 55 characters
# A later version starts like version 00 and may add fields after a dash (version ff is invalid).
_TRACEPARENT_LATER = re.compile(r"(?!ff)(?!00)[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(?:-.*)?")
_TRACESTATE_KEY = (r"(?:[a-z][_0-9a-z\-*/]{0,255}"  # simple-key, or tenant-id@system-id
                   r"|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})")
_TRACESTATE_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_TRACESTATE_MEMBER = re.compile(f"{_TRACESTATE_KEY}={_TRACESTATE_VALUE}")


def _valid_traceparent(value: str) -> bool:
    """A traceparent the propagator takes without complaint: version 00's form, or a later version's within 512
    characters (the ids are checked for zeros by the propagator, silently)."""
    value = value.strip(" \t")
    if value.startswith("00"):
        return _TRACEPARENT_00.fullmatch(value) is not None
    return len(value) <= _MAX_HEADER_CHARS and _TRACEPARENT_LATER.fullmatch(value) is not None


def _valid_tracestate(value: str) -> bool:
    """A tracestate worth passing on: 512 characters at most, 32 members at most, each ``key=value`` in W3C's form.
    Anything else is dropped whole (W3C lets a vendor discard it) rather than half-kept."""
    if len(value) > _MAX_HEADER_CHARS:
        return False
    members = [m for m in (m.strip(" \t") for m in value.split(",")) if m]  # empty members are allowed
    return len(members) <= _MAX_TRACESTATE_MEMBERS and all(_TRACESTATE_MEMBER.fullmatch(m) for m in members)


# The trace of the request being served, set by the middleware for the request's task (and the tasks it starts).
_current: ContextVar[RequestTrace | None] = ContextVar("tailguard_request_trace", default=None)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``/v1/traces`` added to a bare ``http://host:port``, any other URL kept as given."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def _header(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


@dataclass
class UpstreamCall:
    """One call a gateway made upstream for a request: a CLIENT span, child of the request span, and the parent of
    the upstream's own request span. ``attributes`` may be added to until the request's record closes (e.g.
    ``http.response.status_code``, a replica id)."""

    span_id: int
    headers: dict[str, str]  # what to send upstream: ``traceparent`` and, when the client sent one, ``tracestate``
    attributes: dict[str, Any] = field(default_factory=dict)
    start: float | None = None  # perf_counter; None: from the hand-off to the engine
    end: float | None = None  # perf_counter; None: to the request's last byte
    error: str | None = None


@dataclass
class RequestTrace:
    """Where one request sits in its trace: ids chosen at arrival, spans made after its record closes."""

    trace_id: int
    span_id: int  # the request (SERVER) span
    sampled: bool
    parent: SpanContext | None = None  # the client's span, from a valid ``traceparent``
    trace_state: TraceState = field(default_factory=TraceState)
    upstream: list[UpstreamCall] = field(default_factory=list)  # a gateway's calls (retries included), in order

    @property
    def traceparent(self) -> str:
        """This request's span as a W3C ``traceparent`` value (also what ``traceresponse`` carries)."""
        return _header(self.trace_id, self.span_id, self.sampled)

    def new_upstream_call(self, attributes: dict[str, Any] | None = None) -> UpstreamCall:
        """A new upstream call (a span id of its own) and the headers that make it the upstream's parent."""
        span_id = _IDS.generate_span_id()
        headers = {"traceparent": _header(self.trace_id, span_id, self.sampled)}
        state = self.trace_state.to_header()
        if state:
            headers["tracestate"] = state
        call = UpstreamCall(span_id, headers, dict(attributes or {}))
        self.upstream.append(call)
        return call


def current_trace() -> RequestTrace | None:
    """The trace of the request this task serves; None when tracing is off or outside a traced request."""
    return _current.get()


def upstream_headers(attributes: dict[str, Any] | None = None) -> dict[str, str]:
    """For a gateway: the ``traceparent`` (and ``tracestate``) to send upstream for the request being served, or
    ``{}`` when it is not traced. Each call is one upstream call (one CLIENT span, from the hand-off to the engine
    to the last byte; :func:`upstream_call` times it exactly). Call it from the request's task, where the backend's
    ``generate`` runs: the trace is found there, since a backend is handed no timeline."""
    trace = _current.get()
    return trace.new_upstream_call(attributes).headers if trace is not None else {}


@contextlib.contextmanager
def upstream_call(attributes: dict[str, Any] | None = None) -> Iterator[UpstreamCall]:
    """For a gateway: time one upstream call as a CLIENT span of the request being served; send ``call.headers``.

    ``attributes`` (semantic-convention names, e.g. ``{"url.full": url, "server.address": host}``) go on the span,
    and so does whatever is put in ``call.attributes`` inside the block. An exception leaving the block marks the
    span as failed and propagates. Outside a traced request the call is a no-op with empty headers.
    """
    trace = _current.get()
    if trace is None:
        yield UpstreamCall(0, {}, dict(attributes or {}))
        return
    call = trace.new_upstream_call(attributes)
    call.start = time.perf_counter()
    try:
        yield call
    except GeneratorExit:
        # The consumer of a generator around the call stopped reading it (it had the last event, or the client went
        # away): the call itself did not fail.
        raise
    except BaseException as exc:
        call.error = type(exc).__name__
        raise
    finally:
        call.end = time.perf_counter()


class RequestTracer:
    """Makes the spans of finished requests and hands them to a batch processor (its own thread exports them)."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            if config.otlp_endpoint is None:
                raise ValueError("tracing needs an OTLP endpoint (tracing.otlp_endpoint or OTEL_EXPORTER_OTLP_ENDPOINT)")
            self.endpoint: str | None = traces_url(config.otlp_endpoint)
            exporter = OTLPSpanExporter(endpoint=self.endpoint, timeout=config.export_timeout_s)
        else:
            self.endpoint = None
        # The batch queue holds finished requests, not spans: the export thread makes their spans (~45 us each) just
        # before it sends them, so the request's task pays only for an append.
        self.processor = BatchSpanProcessor(_SpanMaker(self, exporter), max_export_batch_size=128)
        # A client's sampled flag decides for its trace; a new trace is kept with probability sample_ratio.
        self.sampler = ParentBased(TraceIdRatioBased(config.sample_ratio))
        self.resource = _FixedResource(Resource.create({"service.name": config.service_name,
                                                          "service.version": __version__}))
        self.scope = InstrumentationScope("tailguard", __version__)

    # --- at arrival -------------------------------------------------------------------------------------------------
    def begin(self, traceparent: str | None = None, tracestate: str | None = None) -> RequestTrace:
        """A request arrived: join the client's trace when its ``traceparent`` is valid, else start one. A
        ``tracestate`` that is too long, has too many members or a malformed one is dropped (the trace is still
        joined)."""
        parent: SpanContext | None = None
        if traceparent and _valid_traceparent(traceparent):
            keep_state = tracestate and _valid_tracestate(tracestate)
            carrier = {"traceparent": traceparent, **({"tracestate": tracestate} if keep_state else {})}
            ctx = _PROPAGATOR.extract(carrier)
            span_ctx = trace_api.get_current_span(ctx).get_span_context()
            parent = span_ctx if span_ctx.is_valid else None  # malformed: restart the trace (W3C says so)
        if parent is not None:
            trace_id, parent_ctx = parent.trace_id, trace_api.set_span_in_context(trace_api.NonRecordingSpan(parent))
        else:
            trace_id, parent_ctx = _IDS.generate_trace_id(), None
        decision = self.sampler.should_sample(parent_ctx, trace_id, "request")
        return RequestTrace(trace_id=trace_id, span_id=_IDS.generate_span_id(), sampled=decision.decision.is_sampled(),
                            parent=parent, trace_state=parent.trace_state if parent is not None else TraceState())

    # --- when the record closes -------------------------------------------------------------------------------------
    def finish(self, tl: Timeline, trace: RequestTrace | None = None) -> None:
        """Queue a finished request for export: its spans are made later, in the export thread (the timeline is
        not changed after its record closes)."""
        trace = trace or _current.get() or self.begin()
        if trace.sampled:
            self.processor.on_end(_FinishedRequest(tl, trace))  # type: ignore[arg-type] - expanded by _SpanMaker

    def spans(self, tl: Timeline, trace: RequestTrace) -> list[ReadableSpan]:
        bounds = tl.boundaries()
        # One anchor per request: the wall clock read at arrival. Every other instant is a monotonic offset from it,
        # in integer nanoseconds, so the spans nest and tile exactly as the stages do.
        anchor_ns, r0 = int(tl.received_unix * 1e9), tl.received

        def ns(t: float) -> int:
            return anchor_ns + round((t - r0) * 1e9)

        flags = _SAMPLED
        root = SpanContext(trace.trace_id, trace.span_id, is_remote=False, trace_flags=flags,
                           trace_state=trace.trace_state)

        def child(name: str, start: float, end: float, kind: SpanKind = SpanKind.INTERNAL,
                  attributes: dict[str, Any] | None = None, span_id: int | None = None,
                  status: Status | None = None) -> ReadableSpan:
            ctx = SpanContext(trace.trace_id, span_id or _IDS.generate_span_id(), is_remote=False, trace_flags=flags,
                              trace_state=trace.trace_state)
            return ReadableSpan(name=name, context=ctx, parent=root, resource=self.resource, kind=kind,
                                attributes=attributes or {}, start_time=ns(start), end_time=ns(end),
                                instrumentation_scope=self.scope, status=status or Status(StatusCode.UNSET))

        out: list[ReadableSpan] = []
        # A stage has a span when the request reached it (its opening boundary happened); the last one reached runs
        # to the end, as the timeline charges a missing interval to the stage the request was in.
        opened = (tl.received, tl.tokenized, tl.scheduled, tl.first_token, tl.last_token)
        for i, name in enumerate(STAGES):
            if opened[i] is not None:
                out.append(child(name, bounds[i], bounds[i + 1]))
        for call in trace.upstream:
            start = call.start if call.start is not None else (tl.queued or bounds[1])
            start = min(max(start, bounds[0]), bounds[-1])
            end = min(max(call.end if call.end is not None else bounds[-1], start), bounds[-1])
            status = Status(StatusCode.ERROR, call.error) if call.error else None
            out.append(child("upstream", start, end, SpanKind.CLIENT, dict(call.attributes), span_id=call.span_id,
                             status=status))

        events: list[Event] = []
        # When the first token left, as it happened (the spans are the boundaries as they happened; TTFT, on the
        # server's clock, leaves out a wait for a slow reader).
        first = tl.token_sent[0] if tl.stream and tl.token_sent else (tl.token_times[0] if tl.token_times else None)
        if first is not None:
            events.append(Event("gen_ai.first_token", timestamp=ns(first)))
        operation = "chat" if tl.endpoint.endswith("/chat/completions") else "text_completion"
        status = (Status(StatusCode.ERROR, tl.error or f"HTTP {tl.status}") if tl.status >= 500
                  else Status(StatusCode.UNSET))
        request = ReadableSpan(
            name=f"{operation} {tl.model}".strip(), context=root, parent=trace.parent, resource=self.resource,
            kind=SpanKind.SERVER, attributes=self.attributes(tl, operation), events=events,
            start_time=ns(bounds[0]), end_time=ns(bounds[-1]), instrumentation_scope=self.scope, status=status)
        out.append(request)
        return out

    @staticmethod
    def attributes(tl: Timeline, operation: str) -> dict[str, Any]:
        """The request span's attributes: gen_ai semantic conventions, HTTP, and tailguard's own (no text, no user)."""
        s = tl.summary()
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.system": GEN_AI_SYSTEM,
            "gen_ai.provider.name": GEN_AI_SYSTEM,
            "gen_ai.request.model": tl.model,
            "gen_ai.response.model": tl.model,
            "gen_ai.usage.input_tokens": tl.num_prompt_tokens,
            "gen_ai.usage.output_tokens": tl.num_output_tokens,
            "http.request.method": "POST",
            "url.path": tl.endpoint,
            "http.response.status_code": tl.status,
            "tailguard.request_id": tl.request_id,
            "tailguard.lane": tl.lane,
            "tailguard.business_type": tl.business_type,
            "tailguard.client": tl.client,
            "tailguard.region": tl.region,
            "tailguard.stream": tl.stream,
            "tailguard.outcome": tl.outcome.value if tl.outcome else "unknown",
            "tailguard.e2e_s": s.e2e,
            "tailguard.queue_wait_s": s.stages["queue"],
            "tailguard.preemptions": tl.num_preemptions,
        }
        if tl.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [tl.finish_reason]
        if s.ttft is not None:
            # Named as the gen_ai server metric of the same definition (docs/metrics.md).
            attrs["gen_ai.server.time_to_first_token"] = s.ttft
        if s.tpot is not None:
            attrs["gen_ai.server.time_per_output_token"] = s.tpot
        if tl.outcome is not None and tl.outcome is not Outcome.SUCCESS:
            attrs["error.type"] = tl.outcome.value
        sampling = tl.sampling or {}
        for key in ("max_tokens", "temperature", "top_p", "top_k"):
            value = sampling.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attrs[f"gen_ai.request.{key}"] = value
        if tl.slo_action:
            attrs["tailguard.slo_action"] = str(tl.slo_action.get("action"))
            if tl.slo_action.get("mode"):
                attrs["tailguard.slo_mode"] = str(tl.slo_action["mode"])
        return attrs

    # --- lifecycle --------------------------------------------------------------------------------------------------
    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return self.processor.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop the export thread."""
        self.processor.shutdown()


class _FixedResource(Resource):
    """The process's resource, hashed once: the encoder groups every span by its resource, and ``Resource`` hashes
    by serializing its attributes to JSON each time (17 us per request of six spans)."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


# What the batch processor checks before it queues an item: the item's context says "sampled".
_SAMPLED_MARK = SpanContext(trace_id=1, span_id=1, is_remote=False, trace_flags=_SAMPLED)


class _FinishedRequest:
    """A finished request in the batch queue, standing in for its spans until the export thread makes them."""

    __slots__ = ("tl", "trace")
    context = _SAMPLED_MARK

    def __init__(self, tl: Timeline, trace: RequestTrace) -> None:
        self.tl = tl
        self.trace = trace


class _SpanMaker(SpanExporter):
    """The exporter the batch processor calls (in its own thread): makes each request's spans, then exports them."""

    def __init__(self, tracer: RequestTracer, exporter: SpanExporter) -> None:
        self.tracer = tracer
        self.exporter = exporter

    def export(self, items: Sequence[Any]) -> SpanExportResult:
        # Python threads share one lock: a thread that computes for long makes the event loop wait up to the switch
        # interval (5 ms) at each of its turns. So the work goes in small pieces, and the lock is handed back after
        # each request's spans and each POST (measured: P99 of a loaded server 2x without this, see observability.md).
        for i in range(0, len(items), REQUESTS_PER_POST):
            spans: list[ReadableSpan] = []
            for item in items[i:i + REQUESTS_PER_POST]:
                try:
                    spans.extend(self.tracer.spans(item.tl, item.trace))
                except Exception:  # noqa: BLE001 - one odd timeline must not lose the batch
                    log.exception("tracing: could not make the spans of request %s", item.tl.request_id)
                time.sleep(0)
            if spans and self.exporter.export(spans) is not SpanExportResult.SUCCESS:
                # The collector refused or is unreachable (after the exporter's own retries): the rest of this batch
                # would fare no better, and the queue behind it should not wait for it.
                return SpanExportResult.FAILURE
            time.sleep(0)
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.exporter.shutdown()


class TraceContextMiddleware:
    """ASGI middleware, installed only when tracing is on: W3C Trace Context in and out of the traced endpoints.

    It reads ``traceparent``/``tracestate``, makes the request's :class:`RequestTrace` current for the request's
    task (``ServerState.close_record`` finds it there), and adds ``traceresponse`` to the response.
    """

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state  # the ServerState; its tracer exists once the lifespan has started it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer: RequestTracer | None = getattr(self.state, "tracer", None)
        if tracer is None or scope["type"] != "http" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        traceparent = tracestate = None
        for name, value in scope["headers"]:
            if name == b"traceparent":
                traceparent = value.decode("latin-1")
            elif name == b"tracestate":  # several fields make one list (RFC 9110)
                text = value.decode("latin-1")
                tracestate = text if tracestate is None else f"{tracestate},{text}"
        trace = tracer.begin(traceparent, tracestate)
        response_header = (b"traceresponse", trace.traceparent.encode())

        async def send_with_trace(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), response_header]}
            await send(message)

        token = _current.set(trace)
        try:
            await self.app(scope, receive, send_with_trace)
        finally:
            _current.reset(token)
