"""The server's Backend protocol: the fake engine and the embedded engine both satisfy it; and the entry point's
modules import in one direction (``cli`` -> ``demo``, never back)."""

from __future__ import annotations

import ast
import asyncio
import sys
import time
from pathlib import Path

import pytest

from tailguard.backends.base import Backend, Tokenizer
from tailguard.backends.local import as_backend
from tailguard.engine.fake import FakeEngine
from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path
from tailguard.serving.responses import TokenText

SRC = Path(__file__).resolve().parents[2] / "src" / "tailguard"


def test_the_fake_engine_serves_behind_the_local_backend():
    engine = FakeEngine()
    assert not isinstance(engine, Backend)  # an engine: ``as_backend`` puts it behind ``LocalBackend``
    backend = as_backend(engine)
    assert isinstance(backend, Backend) and isinstance(backend.tokenizer, Tokenizer)
    assert backend.capacity() == engine.timing.max_num_seqs and backend.preempts() and not backend.speculates()
    assert as_backend(backend) is backend


def test_the_embedded_engine_is_a_backend():
    try:
        resolve_model_path("smollm2")  # the tiny model borrows the real model's tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")
    from tests.serving_helpers import tiny_engine

    engine = tiny_engine()
    backend = as_backend(engine)
    assert isinstance(backend, Backend) and isinstance(engine.tokenizer, Tokenizer)
    assert backend.capacity() == engine.engine.scheduler.config.max_num_seqs
    # Logprob token text from the tokenizer's own vocabulary: a byte-level piece gives its true bytes.
    tt = TokenText(engine.tokenizer)
    tid = engine.tokenizer.encode(" hello")[0]
    text, raw = tt.get(tid)
    assert bytes(raw).decode() == text and text.strip()


def test_token_text_for_the_fake_tokenizer_needs_no_special_case():
    tt = TokenText(FakeEngine().tokenizer)
    assert tt.get(3 + ord("a")) == ("a", [ord("a")])


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_demo_does_not_import_the_cli():
    assert "tailguard.cli" not in _imports(SRC / "demo.py")
    assert "tailguard.demo" in _imports(SRC / "cli.py")


def test_gc_is_scheduled_only_for_a_server_that_owns_its_process(tmp_path):
    """A server embedded in another process (a test's ThreadedServer here) leaves the process's collector alone;
    tailguard serve's own process freezes its start-up objects and collects on a timer (serving/gc_schedule.py)."""
    import gc

    from tests.serving_helpers import fake_server

    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    with fake_server(tmp_path):
        assert gc.isenabled() == enabled and gc.get_freeze_count() == frozen


def test_scheduled_collector_collects_cycles_on_its_timer_not_on_allocation():
    import gc
    import weakref

    from tailguard.serving.gc_schedule import ScheduledCollector

    class Node:
        pass

    enabled = gc.isenabled()
    c = ScheduledCollector(interval_s=3600, new_objects=5_000, check_s=0.005)
    c.install()
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        assert not c.due()
        refs = []
        for _ in range(50):
            n = Node()
            n.me = n  # a cycle: reference counting alone never frees it
            refs.append(weakref.ref(n))
            del n
        keep = [[] for _ in range(6_000)]  # tracked allocations past the limit: a collection falls due...
        assert all(r() is not None for r in refs)  # ...but none ran on allocation
        assert c.due()

        async def until_collected() -> None:
            task = asyncio.create_task(c.run())
            while c.stats.collections == 0:
                await asyncio.sleep(0.005)
            task.cancel()

        asyncio.run(asyncio.wait_for(until_collected(), 10))
        assert all(r() is None for r in refs) and c.stats.collected >= 50 and c.stats.max_pause_s > 0
        assert not c.due() and len(keep) == 6_000
        assert c.due(now=time.monotonic() + 3601)  # the interval alone makes one due
    finally:
        c.uninstall()
    assert gc.isenabled() == enabled


def test_a_server_that_owns_its_process_puts_the_collector_on_its_timer():
    """tailguard serve (own_process=True): attaching the backend freezes the start-up objects, turns automatic
    collection off and starts the collector's timer; its pauses are in /metrics."""
    import gc
    from types import SimpleNamespace

    from tailguard.observe.metrics import ServerMetrics
    from tailguard.serving.lifespan import Lifespan

    enabled = gc.isenabled()
    metrics = ServerMetrics("m")
    state = SimpleNamespace(metrics=metrics, batch_cap=None, attach=lambda eng: None)
    life = Lifespan(state, None, None, None, own_engine=False, own_process=True)  # type: ignore[arg-type]

    async def attached() -> tuple[bool, bool]:
        life.attach(FakeEngine())
        await asyncio.sleep(0)
        running = life.collecting is not None and not life.collecting.done()
        life.collecting.cancel()
        return gc.isenabled(), running

    interval = sys.getswitchinterval()
    try:
        now_enabled, running = asyncio.run(attached())
        assert not now_enabled and running and gc.get_freeze_count() > 0
        life.collector.collect()  # each pause goes to the server's histogram
        assert metrics.registry.get_sample_value("tailguard_gc_pause_seconds_count", {"model": metrics.model}) == 1
        assert sys.getswitchinterval() == interval  # an engine's thread keeps the interpreter's switch interval
    finally:
        life.restore_process_settings()
    assert gc.isenabled() == enabled


def test_a_gateway_that_owns_its_process_hands_the_gil_to_its_loop_sooner():
    """A gateway (a backend that takes text: upstream replicas) in its own process shortens the interpreter's switch
    interval, so that the loop waits less for the GIL held by the store's writer thread; handed back at the end."""
    from types import SimpleNamespace

    from tailguard.backends.local import LocalBackend
    from tailguard.serving.lifespan import GATEWAY_SWITCH_INTERVAL_S, Lifespan

    class TextBackend(LocalBackend):  # a backend whose replicas tokenize: no tokenizer of its own
        def __init__(self, engine: FakeEngine) -> None:
            super().__init__(engine)
            self.tokenizer = None  # type: ignore[assignment]

    state = SimpleNamespace(metrics=None, batch_cap=None, attach=lambda eng: None)
    interval = sys.getswitchinterval()
    assert interval != GATEWAY_SWITCH_INTERVAL_S
    embedded = Lifespan(state, None, None, None, own_engine=False, own_process=False)  # type: ignore[arg-type]
    life = Lifespan(state, None, None, None, own_engine=False, own_process=True)  # type: ignore[arg-type]

    async def attach() -> float:
        embedded.attach(TextBackend(FakeEngine()))
        assert sys.getswitchinterval() == interval  # not the process's owner: its settings are not the server's
        life.attach(TextBackend(FakeEngine()))
        if life.collecting is not None:
            life.collecting.cancel()
        return sys.getswitchinterval()

    try:
        assert asyncio.run(attach()) == pytest.approx(GATEWAY_SWITCH_INTERVAL_S)
    finally:
        life.restore_process_settings()
    assert sys.getswitchinterval() == interval
