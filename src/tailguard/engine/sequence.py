"""A request as the engine sees it: its tokens, sampling parameters, progress and monotonic timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request the engine can never serve (too long for the context window, bad parameters)."""


class EngineClosed(RuntimeError):
    """The engine has stopped (shut down or crashed): no request can be served; the message says why."""


class SequenceFailed(RuntimeError):
    """This request alone failed inside the engine (its sampling, stop rules, detokenizing or drafts, or the step it
    was in); the engine and every other request go on. The message says what failed."""


# A temperature below this samples as greedy (vLLM's threshold): dividing logits by it would overflow to inf/NaN.
GREEDY_TEMPERATURE = 1e-5
# A seed is any 64-bit integer, signed or not (OpenAI's range); generators take it folded into [0, 2**64).
SEED_MODULUS = 2**64


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, end-of-turn token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller (client disconnect, timeout)
    ERROR = "error"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return with each token (T3)
    speculative: bool = True  # False opts this request out of speculative decoding (when the engine has it on)

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN fails every comparison
            raise RequestError("temperature must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestError("min_tokens must be between 0 and max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError("logprobs must be between 0 and 20")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def generator_seed(self) -> int | None:
        """The seed as a random generator takes it: a negative seed is folded into [0, 2**64)."""
        return None if self.seed is None else self.seed % SEED_MODULUS


@dataclass
class RequestTimes:
    """Monotonic (time.perf_counter) timestamps taken where things happen; every latency is derived from these."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # lower value = more important (vLLM's convention)
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    stop_string_hit: str | None = None
    # Prompt tokens whose KV came from the prefix cache at the request's first admission (not computed for it).
    num_cached_tokens: int = 0
    # Chained content hashes of its leading full blocks (prefix_cache.py), filled as they are needed.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(arrival=self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not yet computed (the whole prompt at first; prompt + outputs after a preemption)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_decode(self) -> bool:
        return self.num_pending_tokens == 1 and bool(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
