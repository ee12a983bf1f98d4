"""Sampled internals (T2): which requests and steps are instrumented, what the probe measures, that sampling never
changes an answer, how the record keeps it (store schema 4, SQLite and PostgreSQL), and the hotspot analysis."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import time

import httpx
import pytest

from tailguard.engine.sequence import SamplingParams
from tailguard.observe.store import SCHEMA_VERSION
from tailguard.observe.stores import open_store
from tailguard.slo.hotspots import find_hotspots, load_records
from tests.conftest import _make_engine
from tests.observe.test_store import _tl
from tests.serving_helpers import ADMIN, make_config, settle


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(engine, batch: list[list[int]], sp: SamplingParams) -> tuple[list[list[int]], list[dict | None]]:
    """Run a batch together; returns each request's tokens and its final event's internals."""
    ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p in batch]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    internals: dict[str, dict | None] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                tokens[ev.request_id].append(ev.token_id)
            if ev.finished:
                internals[ev.request_id] = ev.internals
    return [tokens[i] for i in ids], [internals[i] for i in ids]


@pytest.fixture(scope="module")
def plain(tiny_gguf):
    return _make_engine(tiny_gguf)


@pytest.fixture(scope="module")
def half_sampled(tiny_gguf):
    return _make_engine(tiny_gguf, internals_sample_rate=0.5, internals_seed=7, internals_decode_every=4)


@pytest.fixture(scope="module")
def all_sampled(tiny_gguf):
    return _make_engine(tiny_gguf, internals_sample_rate=1.0, internals_decode_every=4, internals_max_steps=8)


# --- the engine -----------------------------------------------------------------------------------------------------
def test_sampled_requests_carry_every_layer_and_unsampled_ones_nothing(half_sampled):
    engine = half_sampled
    cfg = engine.config
    _, found = run(engine, prompts(12, seed=1), greedy(10))
    sampled = [r for r in found if r is not None]
    assert 0 < len(sampled) < len(found), "a share of 0.5 over 12 requests samples some, not all"
    n_heads = max(1, round(cfg.num_heads * 0.1))
    for rec in sampled:
        assert len(rec["heads"]) == n_heads and all(0 <= h < cfg.num_heads for h in rec["heads"])
        kinds = [s["kind"] for s in rec["steps"]]
        assert kinds[0] == "prefill" and "decode" in kinds
        for step in rec["steps"]:
            for key in ("layer_ms", "attn_ms", "mlp_ms", "norm", "entropy"):
                assert len(step[key]) == cfg.num_layers, key
            assert all(len(e) == n_heads for e in step["entropy"])
            assert all(n > 0 for n in step["norm"])
            assert all(t > 0 for t in step["layer_ms"])
            for total, a, m in zip(step["layer_ms"], step["attn_ms"], step["mlp_ms"]):
                assert total == pytest.approx(a + m, abs=2e-4)
            assert sum(step["layer_ms"]) <= step["step_ms"] + 1e-3 and step["probe_ms"] > 0
    assert engine.internals._records == {}, "finished requests leave nothing behind"


def test_outputs_are_identical_with_sampling_on_and_off(plain, half_sampled, all_sampled):
    # Chunked prefills beside decodes (64-token steps): instrumented steps run in torch, the rest in C.
    batch = prompts(8, seed=2, hi=150)
    expected, none = run(plain, batch, greedy(16))
    assert none == [None] * len(batch)
    for engine in (half_sampled, all_sampled):
        got, _ = run(engine, batch, greedy(16))
        assert got == expected


def test_chosen_steps_entropy_bounds_and_the_step_cap(all_sampled):
    prompt = prompts(1, seed=3, lo=30, hi=30)[0]
    _, (rec,) = run(all_sampled, [prompt], greedy(14))
    decode_positions = [s["position"] for s in rec["steps"] if s["kind"] == "decode"]
    # The first decode step, then every 4th (decode_every=4), 14 tokens: outputs 1, 5, 9, 13 are fed back.
    assert decode_positions == [30, 34, 38, 42]
    for step in rec["steps"]:
        bound = math.log(step["position"] + 1)
        for layer in step["entropy"]:
            assert all(0.0 <= h <= bound + 1e-4 for h in layer)
    # One key (a one-token prompt): the attention distribution is a point, its entropy zero.
    _, (one,) = run(all_sampled, [[1234]], greedy(2))
    assert one["steps"][0]["position"] == 0
    assert all(h == pytest.approx(0.0, abs=1e-5) for layer in one["steps"][0]["entropy"] for h in layer)
    # A long answer is instrumented at most max_steps (8) times.
    _, (long,) = run(all_sampled, [prompt], greedy(60))
    assert len(long["steps"]) == 8


@pytest.mark.real_model
def test_real_model_greedy_answers_unchanged_by_instrumented_steps(real_engine, tokenizer):
    """SmolLM2's native weights: every other decode step leaves the C decode step for the probed torch path."""
    sampler = real_engine.internals
    batch = [tokenizer.encode_chat([{"role": "user", "content": m}])
             for m in ("Tell me a short story about a robot.", "What is the capital of France?")]
    expected, _ = run(real_engine, batch, greedy(24))
    saved = sampler.sample_rate, sampler.decode_every, sampler.max_steps
    sampler.sample_rate, sampler.decode_every, sampler.max_steps = 1.0, 2, 64
    try:
        got, found = run(real_engine, batch, greedy(24))
    finally:
        sampler.sample_rate, sampler.decode_every, sampler.max_steps = saved
    assert got == expected
    assert all(sum(s["kind"] == "decode" for s in rec["steps"]) == 12 for rec in found)


