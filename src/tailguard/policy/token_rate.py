"""The backend's token rate, measured (``capacity.tokens_per_s: auto``).

A backend's capacity in tokens per second is what it completes while it is kept busy. The meter therefore counts
only *saturated* time: the stretches in which work was waiting for the backend (requests queued in the gateway's
lanes, or the upstream queue gate closed). Idle or lightly loaded time says how much work arrived, not how much the
backend can do, and is left out.

Tokens are counted in the unit the lanes budget in: each finished request's *estimate* (prompt tokens + max_tokens,
what it held while admitted), not the tokens it actually produced. In one unit the fixed point is stable: with a
budget of ``rate x horizon`` the backend holds ``horizon`` seconds of work at the rate it drains it, so the budget
never throttles the backend below the rate it was measured at as long as a request takes less than ``horizon``
seconds; measured in actual tokens (fewer than the estimates), the budget would hold less work than that, the
backend would drain slower, and the estimate would spiral down.

Each ``window_s`` seconds of saturated time close a sample (tokens finished in it / its seconds); the estimate is an
exponentially weighted mean of the samples. Until the first sample there is no estimate: the lanes run on sequences
alone (fail open).
"""

from __future__ import annotations


class TokenRateMeter:
    def __init__(self, window_s: float = 10.0, smoothing: float = 0.3) -> None:
        if window_s <= 0 or not 0 < smoothing <= 1:
            raise ValueError("window_s must be > 0 and smoothing in (0, 1]")
        self.window_s = window_s
        self.smoothing = smoothing
        self.rate: float | None = None  # estimated tokens per second; None until a saturated window closed
        self.samples = 0
        self._last: float | None = None  # when the state was last observed
        self._saturated = False  # the state since then
        self._busy_s = 0.0  # saturated seconds in the open window
        self._busy_tokens = 0  # tokens finished during them

    def observe(self, now: float, saturated: bool, finished_tokens: int = 0) -> bool:
        """The state now (``saturated``: work is waiting for the backend), and the estimated tokens of a request
        that just finished. Returns True when a window closed and the estimate changed."""
        changed = False
        if self._last is not None and self._saturated:
            self._busy_s += max(0.0, now - self._last)
            # A request that finishes as the backend leaves saturation was drained by the busy backend too.
            self._busy_tokens += max(0, finished_tokens)
            if self._busy_s >= self.window_s:
                sample = self._busy_tokens / self._busy_s
                self.rate = sample if self.rate is None else \
                    self.rate + self.smoothing * (sample - self.rate)
                self.samples += 1
                self._busy_s, self._busy_tokens = 0.0, 0
                changed = True
        self._last, self._saturated = now, saturated
        return changed
