"""Capacity planning from a load forecast: the engine's running-sequence cap, its token budget, replicas.

The model is deliberately small and every input is a measurement:

* ``ServiceProfile``: per-request tokens in and out (from the trace or a bench run) and the engine's measured
  throughput: prefill tokens/s and aggregate decode tokens/s at a few batch sizes (``benchmarks/engine_throughput.py``),
  interpolated in between.
* A request costs the engine ``in / prefill_tps + out / decode_tps(b)`` seconds of engine time when ``b`` sequences
  run together (decode steps are shared by the batch; prefill is not). Utilization at arrival rate ``lambda`` is
  ``lambda`` times that.
* Sequences in service follow Little's law: ``lambda * latency(b)`` where a request's latency at batch ``b`` is
  ``in / prefill_tps + out * b / decode_tps(b)`` (each stream gets one token per step of the batch).
* The cap is the smallest ``b`` within ``[min_seqs, max_seqs]`` that holds the sequences in service with
  ``headroom`` plus ``burst_z`` standard deviations of a Poisson count around them (arrivals within a period are
  bursty: at a mean of 4 in service, 2.33 deviations ask for 5 + 4.7 slots, not 5), and keeps utilization at most
  ``target_utilization``: a smaller cap makes requests wait in the queue
  (too few slots, or too little batched throughput), a larger one slows every stream for nothing.
* The token budget per step holds one decode token per running sequence plus room for prompts: the prompt tokens
  that arrive during one step (with the same headroom), so that prefill keeps up, and at least one typical prompt up
  to the engine's prefill chunk (``prefill_chunk``, the engine's ``--max-prefill-chunk``), so that a prompt is not
  cut finer than the engine would cut it anyway.
* Replicas: the smallest fleet on which each replica's share of the load has such a cap.

All functions are pure: same inputs, same plan.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SEED_MIN_SEQS, SEED_MAX_SEQS = 2, 16  # the required adaptive batch range


@dataclass(frozen=True)
class ServiceProfile:
    mean_input_tokens: float
    mean_output_tokens: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: dict[int, float]  # aggregate decode throughput with b sequences running

    def __post_init__(self) -> None:
        if self.mean_input_tokens < 0 or self.mean_output_tokens <= 0:
            raise ValueError("mean tokens: input must be >= 0 and output > 0")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be > 0")
        if not self.decode_tokens_per_s or any(b < 1 or t <= 0 for b, t in self.decode_tokens_per_s.items()):
            raise ValueError("decode_tokens_per_s needs batch sizes >= 1 with throughput > 0")

    def decode_throughput(self, batch: float) -> float:
        """Aggregate decode tokens/s at ``batch`` sequences: linear between measured points, flat beyond the
        largest (no gain is assumed that was not measured), proportional below the smallest."""
        pts = sorted(self.decode_tokens_per_s.items())
        bs = np.array([b for b, _ in pts], dtype=float)
        ts = np.array([t for _, t in pts], dtype=float)
        # never less throughput with more sequences than with fewer: a measured dip is noise, not a plan
        ts = np.maximum.accumulate(ts)
        if batch <= bs[0]:
            return float(ts[0] * batch / bs[0])
        return float(np.interp(batch, bs, ts))

    def engine_seconds_per_request(self, batch: float) -> float:
        return (self.mean_input_tokens / self.prefill_tokens_per_s
                + self.mean_output_tokens / self.decode_throughput(batch))

    def latency_s(self, batch: float) -> float:
        per_stream = self.decode_throughput(batch) / max(batch, 1.0)
        return self.mean_input_tokens / self.prefill_tokens_per_s + self.mean_output_tokens / per_stream

    @classmethod
    def from_engine_throughput(cls, data: dict | str | Path, mean_input_tokens: float, mean_output_tokens: float,
                               engine: str = "tailguard native") -> ServiceProfile:
        """From ``benchmarks/results/engine_throughput.json``: prefill tokens/s and steady decode tokens/s by batch."""
        d = json.loads(Path(data).read_text(encoding="utf-8")) if not isinstance(data, dict) else data
        try:
            r = d["results"][engine]
            prefill = float(r["prefill_tps"]["median"])
            decode = {int(b): float(v["steady_tps"]["median"]) for b, v in r["aggregate"].items()
                      if v.get("steady_tps", {}).get("median")}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an engine_throughput result with an entry for {engine!r}: {exc}") from exc
        return cls(mean_input_tokens, mean_output_tokens, prefill, decode)


@dataclass(frozen=True)
class CapacityPlan:
    arrivals_per_s: float
    max_num_seqs: int
    max_num_batched_tokens: int
    replicas: int
    sequences_in_service: float  # Little's law at the chosen cap, whole fleet
    utilization: float  # engine-time share per replica at the chosen cap
    saturated: bool  # even the widest cap on the planned replicas cannot keep up
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"arrivals_per_s": float(self.arrivals_per_s), "max_num_seqs": int(self.max_num_seqs),
                "max_num_batched_tokens": int(self.max_num_batched_tokens), "replicas": int(self.replicas),
                "sequences_in_service": float(self.sequences_in_service), "utilization": float(self.utilization),
                "saturated": bool(self.saturated), "notes": list(self.notes)}


def _round_up(x: float, step: int) -> int:
    return int(math.ceil(x / step) * step)


def plan_capacity(arrivals_per_s: float, profile: ServiceProfile, *, min_seqs: int = SEED_MIN_SEQS,
                  max_seqs: int = SEED_MAX_SEQS, headroom: float = 1.25, target_utilization: float = 0.8,
                  min_token_budget: int = 64, max_token_budget: int = 8192, prefill_chunk: int = 256,
                  burst_z: float = 2.33, kv_cache_tokens: int | None = None,
                  replicas: int | None = None) -> CapacityPlan:
    """The cap, token budget and replica count for an expected arrival rate; see the module docstring.

    ``replicas``: a fixed fleet (the cap is then planned for each replica's share); None sizes the fleet.
    ``prefill_chunk``: the engine's largest prefill piece per step (``--max-prefill-chunk``).
    ``kv_cache_tokens``: the KV cache's capacity (logged at the engine's start-up); the cap never exceeds the
    typical sequences (input + output tokens) it holds, since admitting more only preempts.
    """
    if not math.isfinite(arrivals_per_s) or arrivals_per_s < 0:
        raise ValueError("arrivals_per_s must be a finite number >= 0")
    if not 1 <= min_seqs <= max_seqs:
        raise ValueError("need 1 <= min_seqs <= max_seqs")
    if headroom < 1 or not 0 < target_utilization <= 1:
        raise ValueError("need headroom >= 1 and 0 < target_utilization <= 1")
    notes: list[str] = []
    lam = arrivals_per_s
    if kv_cache_tokens is not None:
        held = int(kv_cache_tokens // max(1.0, profile.mean_input_tokens + profile.mean_output_tokens))
        if held < max_seqs:
            max_seqs = max(min_seqs, held)
            notes.append(f"the KV cache holds {held} typical sequences: memory bounds the cap at {max_seqs} "
                         "(a smaller KV entry, int8 or prefix sharing, would lift it)")

    def smallest_cap(rate: float) -> int | None:
        for b in range(min_seqs, max_seqs + 1):
            in_service = rate * profile.latency_s(b)
            # sequences in service fluctuate like a Poisson count around their mean: hold its upper quantile
            holds = b >= headroom * in_service + burst_z * math.sqrt(in_service)
            keeps_up = rate * profile.engine_seconds_per_request(b) <= target_utilization
            if holds and keeps_up:
                return b
        return None

    if replicas is None:  # the smallest fleet on which some cap within the range holds the load
        replicas = 1
        while smallest_cap(lam / replicas) is None and replicas < 100_000:
            replicas += 1
    elif replicas < 1:
        raise ValueError("replicas must be >= 1")
    per_replica = lam / replicas
    found = smallest_cap(per_replica)
    cap = found if found is not None else throughput_cap(profile, min_seqs, max_seqs)
    if found is None:
        notes.append(f"{per_replica:.3g} req/s per replica needs more than {max_seqs} running sequences or more "
                     f"than {target_utilization:.0%} of the engine: requests queue whatever the cap, which is set "
                     f"where the engine's request throughput is within {OVERLOAD_THROUGHPUT_SLACK:.0%} of its best "
                     f"({cap}): a wider batch would slow every running request for little more throughput")
    utilization = per_replica * profile.engine_seconds_per_request(cap)
    saturated = utilization >= 1.0
    if saturated:
        notes.append(f"utilization {utilization:.2f} >= 1 on {replicas} replica(s): the queue grows without bound")
    step_s = cap / profile.decode_throughput(cap)  # one decode step of the whole batch
    prompt_tokens_per_step = per_replica * profile.mean_input_tokens * step_s
    # keep up with arriving prompt tokens, and never take a typical prompt in more pieces than the prefill chunk cuts
    prefill_room = max(headroom * prompt_tokens_per_step, min(profile.mean_input_tokens, prefill_chunk))
    budget = _round_up(cap + prefill_room, 16)
    budget = int(min(max_token_budget, max(min_token_budget, budget)))
    return CapacityPlan(float(lam), cap, budget, replicas, float(lam * profile.latency_s(cap)), float(utilization),
                        bool(saturated), notes)


def plan_ahead(forecast_counts: Sequence[float], period_s: float, profile: ServiceProfile, **kw) -> CapacityPlan:
    """Plan for the busiest forecast period of the horizon: set ahead of load, a cap must hold its peak."""
    if period_s <= 0:
        raise ValueError("period_s must be > 0")
    counts = np.asarray(forecast_counts, dtype=float)
    if counts.size == 0:
        raise ValueError("empty forecast")
    return plan_capacity(float(counts.max()) / period_s, profile, **kw)


# Overloaded (no cap keeps up): the cap is the smallest whose request throughput is within this share of the best.
OVERLOAD_THROUGHPUT_SLACK = 0.05


def throughput_cap(profile: ServiceProfile, min_seqs: int = SEED_MIN_SEQS, max_seqs: int = SEED_MAX_SEQS,
                   slack: float = OVERLOAD_THROUGHPUT_SLACK) -> int:
    """The smallest cap in ``[min_seqs, max_seqs]`` whose engine time per request is within ``slack`` of the best
    in the range. Under overload the queue grows whatever the cap; beyond this cap a wider batch buys little more
    throughput (prompt-heavy requests are mostly prefill, which batching does not share) and slows every running
    request, so the tail grows (benchmarks/forecast_cap.py: the widest cap lost to static 4-8 on the conv replay)."""
    costs = {b: profile.engine_seconds_per_request(b) for b in range(min_seqs, max_seqs + 1)}
    best = min(costs.values())
    return min(b for b, c in costs.items() if c <= (1 + slack) * best)


def widest_useful_cap(profile: ServiceProfile, min_gain: float = 0.05, limit: int = 256) -> int:
    """The largest measured batch size that still bought ``min_gain`` more decode throughput than the previous one:
    the upper bound of the cap where the default 16 is narrower than what this engine measured useful."""
    pts = sorted(profile.decode_tokens_per_s.items())
    best = pts[0][0]
    for (_, t0), (b1, t1) in zip(pts, pts[1:]):
        if b1 > limit or t1 < t0 * (1 + min_gain):
            break
        best = b1
    return best
