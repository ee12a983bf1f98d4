"""The replica provider driven by the gateway's own backlog (``scale_out.provider.autoscale``).

The SLO tiers see a backlog only once it has moved a window's percentile: on a replayed trace the tiers' scale-out
started the third replica 45 s after requests began to wait (docs/case-study.md). The gateway knows at once: requests
wait in its lanes for a slot upstream (the queue gate), or the replicas report their own queues. So, beside the
tiers, the provider follows that backlog directly, as KEDA's queue-length trigger would outside the process:

- **out**: a replica starts once a request has waited ``wait_s`` at the gateway, or the replicas queue
  ``queued_per_replica`` each, and that has held for ``sustain_s``;
- **in**: the newest provided replica drains and stops once nothing waits and the requests in flight would fit the
  other replicas at ``scale_in_utilization``, held for ``scale_in_after_s`` (never while the tiers' own scale-out is
  in effect);
- one step at a time, at least ``cooldown_s`` apart, within the provider's ``min_replicas`` / ``max_replicas``.

The decision is a plain function of a :class:`LoadSample` and the time (tests drive it); :meth:`run` samples every
``interval_s`` on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tailguard.backends.upstream.provider import ReplicaProvider, Result
from tailguard.slo.config import AutoscaleConfig

log = logging.getLogger("tailguard.gateway")


@dataclass(frozen=True)
class LoadSample:
    """The gateway's load as the autoscaler reads it."""

    oldest_wait_s: float  # the longest any request has waited at the gateway for admission now
    gateway_waiting: int  # requests waiting at the gateway
    upstream_waiting: float  # the replicas' own queues, as the gateway estimates them
    busy: int  # requests in flight at the replicas
    capacity: int  # sequences the serving replicas take together
    replicas: int  # replicas serving (configured and provided)
    removable_capacity: int | None  # what the newest provided replica takes (None: none the provider could stop)
    can_add: bool = True  # the provider runs fewer than its max_replicas


class ReplicaAutoscaler:
    def __init__(self, cfg: AutoscaleConfig, provider: ReplicaProvider, sample: Callable[[], LoadSample],
                 hold: Callable[[], bool] | None = None,
                 on_step: Callable[[str, dict[str, Any], Result], None] | None = None,
                 fires: Callable[[], bool] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.provider = provider
        self.sample = sample
        self.hold = hold  # True: something else (the tiers' scale-out) wants the replicas kept
        self.on_step = on_step  # (action, the figures that triggered it, the provider's result)
        self.fires = fires  # False: another gateway of the fleet acts (the leader), this one only watches
        self.clock = clock
        self._backlog_since: float | None = None
        self._idle_since: float | None = None
        self._last_step: float | None = None
        self._task: asyncio.Task | None = None
        self.steps: list[tuple[float, str]] = []  # (when, "scale_out" | "scale_in"): what it asked for

    def backlogged(self, s: LoadSample) -> bool:
        queued = s.upstream_waiting >= self.cfg.queued_per_replica * max(1, s.replicas)
        return (s.gateway_waiting > 0 and s.oldest_wait_s >= self.cfg.wait_s) or queued

    def fits_without_newest(self, s: LoadSample) -> bool:
        if s.removable_capacity is None or s.gateway_waiting or s.upstream_waiting >= 1:
            return False
        rest = s.capacity - s.removable_capacity
        return rest > 0 and s.busy <= self.cfg.scale_in_utilization * rest

    def decide(self, s: LoadSample, now: float) -> int:
        """+1: start a replica, -1: stop the newest, 0: nothing (the timers advance either way)."""
        backlog = self.backlogged(s)
        self._backlog_since = (self._backlog_since if self._backlog_since is not None else now) if backlog else None
        idle = self.fits_without_newest(s)
        self._idle_since = (self._idle_since if self._idle_since is not None else now) if idle else None
        if self._last_step is not None and now - self._last_step < self.cfg.cooldown_s:
            return 0
        if self._backlog_since is not None and now - self._backlog_since >= self.cfg.sustain_s:
            return 1 if s.can_add else 0  # at max_replicas: nothing to ask (and no record every cooldown)
        if self._idle_since is not None and now - self._idle_since >= self.cfg.scale_in_after_s:
            if self.hold is not None and self.hold():
                return 0
            return -1
        return 0

    async def step(self, direction: int, s: LoadSample, now: float) -> list[Result]:
        """Ask the provider for one replica more (or less); each result goes to ``on_step``."""
        self._last_step = now
        self._backlog_since = self._idle_since = None
        action = "scale_out" if direction > 0 else "scale_in"
        self.steps.append((now, action))
        figures = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(s).items()}

        def hand(res: Result) -> None:
            if self.on_step is not None:
                try:
                    self.on_step(action, figures, res)
                except Exception:  # noqa: BLE001 - the record's sink must not stop the step
                    log.exception("replica autoscaler: step callback failed")

        try:
            return await self.provider.scale(1.0 if direction > 0 else -1.0, hand, replicas=1)
        except Exception as exc:  # noqa: BLE001 - reported as a failed step, never raised into the loop
            log.exception("replica autoscaler: scale step failed")
            res: Result = {"target": "provider", "provider": self.provider.kind, "ok": False,
                           "error": f"{type(exc).__name__}: {exc}"[:500]}
            hand(res)
            return [res]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                s = self.sample()
                now = self.clock()
                direction = self.decide(s, now)
            except Exception:  # noqa: BLE001 - a bad read skips one tick, it does not end the loop
                log.exception("replica autoscaler: could not read the gateway's load")
                continue
            if direction and (self.fires is None or self.fires()):
                await self.step(direction, s, now)

    def start(self) -> asyncio.Task:
        """Run on the current event loop (the gateway's)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())
        return self._task

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
