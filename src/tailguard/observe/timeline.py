"""One request's timeline: monotonic timestamps taken where things happen, and every latency derived from them.

Boundaries, in order: received -> tokenized -> scheduled -> first token -> last token -> last byte. The five stages
(tokenize, queue, prefill, decode, stream) are the gaps between consecutive boundaries, so they add up to E2E
exactly. A boundary that never happened (a rejected or aborted request) takes the value of the next one that did:
its interval is charged to the stage the request was in when it ended. docs/metrics.md has the definitions.

All times are ``time.perf_counter()`` of this process (the engine's timestamps come from the same clock); the wall
clock is read once, at arrival, only to date the record.

The figures are on the server's clock, which stops while the answer waits for the client to read (``client_waits``:
the transport's flow control held a write): a slow reader's own slowness is not the server's latency. The record's
timestamps stay as they happened.
"""

from __future__ import annotations

import enum
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STAGES = ("tokenize", "queue", "prefill", "decode", "stream")


class Outcome(enum.StrEnum):
    SUCCESS = "success"  # a complete answer (finish reason stop or length)
    INVALID = "invalid"  # the client's request was wrong (4xx other than 429)
    REJECTED = "rejected"  # admission said no: queue full (429) or not ready (503)
    ABORTED = "aborted"  # the client went away before the answer was complete
    ERROR = "error"  # our fault (5xx)


@dataclass
class Summary:
    """Latencies derived once from a finished timeline (seconds)."""

    e2e: float
    stages: dict[str, float]
    ttft: float | None
    tpot: float | None
    itl: list[float]