def test_a_bad_sample_rate_fails_before_the_model_loads(tiny_gguf):
    with pytest.raises(ValueError, match="internals_sample_rate"):
        _make_engine(tiny_gguf, internals_sample_rate=1.5)
    with pytest.raises(ValueError, match="internals_decode_every"):
        _make_engine(tiny_gguf, internals_sample_rate=0.1, internals_decode_every=0)


# --- the record -----------------------------------------------------------------------------------------------------
def test_record_and_server_timing_through_the_server(tmp_path, all_sampled):
    from tailguard.engine.engine import AsyncLLMEngine
    from tailguard.serving.server import ThreadedServer

    engine = AsyncLLMEngine(all_sampled)  # runs it in its thread until shutdown: the last test that uses it
    try:
        with ThreadedServer(make_config(tmp_path, model="tiny"), engine) as server:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": "probe-1"},
                           timeout=60)
            assert r.status_code == 200
            timing = [p.strip() for p in r.headers["server-timing"].split(",")]
            assert "internals" in timing  # a flag only: the figures are in the record
            settle(server)
            rec = httpx.get(server.url + "/v1/requests/probe-1", headers=ADMIN, timeout=10).json()
            assert len(rec["internals"]["steps"][0]["layer_ms"]) == engine.engine.config.num_layers
            stored = server.state.store.get("probe-1")
            assert stored["internals"] == rec["internals"]
    finally:
        engine.shutdown()


def test_server_timing_carries_only_a_flag_and_the_flag_reaches_the_engine():
    from tailguard.cli import build_parser
    from tailguard.engine_options import engine_args_from

    plain, sampled = _tl(1), _tl(2, internals=_steps(2))
    assert "internals" not in plain.server_timing() and "internals" not in plain.to_record()
    assert sampled.server_timing().split(", ")[-1] == "internals"
    assert sampled.to_record()["internals"] == _steps(2)
    args = build_parser().parse_args(["serve", "--internals-sample-rate", "0.25"])
    assert engine_args_from(args).internals_sample_rate == 0.25
    assert engine_args_from(build_parser().parse_args(["serve"])).internals_sample_rate == 0.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--internals-sample-rate", "1.5"])


def _steps(n_layers: int) -> dict:
    return {"heads": [0], "decode_every": 16, "steps": [
        {"kind": "prefill", "position": 9, "tokens": 10, "batch_tokens": 10, "batch_seqs": 1, "step_ms": 5.0,
         "layer_ms": [0.5] * n_layers, "attn_ms": [0.3] * n_layers, "mlp_ms": [0.2] * n_layers,
         "norm": [1.0] * n_layers, "entropy": [[0.7]] * n_layers}]}


