"""Shared fixtures: models load once per session; engine fixtures check that every test leaves the engine clean."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Nothing in the tests may reach the network (transformers only reads the local GGUF files).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prompt rows through the matrix units (AMX, bfloat16) round their activations, so tests that hold the C step to
# float32's numbers run without them (and the same on every CPU); tests/engine/test_prompt_bf16.py turns them on.
os.environ.setdefault("TAILGUARD_PROMPT_BF16", "0")

# Tests that need a service the test script installs (Chromium, Prometheus and promtool, PostgreSQL, redis-server)
# skip where it is missing, except with TAILGUARD_REQUIRE_SERVICES=1 (CI: .ci/run sets it), where such a skip is a
# failure: a missing browser or server must not pass CI unseen. TAILGUARD_REQUIRE_PROMETHEUS=1, the old name, still
# counts; tests/slo/test_grafana.py reads that name, so it is set here for it.
REQUIRE_SERVICES = any(os.environ.get(name) == "1"
                       for name in ("TAILGUARD_REQUIRE_SERVICES", "TAILGUARD_REQUIRE_PROMETHEUS"))
if REQUIRE_SERVICES:
    os.environ["TAILGUARD_REQUIRE_PROMETHEUS"] = "1"
# A skip whose reason names one of these is a missing service.
SERVICE_WORDS = ("chromium", "prometheus", "promtool", "postgresql", "redis-server")

from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path  # noqa: E402
from tests.redis_server import RedisServer, RedisUnavailable  # noqa: E402

# Small budgets so that chunked prefill and decodes share steps even with short prompts.
TINY_BATCHED_TOKENS = 64
TINY_PREFILL_CHUNK = 48


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return Path(resolve_model_path("smollm2"))
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    from tailguard.engine.tokenizer import GGUFTokenizer

    return GGUFTokenizer(smollm2_path)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def tiny_gguf(smollm2_path, tmp_path_factory) -> Path:
    """A 2-layer random Llama with an untied output head, so that its greedy output depends on the whole context.

    (The engine's built-in "tiny" model ties the head to the embeddings and just repeats the last prompt token,
    which would let KV-cache and batching bugs pass unnoticed.)
    """
    from tailguard.engine.loader import write_tiny_gguf

    path = tmp_path_factory.mktemp("models") / "tiny-untied.gguf"
    return write_tiny_gguf(path, smollm2_path, tie_embeddings=False, seed=0)


def _make_engine(path: Path, **overrides):
    from tailguard.engine.engine import EngineArgs, LLMEngine

    args = dict(
        model=str(path),
        kv_cache_tokens=16384,
        max_num_seqs=32,
        max_num_batched_tokens=TINY_BATCHED_TOKENS,
        max_prefill_chunk=TINY_PREFILL_CHUNK,
        max_model_len=512,
        # One thread: the tiny model's matmuls are too small to share, and the test machine has few, busy cores.
        num_threads=1,
    )
    args.update(overrides)
    return LLMEngine(EngineArgs(**args))


def _assert_clean(engine) -> None:
    assert not engine.has_unfinished(), "a test left requests in the engine"
    assert engine.pool.num_used == 0, f"KV blocks leaked: {engine.pool.num_used} used by {engine.pool.owners()}"
    assert engine.pool.owners() == set()
    assert engine.scheduler.tables == {}
    assert engine._tracked == {}


@pytest.fixture(scope="session")
def _tiny_engine_session(tiny_gguf):
    return _make_engine(tiny_gguf)


@pytest.fixture
def tiny_engine(_tiny_engine_session):
    """The shared tiny engine (plenty of KV); the test must leave it with no requests and no blocks in use."""
    _assert_clean(_tiny_engine_session)
    yield _tiny_engine_session
    _assert_clean(_tiny_engine_session)


@pytest.fixture(scope="session")
def _small_kv_engine_session(tiny_gguf):
    # 24 blocks of 16 tokens: a handful of concurrent requests already overflow it, so preemption really happens.
    # float32 KV: a recomputed prefill must reproduce the decoded K/V exactly for greedy outputs to match token for
    # token; with float16 KV the two paths agree only to half precision (as in any engine with a half-precision cache).
    return _make_engine(tiny_gguf, kv_cache_tokens=384, max_num_seqs=16, kv_cache_dtype="float32")


@pytest.fixture(scope="session")
def tiny_engine_f32kv(tiny_gguf):
    """The tiny engine with a float32 KV cache: the reference for tests that need exact recompute."""
    return _make_engine(tiny_gguf, kv_cache_dtype="float32")


@pytest.fixture
def small_kv_engine(_small_kv_engine_session):
    _assert_clean(_small_kv_engine_session)
    yield _small_kv_engine_session
    _assert_clean(_small_kv_engine_session)


@pytest.fixture(scope="session")
def real_engine(smollm2_path):
    from tailguard.engine.engine import EngineArgs, LLMEngine

    return LLMEngine(
        EngineArgs(
            model="smollm2",
            kv_cache_tokens=4096,
            max_num_batched_tokens=256,
            max_prefill_chunk=128,
            num_threads=1,
        )
    )


def missing_service(reason: str) -> str | None:
    """The service a skip's reason says is missing, if any."""
    return next((word for word in SERVICE_WORDS if word in reason.lower()), None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With TAILGUARD_REQUIRE_SERVICES=1, a test skipped for want of a service fails instead (whether it skips by a
    skipif mark, pytest.skip() or a fixture)."""
    outcome = yield
    report = outcome.get_result()
    if not (REQUIRE_SERVICES and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    service = missing_service(reason)
    if service:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} would skip ({reason}), but with TAILGUARD_REQUIRE_SERVICES=1 a test that "
                           f"needs a service fails instead: install {service} (scripts/test.sh does, as root on "
                           "Debian)")


def pytest_collection_modifyitems(config, items):
    # Real-model tests are the slowest; run them last so that a quick failure elsewhere shows first.
    items.sort(key=lambda item: 1 if item.get_closest_marker("real_model") else 0)


def churn(engine, pending: list[tuple[str, list[int], Any, int]], rng: random.Random,
          after_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run requests through an engine the way traffic does: 0-3 arrivals before each step (``pending`` in arrival
    order: request id, prompt, sampling params, priority) and, after 8% of the steps, the abort of a live request.
    ``after_step`` runs after every step (invariant checks). Returns each request's final event."""
    from tailguard.engine.sequence import FinishReason

    todo = list(reversed(pending))
    live: set[str] = set()
    final: dict[str, Any] = {}
    while todo or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if todo:
                rid, prompt, sp, prio = todo.pop()
                engine.add_request(prompt, sp, request_id=rid, priority=prio)
                live.add(rid)
        for ev in engine.step():
            if ev.finished:
                final[ev.request_id] = ev
                live.discard(ev.request_id)
        if after_step is not None:
            after_step()
        if live and rng.random() < 0.08:
            rid = rng.choice(sorted(live))
            ev = engine.abort(rid)
            assert ev is not None and ev.finish_reason is FinishReason.ABORT
            final[rid] = ev
            live.remove(rid)
    return final


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    try:
        server = RedisServer().start()
    except RedisUnavailable as exc:
        if os.environ.get("CI") or REQUIRE_SERVICES:  # CI installs redis-server: there a missing one fails
            raise
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()
