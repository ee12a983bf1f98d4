"""A step-level model of a continuous-batching engine, to compare cap policies on a trace before a real replay.

This is a *model*, not a measurement: each step's time comes from the engine's measured throughput curve
(``ServiceProfile``: ``b / decode_tps(b)`` for ``b`` decoding sequences plus ``prefill tokens / prefill_tps``), and
the scheduling follows tailguard's scheduler in outline: first come first served, at most ``cap`` running sequences,
a per-step token budget with one token per decoding sequence first and prompt chunks of at most ``prefill_chunk`` in
the rest; the step that finishes a prompt yields its first token. KV memory is not modelled (no preemption).

It answers one question cheaply: on this trace and this throughput curve, can a cap set ahead of load by a forecast
beat the best static cap? The real replay (``tailguard bench --trace``) is what settles it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tailguard.plan.capacity import CapacityPlan, ServiceProfile


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int


@dataclass
class SimResult:
    policy: str
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    caps: list[tuple[float, int]]  # (time, cap) at each change
    duration_s: float

    def summary(self) -> dict:
        def pct(a: np.ndarray, q: float) -> float | None:
            return float(np.percentile(a, q)) if a.size else None

        return {"policy": self.policy, "requests": int(self.e2e_s.size),
                "e2e_p50_s": pct(self.e2e_s, 50), "e2e_p99_s": pct(self.e2e_s, 99),
                "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p99_s": pct(self.ttft_s, 99),
                "cap_changes": max(0, len(self.caps) - 1),
                "cap_range": [min(c for _, c in self.caps), max(c for _, c in self.caps)] if self.caps else None}


class _Seq:
    __slots__ = ("req", "pending", "generated", "first_token_s")

    def __init__(self, req: SimRequest) -> None:
        self.req, self.pending, self.generated, self.first_token_s = req, req.input_tokens, 0, None


def simulate(requests: Sequence[SimRequest], profile: ServiceProfile, *, cap: int = 16, token_budget: int = 512,
             prefill_chunk: int = 256, policy: str | None = None,
             controller: object | None = None, tick_s: float = 1.0) -> SimResult:
    """Run the trace through the model. ``controller``: a ``ForecastCapController`` whose ``apply`` this function
    replaces to set the cap (the token budget stays fixed, so that only the cap differs between policies)."""
    if cap < 1 or token_budget < cap or prefill_chunk < 1:
        raise ValueError("need cap >= 1, token_budget >= cap and prefill_chunk >= 1")
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    state = {"cap": cap}
    caps = [(reqs[0].arrival_s if reqs else 0.0, cap)]

    def apply(plan: CapacityPlan) -> None:
        if plan.max_num_seqs != state["cap"]:
            state["cap"] = min(plan.max_num_seqs, token_budget)
            caps.append((t, state["cap"]))

    if controller is not None:
        controller.apply = apply  # type: ignore[attr-defined]
    waiting: deque[_Seq] = deque()
    running: list[_Seq] = []
    ttft, e2e = [], []
    t = reqs[0].arrival_s if reqs else 0.0
    nxt = 0
    next_tick = t + tick_s
    while nxt < len(reqs) or waiting or running:
        if not waiting and not running and nxt < len(reqs) and reqs[nxt].arrival_s > t:
            t = reqs[nxt].arrival_s  # idle until the next arrival
        while nxt < len(reqs) and reqs[nxt].arrival_s <= t:
            waiting.append(_Seq(reqs[nxt]))
            if controller is not None:
                controller.record_arrival(reqs[nxt].arrival_s)  # type: ignore[attr-defined]
            nxt += 1
        if controller is not None and t >= next_tick:
            controller.advance(t)  # type: ignore[attr-defined]
            next_tick = t + tick_s
        while waiting and len(running) < state["cap"]:
            running.append(waiting.popleft())
        if not running:
            continue
        budget = token_budget
        decoding = [s for s in running if s.pending == 0]
        budget -= len(decoding)
        prefill: list[tuple[_Seq, int]] = []
        for s in running:
            if s.pending and budget > 0:
                n = min(s.pending, budget, prefill_chunk)
                prefill.append((s, n))
                budget -= n
        d = len(decoding)
        p = sum(n for _, n in prefill)
        t += (d / profile.decode_throughput(d) if d else 0.0) + p / profile.prefill_tokens_per_s
        for s in decoding:
            s.generated += 1
        for s, n in prefill:
            s.pending -= n
            if s.pending == 0:  # the last prompt chunk's logits give the first token
                s.generated += 1
                s.first_token_s = t
        done = [s for s in running if s.generated >= s.req.output_tokens]
        for s in done:
            ttft.append((s.first_token_s if s.first_token_s is not None else t) - s.req.arrival_s)
            e2e.append(t - s.req.arrival_s)
        if done:
            running = [s for s in running if s.generated < s.req.output_tokens]
    name = policy or (f"static cap {cap}" if controller is None else "forecast-driven cap")
    start = reqs[0].arrival_s if reqs else 0.0
    return SimResult(name, np.asarray(ttft), np.asarray(e2e), caps, t - start)


def trace_requests(times_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray, *,
                   speedup: float = 1.0, length_scale: float = 1.0, max_input: int | None = None,
                   limit_s: float | None = None) -> list[SimRequest]:
    """Trace rows as simulation requests, time divided by ``speedup`` and lengths multiplied by ``length_scale``."""
    if speedup <= 0 or length_scale <= 0:
        raise ValueError("speedup and length_scale must be > 0")
    out = []
    for ts, i, o in zip(times_s, input_tokens, output_tokens):
        at = float(ts) / speedup
        if limit_s is not None and at > limit_s:
            break
        n_in = max(1, round(float(i) * length_scale))
        if max_input is not None:
            n_in = min(n_in, max_input)
        out.append(SimRequest(at, n_in, max(1, round(float(o) * length_scale))))
    return out


def compare_caps(requests: Sequence[SimRequest], profile: ServiceProfile, static_caps: Sequence[int],
                 controller_factory: Callable[[], object], **kw) -> list[dict]:
    """Static caps and the forecast-driven one on the same requests; summaries, in that order."""
    rows = [simulate(requests, profile, cap=c, **kw).summary() for c in static_caps]
    rows.append(simulate(requests, profile, cap=min(static_caps), controller=controller_factory(), **kw).summary())
    return rows