# The tables as schema 3 made them (store.py's SQLITE_SCHEMA before schema 4 added requests.internals, queue_samples.cpu/rss).
_SCHEMA_3 = """
CREATE TABLE requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL, received_at REAL NOT NULL,
    endpoint TEXT NOT NULL, model TEXT, user TEXT, business_type TEXT, stream INTEGER NOT NULL,
    status INTEGER NOT NULL, outcome TEXT NOT NULL, finish_reason TEXT, error TEXT, prompt_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL, e2e REAL NOT NULL, ttft REAL, tpot REAL, tokenize REAL NOT NULL,
    queue REAL NOT NULL, prefill REAL NOT NULL, decode REAL NOT NULL, stream_time REAL NOT NULL, record TEXT NOT NULL,
    prompt_text TEXT, output_text TEXT, prompt_token_ids TEXT, prompt_token_hmac TEXT, logprobs TEXT,
    lane TEXT, client TEXT, region TEXT, degraded INTEGER NOT NULL DEFAULT 0, slo_action TEXT
);
CREATE TABLE queue_samples (t REAL NOT NULL, running INTEGER NOT NULL, waiting INTEGER NOT NULL,
    server_queue INTEGER NOT NULL, kv_blocks_used INTEGER NOT NULL, kv_blocks_total INTEGER NOT NULL);
PRAGMA user_version=3;
"""


def _schema_3(path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA_3)
    body = json.dumps({"timestamps": {}, "token_times": [0.01], "token_sent": [], "sampling": None,
                       "resources": None, "preemptions": 0})
    conn.execute(
        "INSERT INTO requests (request_id, received_at, endpoint, stream, status, outcome, prompt_tokens,"
        " output_tokens, e2e, tokenize, queue, prefill, decode, stream_time, record) VALUES ('req-1', ?,"
        " '/v1/completions', 0, 200, 'success', 3, 1, 0.021, 0.001, 0.001, 0.008, 0.01, 0.001, ?)",
        (time.time(), body))
    conn.execute("INSERT INTO queue_samples VALUES (?, 1, 0, 0, 3, 10)", (time.time() - 1,))
    conn.commit()
    conn.close()


def test_schema_3_sqlite_file_is_migrated_to_4(tmp_path):
    path = tmp_path / "old.sqlite3"
    _schema_3(path)
    # The hotspot reader takes a schema-3 file as it is (stages, no internals), read-only.
    assert load_records(str(path))[0]["internals"] is None
    s = open_store(path, secret="k")
    assert s.schema_version == SCHEMA_VERSION == 4
    assert s.get("req-1")["e2e"] == pytest.approx(0.021) and "internals" not in s.get("req-1")
    s.put(_tl(2, internals=_steps(3)))
    s.put_sample(time.time(), 2, 1, 0, 4, 10, cpu=0.75, rss=123456789.0)
    s.flush()
    assert s.get("req-2")["internals"] == _steps(3)
    assert s.query("SELECT cpu, rss FROM queue_samples ORDER BY t")[-1][:] == (0.75, 123456789.0)
    assert s.query("SELECT cpu FROM queue_samples ORDER BY t")[0][0] is None  # old samples: no figures
    s.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    conn.close()
    assert {r["request_id"] for r in load_records(str(path)) if r["internals"]} == {"req-2"}


def test_schema_3_postgresql_database_is_migrated_to_4():
    psycopg = pytest.importorskip("psycopg")
    from tests.pg_cluster import shared_cluster

    with shared_cluster().database() as url:
        s = open_store(url, secret="k")
        s.put(_tl(1))
        s.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("ALTER TABLE requests DROP COLUMN internals")
            conn.execute("ALTER TABLE queue_samples DROP COLUMN cpu")
            conn.execute("ALTER TABLE queue_samples DROP COLUMN rss")
            conn.execute("UPDATE tailguard_meta SET value = '3' WHERE name = 'schema_version'")
        s = open_store(url, secret="k", flush_interval=0.01)
        assert s.schema_version == 4
        assert "internals" not in s.get("req-1")
        s.put(_tl(2, internals=_steps(2)))
        s.put_sample(time.time(), 1, 0, 0, 1, 8, cpu=1.5, rss=2.0e8)
        s.flush()
        assert s.get("req-2")["internals"] == _steps(2)
        assert tuple(s.query("SELECT cpu, rss FROM queue_samples")[0]) == (1.5, 2.0e8)
        s.close()
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT value FROM tailguard_meta WHERE name = 'schema_version'").fetchone() == ("4",)
        assert {r["request_id"] for r in load_records(url) if r["internals"]} == {"req-2"}


