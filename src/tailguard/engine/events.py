"""What the engine hands out, as plain data: one request's token events and the engine's counters.

Torch-free on purpose: the gateway (``tailguard.backends.upstream``) relays an upstream's tokens as these events and must not
import the tensor code that ``tailguard.engine.engine`` pulls in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailguard.engine.sequence import FinishReason


@dataclass
class TokenEvent:
    """One step's output for one request: zero or one new token and the text it completes."""

    request_id: str
    token_id: int | None
    text: str
    time: float
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    request_failed: bool = False  # the error is this request's alone: the engine goes on serving the others
    # Filled on the final event.
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    arrival: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    num_preemptions: int = 0
    num_spec_proposed: int = 0  # speculative guesses verified for this request
    num_spec_accepted: int = 0  # of which the target accepted (its output is the same either way)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed) at first admission
    internals: dict | None = None  # sampled internals: per-layer step timings and statistics; None if unsampled
    # An upstream's own fields of this chunk, passed on as it wrote them: ``delta`` (a chat delta's keys other than
    # role and content: tool_calls, reasoning_content, ...) and ``logprobs``. None for the embedded engine.
    passthrough: dict[str, Any] | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    num_preemptions: int
    steps: int
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    num_spec_steps: int = 0  # verifications (one per speculating sequence and step)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache (at every admission, re-admissions too)
    prefix_cache_hits: int = 0  # of which found cached: hit rate = hits / queries
    kv_blocks_cached: int = 0  # blocks holding reusable cached content (referenced or not)
