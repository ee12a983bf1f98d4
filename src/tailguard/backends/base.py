"""The one interface the server talks to: a prepared request goes in (``Submission``), token events come out.

Three backends implement it: the embedded engine and the scripted fake, through ``local.LocalBackend``, and upstream
replicas over HTTP (``upstream.proxy.UpstreamBackend``). The server never asks which one it holds: what differs
(who tokenizes, what capacity means, whether a stalled stream can go on elsewhere) is a member of the protocol.
Typed structurally (``typing.Protocol``): a new backend needs these members and nothing else (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tailguard.engine.events import EngineStats, TokenEvent
from tailguard.engine.sequence import SamplingParams

if TYPE_CHECKING:
    from tailguard.backends.stall_watch import Stalled
    from tailguard.backends.upstream.relay import Relay

# Closing it (``aclose``) before its end aborts the request in the backend.
EventStream = AsyncGenerator[TokenEvent, None]


@runtime_checkable
class Tokenizer(Protocol):
    """What the server asks of a backend's tokenizer (``GGUFTokenizer`` and the fake's ``ByteTokenizer``)."""

    vocab_size: int
    special_ids: set[int]
    max_token_chars: int  # the most characters one token covers: characters / this <= tokens

    def encode(self, text: str) -> list[int]: ...

    def min_tokens(self, text: str) -> int:
        """A floor on ``len(encode(text))``, computed without tokenizing."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def render_chat(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> str: ...


class FallbackReport(Protocol):
    """What a backend that continues a stalled stream elsewhere tells the server (for the record and the metrics)."""

    def switched(self, stalled_on: str | None, sent_tokens: int, stalled: Stalled) -> None:
        """The answer goes on at another replica after ``sent_tokens`` tokens."""

    def finished(self, outcome: str, replica: str | None) -> None:
        """How the fallback ended: ok, stalled, failed, no_replica, interrupted, or not_continuable."""


def _always() -> bool:
    return True


@dataclass(slots=True)
class Submission:
    """A request the server has read, checked and decided on, ready for a backend: everything a backend needs, and
    nothing of HTTP or of the traffic policy that produced it."""

    request_id: str  # unique among the backend's running requests
    chat: bool  # /v1/chat/completions (else /v1/completions)
    sampling: SamplingParams  # the effective parameters: ``max_tokens`` is the limit the request runs under
    prompt_token_ids: list[int]  # empty when the backend tokenizes (``tokenizer`` is None)
    num_prompt_tokens: int  # counted, or estimated where the backend tokenizes
    prompt_text: str | None = None  # the prompt as text, when it came as text
    body: dict[str, Any] = field(default_factory=dict)  # the client's request, less tailguard's own fields
    max_tokens_cap: int | None = None  # a limit the policy set below the client's (an SLO truncation)
    priority: int = 0  # the engine priority the policy decided (higher runs first)
    arrival_time: float | None = None  # perf_counter at arrival, for the engine's queue accounting
    session: str | None = None  # the caller's user or session (an upstream routes a session to one replica)
    headers: dict[str, str] = field(default_factory=dict)  # to forward (W3C trace context), never the API key
    relay: Relay | None = None  # the client's direct relay of plain tokens (upstream replicas only)
    watch: Callable[[AsyncIterator[TokenEvent]], EventStream] | None = None  # the lane's stall watch over the events
    fallback: FallbackReport | None = None  # set: a stalled stream goes on elsewhere where the backend can
    wanted: Callable[[], bool] = _always  # False once the client has gone (no continuation for nobody)


def _nothing() -> None:
    return None


@dataclass(slots=True)
class Submitted:
    """A submission's events, and ``release`` for what the backend started before they are read (an upstream writes
    the request at once): called when the exchange ends, it gives back whatever was never taken up."""

    events: EventStream
    release: Callable[[], None] = _nothing


@runtime_checkable
class Backend(Protocol):
    """An engine the server can serve from.

    ``submit`` streams ``TokenEvent``s; the last one has ``finished`` set and carries the request's engine-side
    timestamps (``first_scheduled``, ``first_token``). Closing the stream early aborts the request in the engine.
    """

    @property
    def tokenizer(self) -> Tokenizer | None:
        """None: the backend takes text and tokenizes it itself (upstream replicas)."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int:
        """The context window in tokens (0: unknown, the upstream checks its own)."""

    @property
    def error(self) -> BaseException | None:
        """The backend's fatal error, once it has died."""

    def capacity(self) -> int:
        """Sequences it runs at once: the lanes share this (upstreams: the sum over healthy replicas)."""

    def preempts(self) -> bool:
        """Whether a higher-priority arrival starts at once, preempting lower-priority work (so reserved capacity may
        be lent and taken back)."""

    def speculates(self) -> bool:
        """Whether it decodes speculatively (the server may then audit its output)."""

    def unavailable(self) -> str | None:
        """Why no request can be served now (for /ready), or None."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """Raise ``RequestError`` for a request the engine can never serve (too long, bad sampling)."""

    def submit(self, request: Submission) -> Submitted: ...

    def predict_ttft(self, num_prompt_tokens: int, priority: int) -> float | None:
        """Seconds until a request submitted now would get its first token, from the backend's own queue and step
        times; None where it cannot know (upstream replicas keep their queues to themselves)."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...