@dataclass
class Timeline:
    request_id: str
    endpoint: str
    received: float = field(default_factory=time.perf_counter)
    received_unix: float = field(default_factory=time.time)
    model: str = ""
    user: str | None = None
    owner: str | None = None  # hash of the client key that made the request (who may read its record); never the key
    business_type: str = "default"
    # Traffic slices for the SLO monitor's alerts and views: from the X-Lane, X-Client and X-Region headers.
    lane: str = "default"
    client: str = "default"
    region: str = "default"
    stream: bool = False
    # Boundaries (perf_counter seconds); None until they happen.
    tokenized: float | None = None
    queued: float | None = None  # handed to the engine (inside the queue stage)
    scheduled: float | None = None  # engine: first scheduled
    first_token: float | None = None  # engine: first token produced
    last_token: float | None = None  # engine: last token produced
    last_byte: float | None = None  # server: last byte of the response handed to the transport
    token_times: list[float] = field(default_factory=list)  # engine production time of each token
    token_sent: list[float] = field(default_factory=list)  # time each token was handed to the transport (streaming)
    status: int = 200
    outcome: Outcome | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    sampling: dict[str, Any] | None = None
    resources: dict[str, Any] | None = None
    # What the SLO monitor did to this request (every refusal and degraded answer is on record): None, or
    # {"action": "shed" | "degrade", "mode": ..., "tier": ..., "action_id": ...}.
    slo_action: dict[str, Any] | None = None
    # True for an answer the engine never produced (a degradation template): not a latency sample.
    synthetic: bool = False
    # A stream the server ended without [DONE] (an upstream or the engine failed mid-answer, a drain cut it) while
    # the client was still there: the stream interruption rate's numerator.
    interrupted: bool = False
    # The gateway's part (tenant, lane wait, replica, attempts, stalls, an ignored lane claim); None without one.
    gateway: dict[str, Any] | None = None
    # Speculative decoding (the engine's counts for this request): guesses verified, and accepted.
    spec_proposed: int = 0
    spec_accepted: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served (not computed again)
    # Seconds from the request's head to its body's last byte: the client's sending time, outside every stage.
    upload: float = 0.0
    # When a write of the answer waited for the client to read (the transport's flow control held it): start, end,
    # start, end... (perf_counter). The server's clock stops there (``summary``); usually empty.
    client_waits: list[float] = field(default_factory=list)
    # An upstream's usage as it reported it (token details included): the answer's usage, passed on unchanged.
    upstream_usage: dict[str, Any] | None = None
    # Sampled internals: per-layer step timings and activation statistics, for a sampled share of requests.
    internals: dict[str, Any] | None = None
    # The client connection's quality while the answer was written (RTT, retransmits, send backlog: the kernel's
    # TCP_INFO, sampled by serving/network.py); None off Linux, without uvicorn, or with sampling off.
    network: dict[str, Any] | None = None
    # Text audit (input provenance, output and candidates); filled only when text storage is on, redacted by the
    # store before it is written.
    prompt_text: str | None = None
    output_text: str | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[dict] | None = None
    # With a sealing key: makes the sealed rebuild payload (token ids, sampling, seed; observe/sealing.py), called by
    # the store on its writer thread so that the encryption costs the request path nothing.
    sealed: Callable[[], str] | None = field(default=None, repr=False)
    _summary: Summary | None = field(default=None, repr=False)
    _finalized: bool = field(default=False, repr=False)

    # --- recording ------------------------------------------------------------------------------------------------
    def body_arrived(self, at: float) -> None:
        """The whole body is in: the request's clock starts here, as vLLM's does when the engine gets the request.
        A slow upload is the client's time (kept in ``upload``), not the server's TTFT, tokenize stage or E2E: four
        slow clients would otherwise redden the SLO tier for everyone."""
        self.upload = max(0.0, at - self.received)
        self.received_unix += self.upload
        self.received = at

    def client_waited(self, start: float, end: float) -> None:
        """A write waited from ``start`` to ``end`` for the client to read what was written before."""
        if end > start:
            self.client_waits += (start, end)
            self._summary = None

    @property
    def client_wait(self) -> float:
        """Seconds the answer's writes waited for the client to read, in all."""
        w = self.client_waits
        return sum(w[1::2]) - sum(w[0::2])

    def add_tokens_sent(self, count: int, at: float) -> None:
        """``count`` tokens left the server in one chunk at ``at`` (k tokens in a chunk give k-1 zero gaps)."""
        self.token_sent.extend([at] * count)

    def finalize(self, status: int, outcome: Outcome, at: float | None = None) -> bool:
        """Close the timeline once; returns False if it was already closed (so a record is emitted exactly once)."""
        if self._finalized:
            return False
        self._finalized = True
        self.status = status
        self.outcome = outcome
        self.last_byte = at if at is not None else time.perf_counter()
        self.num_output_tokens = max(self.num_output_tokens, len(self.token_times))
        self._summary = None
        return True

    @property
    def finalized(self) -> bool:
        return self._finalized

    @property
    def degraded(self) -> bool:
        return self.slo_action is not None and self.slo_action.get("action") == "degrade"

    # --- derived --------------------------------------------------------------------------------------------------
    def boundaries(self) -> list[float]:
        """received, tokenized, scheduled, first token, last token, last byte, as they happened: monotone, missing
        ones filled. Without client waits these are the figures' boundaries too (``summary``)."""
        end = self.last_byte if self.last_byte is not None else time.perf_counter()
        return _filled(self.received, [self.tokenized, self.scheduled, self.first_token, self.last_token], end)

    def summary(self) -> Summary:
        if self._summary is not None and self._finalized:
            return self._summary
        end = self.last_byte if self.last_byte is not None else time.perf_counter()
        raw = [self.tokenized, self.scheduled, self.first_token, self.last_token]
        # Tokens "leave" when streamed; a non-streamed answer has no per-token departure, so, as vLLM does, its
        # TTFT and ITL are taken where the server receives each token from the engine.
        times = self.token_sent if self.stream and self.token_sent else self.token_times
        if self.client_waits:
            raw, times, end = self._server_clock(raw, times, end)
        b = _filled(self.received, raw, end)
        stages = {name: b[i + 1] - b[i] for i, name in enumerate(STAGES)}
        e2e = b[-1] - b[0]
        ttft = times[0] - self.received if times else None
        itl = [b2 - a for a, b2 in zip(times, times[1:])]
        n = self.num_output_tokens
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None
        s = Summary(e2e=e2e, stages=stages, ttft=ttft, tpot=tpot, itl=itl)
        if self._finalized:
            self._summary = s
        return s

    def _server_clock(self, raw: list[float | None], times: list[float],
                      end: float) -> tuple[list[float | None], list[float], float]:
        """The boundaries, the token departures and the end on the server's clock, which stops while a write waits
        for the client (docs/metrics.md, "A slow reader's time is its own").

        A wait stops the clock for what the server sends (``sent``: every wait before the instant). What the engine
        produces is held back by a wait only once it stops producing during it (a lazy producer, or an upstream
        whose reading the gateway paused behind the client; an engine that queues its tokens keeps producing), so
        its clock (``made``) stops only from the last token produced in a wait to the wait's end. A token leaves at
        the later of its departure on the first clock and its production on the second: where the engine kept
        producing, the tokens a wait held back count as leaving when they were produced, not all at once after it."""
        made_at = self.token_times
        pairs = sorted(zip(self.client_waits[0::2], self.client_waits[1::2]))
        held: list[tuple[float, float]] = []
        for a, b in pairs:  # the waits never overlap (one writer), but a merge costs nothing and makes sure
            if held and a <= held[-1][1]:
                held[-1] = (held[-1][0], max(held[-1][1], b))
            else:
                held.append((a, b))
        idle = []
        for a, b in held:
            i = bisect_left(made_at, b)
            last = made_at[i - 1] if i and made_at[i - 1] >= a else a
            if b > last:
                idle.append((last, b))
        sent, made = _stopped(held), _stopped(idle)
        out_raw = [None if t is None else made(t) for t in raw]
        if times is made_at:  # not streamed: the tokens' own times
            out_times = [made(t) for t in times]
        else:
            out_times = []
            prev = float("-inf")
            for k, t in enumerate(times):
                d = sent(t)
                if k < len(made_at):
                    d = max(d, made(made_at[k]))
                prev = max(prev, d)
                out_times.append(prev)
        last = max(sent(end), out_times[-1] if out_times else end, out_raw[-1] if out_raw[-1] is not None else end)
        return out_raw, out_times, min(last, end)

    def server_timing(self) -> str:
        """W3C Server-Timing header value (milliseconds)."""
        s = self.summary()
        parts = [f"{name};dur={s.stages[name] * 1e3:.3f}" for name in STAGES]
        if s.ttft is not None:
            parts.append(f"ttft;dur={s.ttft * 1e3:.3f}")
        parts.append(f"total;dur={s.e2e * 1e3:.3f}")
        if self.spec_proposed:
            parts.append(f'spec;desc="proposed={self.spec_proposed} accepted={self.spec_accepted}"')
        if self.internals is not None:  # only the flag: the figures are in the record (GET /v1/requests/{id})
            parts.append("internals")
        return ", ".join(parts)

    def stage_object(self) -> dict[str, Any]:
        """The ``tailguard`` object of the final SSE chunk: stage times so far, in seconds."""
        s = self.summary()
        return {
            "request_id": self.request_id,
            "stages": {k: round(v, 6) for k, v in s.stages.items()},
            "e2e": round(s.e2e, 6),
            "ttft": None if s.ttft is None else round(s.ttft, 6),
            "tpot": None if s.tpot is None else round(s.tpot, 6),
            "queue_wait": round(s.stages["queue"], 6),
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            **({"degraded": self.slo_action} if self.degraded else {}),
        }

    def to_record(self) -> dict[str, Any]:
        """The full record: what the store keeps and ``GET /v1/requests/{id}`` returns (times in seconds)."""
        s = self.summary()
        r0 = self.received

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - r0, 6)

        return {
            "request_id": self.request_id,
            "received_at": self.received_unix,
            "endpoint": self.endpoint,
            "model": self.model,
            "user": self.user,
            "owner": self.owner,
            "business_type": self.business_type,
            "lane": self.lane,
            "client": self.client,
            "region": self.region,
            "stream": self.stream,
            "status": self.status,
            "outcome": self.outcome.value if self.outcome else None,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "prompt_tokens": self.num_prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "preemptions": self.num_preemptions,
            "upload": round(self.upload, 6),
            # Seconds the answer waited for the client to read (on no figure's clock), and when (relative).
            **({"client_wait": round(self.client_wait, 6),
                "client_waits": [[round(a - r0, 6), round(b - r0, 6)]
                                 for a, b in zip(self.client_waits[0::2], self.client_waits[1::2])]}
               if self.client_waits else {}),
            "e2e": s.e2e,
            "ttft": s.ttft,
            "tpot": s.tpot,
            "stages": dict(s.stages),
            "timestamps": {
                # perf_counter (CLOCK_MONOTONIC on Linux, shared by every process of the machine) at arrival: lets a
                # client on the same host join its own timestamps with this record.
                "received_monotonic": r0,
                "received": 0.0,
                "tokenized": rel(self.tokenized),
                "queued": rel(self.queued),
                "scheduled": rel(self.scheduled),
                "first_token": rel(self.first_token),
                "last_token": rel(self.last_token),
                "first_sent": rel(self.token_sent[0]) if self.token_sent else None,
                "last_byte": rel(self.last_byte),
            },
            "token_times": [round(t - r0, 6) for t in self.token_times],
            "token_sent": [round(t - r0, 6) for t in self.token_sent],
            "sampling": self.sampling,
            "resources": self.resources,
            "degraded": self.degraded,
            "slo_action": self.slo_action,
            **({"gateway": self.gateway} if self.gateway else {}),
            **({"interrupted": True} if self.interrupted else {}),
            **({"speculation": {"proposed": self.spec_proposed, "accepted": self.spec_accepted}}
               if self.spec_proposed else {}),
            **({"internals": self.internals} if self.internals is not None else {}),
            **({"network": self.network} if self.network else {}),
        }


def _filled(received: float, raw: list[float | None], end: float) -> list[float]:
    """The six boundaries, monotone: a missing one takes the next that happened (its interval is charged to the
    stage the request was in)."""
    out = [received]
    for i, t in enumerate(raw):
        if t is None:
            t = next((u for u in raw[i + 1 :] if u is not None), end)
        out.append(min(max(t, out[-1]), end))
    out.append(max(end, out[-1]))
    return out


def _stopped(spans: list[tuple[float, float]]) -> Callable[[float], float]:
    """A clock that stops during ``spans`` (sorted, disjoint): an instant, less the part of the spans before it."""
    starts = [a for a, _ in spans]
    before = [0.0]
    for a, b in spans:
        before.append(before[-1] + b - a)

    def at(t: float) -> float:
        i = bisect_right(starts, t)
        if not i:
            return t
        a, b = spans[i - 1]
        return t - before[i - 1] - (min(t, b) - a)

    return at
