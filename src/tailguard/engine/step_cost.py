"""What a step will cost, in seconds, from its shape: the scheduler's model for a step budget in time (plain Python).

A step's time on a CPU is close to linear in a few counts: a fixed part (the call, the LM head of the rows that
sample), the decode rows, the keys those rows attend to, the prompt tokens of prefill chunks, and the keys those
tokens attend to (causal attention over the chunk and what came before it). The model keeps one coefficient per
count and fits them online by recursive least squares with forgetting, from every step the engine times, so it
follows the machine as it is now (a neighbour taking a core, a thermal limit) rather than as it was measured once.

The scheduler asks it the inverse question: how many prompt tokens fit in a step beside these decodes without the
step passing the decoding streams' inter-token budget (stall-free batching, as in Sarathi-Serve).
"""

from __future__ import annotations

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
    """Seconds per step from its shape, fitted online (recursive least squares, forgetting factor ``forget``).

    ``prior`` gives the starting coefficients (seconds per unit of each feature); a large starting covariance lets the
    first few timed steps override it. Coefficients are kept non-negative when predicting, so a noisy fit never
    promises that more work is faster."""

    def __init__(self, prior: dict[str, float] | None = None, forget: float = 0.98, spread: float = 1e-3) -> None:
        start = {"fixed": 2e-3, "decode_rows": 5e-4, "decode_kilokeys": 1e-4, "prefill_tokens": 1e-3,
                 "prefill_kilokeys": 1e-5}
        start.update(prior or {})
        self.theta = [start[name] for name in FEATURES]
        n = len(FEATURES)
        self.p = [[spread if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.forget = forget
        self.observed = 0

    def predict(self, shape: StepShape) -> float:
        return sum(max(0.0, c) * x for c, x in zip(self.theta, shape.features()))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One timed step: move the coefficients toward explaining it (RLS update, O(features^2)).

        Errors are weighed relative to the step's time (both sides divided by it): timing noise grows with the step,
        and a 2 ms fixed cost matters as much to a decode-only step as a 20 ms error does to a 400 ms prefill."""
        w = 1.0 / max(seconds, 1e-4)
        x = [v * w for v in shape.features()]
        seconds *= w
        n = len(x)
        px = [sum(self.p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = self.forget + sum(x[i] * px[i] for i in range(n))
        if denom <= 0:
            return
        gain = [v / denom for v in px]
        err = seconds - sum(c * v for c, v in zip(self.theta, x))
        self.theta = [c + g * err for c, g in zip(self.theta, gain)]
        # P <- (P - gain px^T) / forget, kept symmetric.
        self.p = [[(self.p[i][j] - gain[i] * px[j]) / self.forget for j in range(n)] for i in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                self.p[i][j] = self.p[j][i] = (self.p[i][j] + self.p[j][i]) / 2
        self.observed += 1

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
