"""The server's Backend protocol: the fake engine and the embedded engine both satisfy it; and the entry point's
modules import in one direction (``cli`` -> ``demo``, never back)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tailguard.engine.fake import FakeEngine
from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path
from tailguard.serving.backend import Backend, Tokenizer
from tailguard.serving.responses import TokenText

SRC = Path(__file__).resolve().parents[1] / "src" / "tailguard"


def test_the_fake_engine_is_a_backend():
    engine = FakeEngine()
    assert isinstance(engine, Backend) and isinstance(engine.tokenizer, Tokenizer)


def test_the_embedded_engine_is_a_backend():
    try:
        resolve_model_path("smollm2")  # the tiny model borrows the real model's tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")
    from tests.serving_helpers import tiny_engine

    engine = tiny_engine()
    assert isinstance(engine, Backend) and isinstance(engine.tokenizer, Tokenizer)
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


def test_gc_is_tuned_only_for_a_server_that_owns_its_process(tmp_path):
    """tailguard serve freezes what exists at start-up and makes collections rarer (lifespan.tune_gc); a server
    embedded in another process (a test's ThreadedServer here) leaves the process's collector alone."""
    import gc

    from tailguard.serving.lifespan import GC_THRESHOLDS, tune_gc
    from tests.serving_helpers import fake_server

    before = gc.get_threshold()
    with fake_server(tmp_path):
        assert gc.get_threshold() == before
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