# --- hotspots -------------------------------------------------------------------------------------------------------
def _record(i: int, layer_ms: list[float], queue: float = 0.010, kind: str = "decode") -> dict:
    n = len(layer_ms)
    attn = [round(v * 0.6, 6) for v in layer_ms]
    return {"request_id": f"r{i}", "stages": {"tokenize": 0.001, "queue": queue, "prefill": 0.05,
                                              "decode": 0.2 + 0.001 * (i % 5), "stream": 0.002},
            "internals": {"heads": [1], "decode_every": 16, "steps": [
                {"kind": kind, "position": 10 + i, "tokens": 1, "batch_tokens": 4, "batch_seqs": 4,
                 "step_ms": sum(layer_ms) + 1, "layer_ms": layer_ms, "attn_ms": attn,
                 "mlp_ms": [round(v - a, 6) for v, a in zip(layer_ms, attn)], "norm": [1.0] * n,
                 "entropy": [[1.0]] * n}]}}


def test_hotspots_mark_an_injected_slow_layer_and_stage():
    rng = random.Random(5)
    records = []
    for i in range(30):
        layers = [1.0 + rng.uniform(-0.05, 0.05) for _ in range(12)]
        layers[7] *= 3.0  # the slow layer
        records.append(_record(i, layers, queue=0.010 + rng.uniform(-0.001, 0.001)))
    records[17]["stages"]["queue"] = 0.5  # one request waited far longer
    rep = find_hotspots(records)
    decode = rep["layers"]["decode"]
    assert [h["layer"] for h in decode["hot_layers"]] == [7]
    assert decode["hot_share"][7] == 1.0 and max(decode["hot_share"][:7] + decode["hot_share"][8:]) == 0.0
    slow = rep["stages"]["slow"]
    assert [(e["request_id"], e["stage"]) for e in slow] == [("r17", "queue")]
    assert slow[0]["sampled"] is True and slow[0]["z"] > 2
    # Without the injections nothing is hot.
    calm = [_record(i, [1.0 + 0.01 * (j % 3) for j in range(12)]) for i in range(30)]
    rep = find_hotspots(calm)
    assert rep["layers"]["decode"]["hot_layers"] == [] and rep["stages"]["slow"] == []


def test_hotspots_judge_kinds_apart_and_refuse_too_few_layers():
    # Prefill layers 100x slower than decode layers: judged together, every prefill layer would look hot.
    records = [_record(i, [1.0] * 8) for i in range(10)] + [_record(100 + i, [100.0] * 8, kind="prefill")
                                                           for i in range(10)]
    rep = find_hotspots(records)
    assert rep["layers"]["decode"]["hot_layers"] == [] and rep["layers"]["prefill"]["hot_layers"] == []
    few = find_hotspots([_record(i, [1.0, 9.0]) for i in range(10)])
    assert few["layers"]["decode"]["judged"] is False and few["layers"]["decode"]["hot_layers"] == []


def test_hotspots_cli_reads_a_store(tmp_path, capsys):
    from tailguard.cli import main

    path = tmp_path / "r.sqlite3"
    s = open_store(path, secret="k")
    for i in range(8):
        layers = [0.5] * 10
        layers[3] = 2.0
        s.put(_tl(i, internals=_record(i, layers)["internals"]))
    s.close()
    assert main(["slo", "hotspots", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert "8 records, 8 with sampled internals" in out
    assert [line.split()[0] for line in out.splitlines() if "HOT" in line] == ["3"]
    assert main(["slo", "hotspots", "--store", str(tmp_path / "missing.sqlite3")]) == 2
