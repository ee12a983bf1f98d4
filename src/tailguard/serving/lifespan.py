"""The server's lifespan: open the store, load (or attach) the engine, run the sampler and the SLO evaluator, and
undo all of it in reverse order at shutdown.

The model loads in a background thread after the server starts, so ``/health`` answers at once and ``/ready`` says
when requests can be served (what a load balancer or Kubernetes probe expects).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette

from tailguard.backends.base import Backend
from tailguard.backends.local import LocalEngine, as_backend
from tailguard.observe.store import RequestStore
from tailguard.observe.stores import open_store
from tailguard.serving.gc_schedule import ScheduledCollector
from tailguard.serving.state import ServerState

GATEWAY_SWITCH_INTERVAL_S = 0.0002  # sys.setswitchinterval in a gateway's own process (see Lifespan.attach)

log = logging.getLogger("tailguard.server")


class Lifespan:
    def __init__(self, state: ServerState, engine: Backend | LocalEngine | None,
                 engine_factory: Callable[[], Backend | LocalEngine] | None,
                 redactor: Any | None, own_engine: bool, own_process: bool = False) -> None:
        self.state = state
        self.engine = engine
        self.engine_factory = engine_factory
        self.own_process = own_process  # tailguard serve: the process is the server's alone (not a test's)
        self.redactor = redactor
        self.own_engine = own_engine
        self.planning: asyncio.Task | None = None  # the forecast-driven batch cap's period timer
        # tailguard serve's own process: the cycle collector on a timer (serving/gc_schedule.py)
        self.collector: ScheduledCollector | None = None
        self.switch_interval: float | None = None  # the interpreter's own, while the gateway's is set
        self.collecting: asyncio.Task | None = None

    def attach(self, eng: Backend | LocalEngine) -> None:
        backend = as_backend(eng)
        if self.state.metrics is not None:
            self.state.metrics.model = backend.model_name  # first: the gateway's and the audit's metrics take it too
        self.state.attach(backend)
        if self.state.batch_cap is not None and self.planning is None:
            self.planning = asyncio.create_task(self.state.batch_cap.run())
        if self.own_process and self.collector is None:  # process-wide settings
            metrics = self.state.metrics
            self.collector = ScheduledCollector(on_collect=None if metrics is None else (
                lambda pause, _found: metrics.gc_pause.labels(metrics.model).observe(pause)))
            self.collector.install()
            self.collecting = asyncio.get_running_loop().create_task(self.collector.run())
        if self.own_process and backend.tokenizer is None and self.switch_interval is None:
            # The gateway: its event loop is the work, and the store's writer and the resource sampler are helpers
            # whose Python holds the GIL. A loop woken by a socket waits for the GIL until the holder lets go, at the
            # latest after the switch interval (CPython's 5 ms); capped to GATEWAY_SWITCH_INTERVAL_S (at 256
            # streams, benchmarks/gateway_overhead.py: P99 TTFT lower in 5 of 6 paired rounds, no CPU cost).
            self.switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(GATEWAY_SWITCH_INTERVAL_S)

    def restore_process_settings(self) -> None:
        """Hand the process's settings back (the collector, the switch interval): after the server stops."""
        if self.collector is not None:
            self.collector.uninstall()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
            self.switch_interval = None

    async def load(self) -> None:
        assert self.engine_factory is not None
        try:
            eng = await asyncio.to_thread(self.engine_factory)
        except Exception as exc:  # noqa: BLE001 - reported by /ready and every request
            log.exception("the model failed to load")
            self.state.load_error = f"{type(exc).__name__}: {exc}"
            return
        backend = as_backend(eng)
        await backend.start()  # an upstream pool: its sessions and health checks live on this event loop
        try:
            self.attach(backend)
        except ValueError as exc:  # a setting this backend cannot honour: reported by /ready and every request
            log.error("%s", exc)
            self.state.load_error = str(exc)
            return
        self.state.ready = self.state.store is not None

    async def sampler(self) -> None:
        state, tick = self.state, 0
        while True:
            try:
                state.sample()
                if tick % 2 == 0:
                    state.store_sample()
            except Exception:  # noqa: BLE001 - a failed sample must not stop sampling
                log.exception("sampler")
            tick += 1
            await asyncio.sleep(state.config.sample_interval)

    async def open_store(self) -> RequestStore:
        state, config = self.state, self.state.config
        red = self.redactor
        if config.store_text and red is None:
            from tailguard.observe.redaction import Redactor

            red = await asyncio.to_thread(Redactor)  # imports Presidio: seconds, off the event loop

        def encode(text: str) -> list[int]:
            tok = state.engine.tokenizer if state.engine is not None else None
            return tok.encode(text) if tok is not None else []

        def count(counter: str) -> Callable[[int], None]:
            def inc(n: int) -> None:
                if state.metrics is not None:
                    getattr(state.metrics, counter).labels(state.metrics.model).inc(n)
            return inc

        return await asyncio.to_thread(
            open_store, config.store_path, retention_days=config.retention_days, store_text=config.store_text,
            redact=red.redact if red is not None else None, encode=encode,
            on_error=count("store_errors"), on_drop=count("store_dropped"),
        )

    @asynccontextmanager
    async def __call__(self, app: Starlette) -> AsyncIterator[None]:
        state = self.state
        state.store = await self.open_store()
        if state.config.redis_url:  # a fleet: rate limits, lane budgets and SLO windows shared through Redis
            from tailguard.policy.fleet_state import open_shared

            timeout = state.config.redis_timeout_s
            state.shared = open_shared(state.config.redis_url, state.metrics.registry if state.metrics else None,
                                       timeout_s=timeout)
            await state.shared.start()
            if state.slo is not None:  # off the request path: it may wait longer
                state.slo.join_fleet(state.config.redis_url, gateway_id=state.shared.gateway_id,
                                     timeout_s=max(0.5, 2 * timeout))
        if state.config.tracing.enabled:
            from tailguard.observe.tracing import RequestTracer

            state.tracer = RequestTracer(state.config.tracing)
        loader = None
        if self.engine is not None:
            backend = as_backend(self.engine)
            await backend.start()
            self.attach(backend)
            state.ready = True
        else:
            loader = asyncio.create_task(self.load())
        sampling = asyncio.create_task(self.sampler())
        evaluating = asyncio.create_task(state.slo.run()) if state.slo is not None else None
        app.state.tailguard = state
        try:
            yield
        finally:
            state.flush_closes()  # the records of the last requests, before anything they feed closes
            sampling.cancel()
            if self.collecting is not None:
                self.collecting.cancel()
            if self.planning is not None:
                self.planning.cancel()
            if evaluating is not None:
                evaluating.cancel()
            if loader is not None:
                loader.cancel()
            state.ready = False
            if state.machine is not None:
                state.machine.stop()
            if self.own_engine and state.engine is not None:
                await state.engine.aclose()
                await asyncio.to_thread(state.engine.shutdown)
            await state.shared.close()
            if state.slo is not None:
                await asyncio.to_thread(state.slo.close)  # waits (bounded) for scale-hook calls in flight
            if state.tracer is not None:
                tracer, state.tracer = state.tracer, None
                await asyncio.to_thread(tracer.shutdown)  # exports what is queued (bounded by the export timeout)
            await asyncio.to_thread(state.store.close)
            self.restore_process_settings()
