"""The one interface the server talks to: the embedded ``AsyncLLMEngine`` and the scripted ``FakeEngine`` both fit.

Typed structurally (``typing.Protocol``): anything with these members can serve, and a type checker says so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tailguard.serving.config import ServerConfig

if TYPE_CHECKING:
    from tailguard.engine.engine import EngineStats, TokenEvent
    from tailguard.engine.request import SamplingParams


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


@runtime_checkable
class Backend(Protocol):
    """An engine the server can serve from.

    ``generate`` streams ``TokenEvent``s; the last one has ``finished`` set and carries the request's engine-side
    timestamps (``first_scheduled``, ``first_token``). Closing the stream early aborts the request in the engine.
    """

    tokenizer: Tokenizer | None  # None: the backend takes text (an upstream gateway), not token ids
    model_name: str
    max_model_len: int

    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        """Raise ``RequestError`` for a request the engine can never serve (too long, bad sampling)."""

    def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str, priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncIterator[TokenEvent]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...


def backend_capacity(backend: Any) -> int:
    """Sequences the backend runs at once: the gateway's lanes share this (upstreams: the sum over healthy ones)."""
    pool = getattr(backend, "pool", None)
    if pool is not None:
        return pool.capacity
    inner = getattr(backend, "engine", None)  # AsyncLLMEngine -> LLMEngine
    sched = getattr(inner, "scheduler", None)
    if sched is not None:
        return sched.config.max_num_seqs
    timing = getattr(backend, "timing", None)  # the fake engine
    return getattr(timing, "max_num_seqs", 64)


def build_backend(config: ServerConfig, engine_args: Any | None = None) -> Backend:
    """Load the engine named by ``config.model`` (slow for a real model: call it off the event loop)."""
    if config.upstreams:
        from tailguard.gateway.proxy import UpstreamBackend
        from tailguard.gateway.upstream import UpstreamPool

        name = config.served_model_names[0] if config.served_model_names else None
        return UpstreamBackend(UpstreamPool(config.upstreams, config.routing), model_name=name)  # type: ignore
    if config.model == "fake":
        from tailguard.engine.fake import FakeEngine, FakeTiming

        f = config.fake
        timing = FakeTiming(ttft=f.ttft, itl=f.itl, jitter=f.jitter, prefill_per_token=f.prefill_per_token,
                            max_num_seqs=f.max_num_seqs, output_text=f.output_text)
        return FakeEngine(timing, max_model_len=f.max_model_len, model_name="fake")
    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs

    if engine_args is None:
        engine_args = EngineArgs(model=config.model)
    for key, value in config.engine.items():
        if not hasattr(engine_args, key):
            raise ValueError(f"unknown engine setting {key!r} in the config file")
        setattr(engine_args, key, value)
    engine_args.model = config.model
    return AsyncLLMEngine.from_args(engine_args)
