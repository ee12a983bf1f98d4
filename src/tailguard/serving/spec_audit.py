"""The speculative decoding consistency audit (L4): did anyone receive different output because of speculation?

A sampled share of the requests that speculated is run again with speculation off, off the request path (in the
background, at the lowest priority, after the answer has gone out), and the token-level edit distance between what the
client received and the reference is recorded: on ``/metrics``, and as an ``audit`` record in the store and the SLO
records (``GET /v1/alerts``, ``tailguard slo``). Greedy decoding must give distance 0: anything else is a bug and
raises a ``spec_inconsistent`` alert. Sampled requests are rerun with the same seed (the audit gives an audited request
a seed when it has none, before it runs); speculation consumes randomness differently, so their distance is a
distribution, reported against the seed's bound of 3.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from rapidfuzz.distance import Levenshtein

from tailguard.backends.base import Submission
from tailguard.engine.sequence import SamplingParams
from tailguard.slo.actions import SLORecord, new_id

if TYPE_CHECKING:
    from tailguard.backends.base import Backend

log = logging.getLogger("tailguard.audit")
AUDIT_PRIORITY = 1_000_000  # below every lane: the audit never takes a step a real request wants
SAMPLED_BOUND = 3  # the seed's bound on the edit distance for sampled output


class SpeculationAudit:
    def __init__(self, share: float, registry: CollectorRegistry, model: str,
                 emit: Callable[[SLORecord], Any], rng: random.Random | None = None, max_pending: int = 4) -> None:
        self.share = share
        self.emit = emit
        self.rng = rng or random.Random()
        self.max_pending = max_pending
        self.pending: set[asyncio.Task] = set()
        self.model = model
        self.distance = Histogram("tailguard_spec_audit_edit_distance",
                                  "Token edit distance between a speculative answer and its rerun without speculation.",
                                  ["model", "sampling"], buckets=(0, 1, 2, 3, 5, 10, 20, 50, 100), registry=registry)
        self.audits = Counter("tailguard_spec_audits", "Speculative requests rerun without speculation, by verdict.",
                              ["model", "sampling", "verdict"], registry=registry)

    def wants(self, sampling: SamplingParams) -> bool:
        """Decide, before the request runs, whether it will be audited (then it needs a seed to be rerun exactly)."""
        if self.share <= 0 or not sampling.speculative or len(self.pending) >= self.max_pending:
            return False
        if self.rng.random() >= self.share:
            return False
        if sampling.temperature > 0 and sampling.seed is None:
            sampling.seed = self.rng.randrange(1 << 31)
        return True

    def submit(self, engine: Backend, request_id: str, prompt: list[int], sampling: SamplingParams,
               received: list[int]) -> None:
        task = asyncio.get_running_loop().create_task(self._run(engine, request_id, prompt, sampling, received))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _run(self, engine: Backend, request_id: str, prompt: list[int], sampling: SamplingParams,
                   received: list[int]) -> None:
        reference: list[int] = []
        plain = replace(sampling, speculative=False, logprobs=None)
        try:
            rerun = Submission(f"{request_id}#audit", chat=False, sampling=plain, prompt_token_ids=prompt,
                               num_prompt_tokens=len(prompt), priority=AUDIT_PRIORITY)
            async for ev in engine.submit(rerun).events:
                if ev.token_id is not None:
                    reference.append(ev.token_id)
        except Exception as exc:  # noqa: BLE001 - an audit that could not run is logged, never raised
            log.warning("speculation audit of %s could not run: %s", request_id, exc)
            return
        self.record(request_id, sampling, received, reference)

    def record(self, request_id: str, sampling: SamplingParams, received: list[int], reference: list[int]) -> int:
        distance = Levenshtein.distance(received, reference)
        greedy = sampling.temperature == 0
        kind = "greedy" if greedy else "sampled"
        ok = distance == 0 if greedy else distance <= SAMPLED_BOUND
        self.distance.labels(self.model, kind).observe(distance)
        self.audits.labels(self.model, kind, "ok" if ok else "mismatch").inc()
        now = time.time()
        figures = {"edit_distance": distance, "received_tokens": len(received), "reference_tokens": len(reference),
                   "bound": 0 if greedy else SAMPLED_BOUND}
        details = {"request_id": request_id, "sampling": kind, "seed": sampling.seed,
                   "temperature": sampling.temperature}
        self.emit(SLORecord(new_id(), "audit", "spec_consistency", "ok" if ok else "mismatch", "all", None, now,
                            now, now, figures, details))
        if greedy and distance:
            log.error("speculative decoding changed a greedy answer (request %s, edit distance %d): a bug",
                      request_id, distance)
            self.emit(SLORecord(new_id(), "alert", "spec_inconsistent", "raised", "all", "red", now, now, None,
                                figures, details))
        return distance
