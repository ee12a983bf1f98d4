"""The speculative decoding consistency audit, end to end on the tiny model: a sampled speculative request is rerun
without speculation off the request path, and the edit distance is recorded (store, /v1/alerts, /metrics). Zero with
the engine's verifier; non-zero, with an alert, when the verifier is deliberately broken (a test double that accepts
every guess)."""

from __future__ import annotations

import httpx
import pytest

from tailguard.engine.engine import AsyncLLMEngine, EngineArgs
from tailguard.engine.torch_runner import SampledToken
from tailguard.serving.server import ThreadedServer
from tailguard.slo.report import build_report
from tests.serving_helpers import ADMIN, make_config, settle, wait_until

PROMPT = "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta gamma"


@pytest.fixture(scope="module")
def spec_engine():
    engine = AsyncLLMEngine.from_args(EngineArgs(model="tiny", kv_cache_tokens=4096, max_num_seqs=8,
                                                 max_num_batched_tokens=256, num_threads=1, speculative="ngram"))
    yield engine
    engine.shutdown()


class RepeatLast:
    """A proposer that always guesses the last token again: a real proposal on any text, often wrong (the random
    tiny model rarely repeats the prompt's n-grams, so n-gram lookup would propose too little to test with)."""

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return [token_ids[-1]] * max_tokens


@pytest.fixture(autouse=True)
def guessing(spec_engine, monkeypatch):
    monkeypatch.setattr(spec_engine.engine.speculation, "proposer", RepeatLast())


def _audits(server) -> list[dict]:
    data = httpx.get(server.url + "/v1/alerts", headers=ADMIN, params={"limit": 100}).json()["data"]
    return [r for r in data if r["kind"] == "audit"]


def _ask(server, n: int = 6) -> list[httpx.Response]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    out = [httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120) for _ in range(n)]
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    return out


def test_audit_records_zero_distance_for_exact_speculation(tmp_path, spec_engine):
    with ThreadedServer(make_config(tmp_path, speculative_audit=1.0), spec_engine) as server:
        out = _ask(server)
        settle(server)
        recs = [server.state.store.get(r.headers["x-request-id"]) for r in out]
        assert sum(r["speculation"]["proposed"] for r in recs if r["speculation"]) > 0, "nothing was speculated"
        assert "spec;desc=" in out[0].headers.get("server-timing", "") or recs[0]["speculation"] is None
        speculated = [r for r in recs if r["speculation"]]
        assert wait_until(lambda: len(_audits(server)) >= len(speculated), timeout=60)
        audits = _audits(server)
        assert all(a["event"] == "ok" and a["figures"]["edit_distance"] == 0 for a in audits)
        assert {a["details"]["request_id"] for a in audits} == {r["request_id"] for r in speculated}
        metrics = httpx.get(server.url + "/metrics").text
        assert 'tailguard_spec_audits_total{model="tiny",sampling="greedy",verdict="ok"}' in metrics
        assert "tailguard_spec_decode_acceptance_rate_bucket" in metrics
        # A request may opt out: it never speculates (and so is never audited).
        body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                "temperature": 0, "ignore_eos": True, "speculative": False}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200
        settle(server)
        assert server.state.store.get(r.headers["x-request-id"])["speculation"] is None
        # `tailguard slo report` shows the audit from the store.
        assert server.state.store.flush(10)
        rep = build_report(server.config.store_path, [], weeks=1)
        assert rep["audit"]["greedy"]["audited"] == len(audits) and rep["audit"]["greedy"]["mismatches"] == 0


def test_audit_catches_a_broken_verifier(tmp_path, spec_engine, monkeypatch):
    runner = spec_engine.engine.runner

    def accept_everything(logits, seq, draft):  # the bug: guesses taken without checking them
        return [SampledToken(t) for t in draft] + [SampledToken(int(logits[len(draft)].argmax()))]

    monkeypatch.setattr(runner, "verify", accept_everything)
    with ThreadedServer(make_config(tmp_path, speculative_audit=1.0), spec_engine) as server:
        _ask(server)
        settle(server)
        assert wait_until(lambda: any(a["event"] == "mismatch" for a in _audits(server)), timeout=60)
        bad = [a for a in _audits(server) if a["event"] == "mismatch"]
        assert all(a["figures"]["edit_distance"] > 0 for a in bad)
        alerts = httpx.get(server.url + "/v1/alerts", headers=ADMIN).json()["data"]
        assert any(a["name"] == "spec_inconsistent" and a["event"] == "raised" for a in alerts)
