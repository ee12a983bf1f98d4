"""What a step will cost, in seconds, from its shape: the scheduler's model for a step budget in time (plain Python).

A step's time on a CPU is close to linear in a few counts: a fixed part (the call, the LM head of the rows that
sample), the decode rows, the keys those rows attend to, the prompt tokens of prefill chunks, and the keys those
tokens attend to (causal attention over the chunk and what came before it). The model keeps one coefficient per
count and fits them to the last few hundred steps the engine timed (``StepCostModel``), starting from a few steps
timed at start-up (``LLMEngine.calibrate``), so it follows the machine as it is now (a neighbour taking a core, a
thermal limit) rather than as it was measured once.

The scheduler asks it two questions: how many prompt tokens fit in a step beside these decodes without the step
passing the decoding streams' inter-token budget (stall-free batching, as in Sarathi-Serve), and when a prompt
arriving now would get its first token (``Scheduler.predict_ttft``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

FEATURES = ("fixed", "decode_rows", "decode_kilokeys", "prefill_tokens", "prefill_kilokeys")


@dataclass(frozen=True)
class StepShape:
    """The counts a step's time depends on."""

    decode_rows: int = 0
    decode_keys: int = 0  # keys the decode rows attend to, summed over rows
    prefill_tokens: int = 0
    prefill_keys: int = 0  # keys the prefill rows attend to, summed over rows (causal: grows with position)

    def features(self) -> list[float]:
        return [1.0, float(self.decode_rows), self.decode_keys / 1e3, float(self.prefill_tokens),
                self.prefill_keys / 1e3]


def chunk_keys(start: int, num_tokens: int) -> int:
    """Keys a prefill chunk's rows attend to: row ``i`` of a chunk starting at ``start`` sees ``start + i + 1``."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Seconds per step from its shape, fitted to the last ``window`` timed steps.

    The fit is least squares on relative errors (each step's equation divided by its time: timing noise grows with
    the step, and a 2 ms fixed cost matters as much to a decode-only step as a 20 ms error does to a 400 ms prefill),
    with every coefficient kept non-negative (more work is never faster) and a light pull toward the previous fit, so
    a count the window barely varies keeps its last value instead of swinging. Serving makes such counts: decode rows
    and their keys grow together, and whole stretches have no prefill at all; recursive least squares with forgetting
    wound up on them (its covariance grew without bound), and one decode step was then predicted at 100 ms, which
    shrank every prompt chunk to the minimum and collapsed the prompt throughput (benchmarks/vs_vllm.py, 6 req/s).
    Refit every ``refit_every`` steps: a few thousand float operations in plain Python.

    ``prior`` gives the starting coefficients (seconds per unit of each feature)."""

    def __init__(self, prior: dict[str, float] | None = None, window: int = 256, refit_every: int = 8,
                 pull: float = 1e-2) -> None:
        start = {"fixed": 2e-3, "decode_rows": 5e-4, "decode_kilokeys": 1e-4, "prefill_tokens": 1e-3,
                 "prefill_kilokeys": 1e-5}
        start.update(prior or {})
        self.theta = [start[name] for name in FEATURES]
        self.window = window
        self.refit_every = refit_every
        self.pull = pull
        self._samples: deque[tuple[list[float], float]] = deque()
        n = len(FEATURES)
        self._gram = [[0.0] * n for _ in range(n)]  # the window's normal equations, kept as steps come and go
        self._rhs = [0.0] * n
        self.observed = 0

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.theta, shape.features()))

    def _add(self, x: list[float], y: float, sign: float) -> None:
        for i, xi in enumerate(x):
            if xi == 0.0:
                continue
            self._rhs[i] += sign * xi * y
            row = self._gram[i]
            for j, xj in enumerate(x):
                row[j] += sign * xi * xj

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One timed step; the coefficients are refitted every ``refit_every`` steps (and at the first ones)."""
        w = 1.0 / max(seconds, 1e-4)
        sample = ([v * w for v in shape.features()], seconds * w)
        self._samples.append(sample)
        self._add(*sample, 1.0)
        if len(self._samples) > self.window:
            self._add(*self._samples.popleft(), -1.0)
        self.observed += 1
        if self.observed % self.window == 0:  # rebuilt now and then: no drift from the subtractions
            n = len(FEATURES)
            self._gram = [[0.0] * n for _ in range(n)]
            self._rhs = [0.0] * n
            for x, y in self._samples:
                self._add(x, y, 1.0)
        if self.observed <= self.refit_every or self.observed % self.refit_every == 0:
            self._refit()

    def _refit(self) -> None:
        """Non-negative least squares on the window's (relative) equations plus ``pull`` x (theta - previous)^2 per
        coefficient, scaled by how much of its feature the window holds, by cyclic coordinate descent."""
        n = len(FEATURES)
        gram = [list(row) for row in self._gram]
        rhs = list(self._rhs)
        m = len(self._samples)
        prev = list(self.theta)
        for i in range(n):
            # the pull is relative to how much of feature i the window holds (an unexcited feature keeps its value)
            reg = self.pull * max(gram[i][i], 1e-12) + 1e-12 * m
            gram[i][i] += reg
            rhs[i] += reg * prev[i]
        theta = list(prev)
        for _ in range(60):
            for i in range(n):
                partial = rhs[i] - sum(gram[i][j] * theta[j] for j in range(n) if j != i)
                theta[i] = max(0.0, partial / gram[i][i])
        self.theta = theta

    def prefill_room(self, base: StepShape, budget_s: float, start: int, limit: int) -> int:
        """The most prompt tokens (up to ``limit``) a chunk starting at position ``start`` may add to a step shaped
        ``base`` so that the whole is predicted to stay within ``budget_s``; 0 when even one token would pass it."""
        left = budget_s - self.predict(base)
        if left <= 0 or limit <= 0:
            return 0
        per_token = max(0.0, self.theta[3])
        per_kilokey = max(0.0, self.theta[4])
        lo, hi = 0, limit
        while lo < hi:  # the cost grows with the chunk: the largest that fits, by bisection
            mid = (lo + hi + 1) // 2
            if per_token * mid + per_kilokey * chunk_keys(start, mid) / 1e3 <= left:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def snapshot(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.theta))
