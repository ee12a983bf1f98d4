"""A request as the engine sees it: its tokens, sampling parameters, progress and monotonic timestamps."""

from __future__ import annotations

import enum
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tailguard.engine.sampling import LogitsState
    from tailguard.engine.structured import StructuredOutput


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
# OpenAI's ranges: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


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
    # OpenAI's penalties over the tokens generated so far: logits[t] -= presence * (count[t] > 0) + frequency * count[t]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's: over prompt and output tokens, a positive logit is divided by it and a negative one multiplied (1 = off)
    repetition_penalty: float = 1.0
    # token id -> bias in [-100, 100], added to that token's logit
    logit_bias: dict[int, float] | None = None
    # The output held to a JSON schema, any JSON object, a regex or a grammar (engine/structured.py)
    structured: StructuredOutput | None = None

    @property
    def transforms_logits(self) -> bool:
        """Anything beyond temperature/top-k/top-p touches this request's logits (penalties, a bias, a grammar): such
        a request gets a LogitsState at admission, and never speculates."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.structured is not None)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise RequestError for a parameter out of range; ``vocab_size``: logit_bias ids are checked against it."""
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -MAX_PENALTY <= float(value) <= MAX_PENALTY:
                raise RequestError(f"{name} must be a number between -2 and 2")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, numbers.Real) or not 0 < float(rp) < math.inf:
            raise RequestError("repetition_penalty must be a finite number > 0")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise RequestError("logit_bias must map token ids to biases")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                    raise RequestError(f"logit_bias keys must be token ids (integers), not {token!r}")
                if token < 0 or (vocab_size is not None and token >= vocab_size):
                    top = "" if vocab_size is None else f" (0..{vocab_size - 1})"
                    raise RequestError(f"logit_bias token id {token} is outside the vocabulary{top}")
                if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or \
                        not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise RequestError(f"logit_bias values must be numbers between -100 and 100 (token {token})")
        if self.structured is not None:
            validate_structured = getattr(self.structured, "validate", None)
            if validate_structured is None:
                raise RequestError("structured must be a StructuredOutput")
            validate_structured()

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
    # Penalties, logit bias and grammar matcher (sampling.py), set at admission only for a request that has any of
    # them: None is the whole per-step cost for every other request.
    logits_state: LogitsState | None = field(default=None, repr=False)
    # When its prefill's last chunk was computed (the scheduler's clock, at the step's end; None: never): a long
    # prompt part-way through its prefill that progresses is not overdue (SchedulerConfig.prompt_wait_guard_s).
    prefill_progress_at: float | None = field(default=None, repr=False)

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
