"""The embedded engine as a backend: ``AsyncLLMEngine`` (the real model) or ``FakeEngine`` (scripted timings), both
in this process, both taking token ids. Capacity is the scheduler's running-sequence limit; a higher-priority
arrival preempts at once, so reserved capacity may be lent to other lanes."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from tailguard.backends.base import Backend, Submission, Submitted, Tokenizer
from tailguard.engine.events import EngineStats, TokenEvent
from tailguard.engine.sequence import SamplingParams


class LocalEngine(Protocol):
    """What ``LocalBackend`` needs of an engine in this process (``AsyncLLMEngine`` and ``FakeEngine`` have it)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def speculates(self) -> bool: ...

    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None: ...

    def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str, priority: int = 0,
                 arrival_time: float | None = None) -> AsyncGenerator[TokenEvent, None]: ...

    def abort(self, request_id: str) -> None: ...

    def predict_ttft(self, num_prompt_tokens: int, priority: int = 0) -> float: ...

    def protect_priority(self, max_background_seqs: int, protected_priority: int) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...


class LocalBackend:
    """An engine in this process behind the ``Backend`` protocol (``engine``: the engine itself)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    def capacity(self) -> int:
        return self.engine.max_num_seqs

    def preempts(self) -> bool:
        return True

    def speculates(self) -> bool:
        return self.engine.speculates

    def unavailable(self) -> str | None:
        return None

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        self.engine.check_request(num_prompt_tokens, sampling)

    def submit(self, request: Submission) -> Submitted:
        events = self.engine.generate(request.prompt_token_ids, request.sampling, request.request_id,
                                      priority=request.priority, arrival_time=request.arrival_time)
        if request.watch is not None:  # one engine: a stall has nowhere else to go, whatever the lane says
            events = request.watch(events)
        return Submitted(events)

    def predict_ttft(self, num_prompt_tokens: int, priority: int) -> float | None:
        return self.engine.predict_ttft(num_prompt_tokens, priority)

    def protect_priority(self, max_background_seqs: int, protected_priority: int) -> None:
        self.engine.protect_priority(max_background_seqs, protected_priority)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()


def as_backend(engine: Backend | LocalEngine) -> Backend:
    """A backend as it is; an engine of this process behind ``LocalBackend``."""
    if isinstance(engine, Backend):
        return engine
    return LocalBackend(engine)
