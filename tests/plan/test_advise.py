"""``tailguard advise``: the stage rule, the seed's tree, the measured-effects table, refusals and bad input."""

from __future__ import annotations

import json

import pytest

from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.cli import main
from tailguard.plan.advise import advise, load_effects, read_results, tail_composition
from tailguard.plan.capacity import ServiceProfile

STAGES = ("tokenize", "queue", "prefill", "decode", "stream", "network_client")


def bench_result(tail: dict[str, float], *, requests: int = 500, slo_pass: bool = False, mode: str = "server",
                 prompt_tokens: float = 200.0, body: dict[str, float] | None = None) -> dict:
    """A bench results.json in the shape ``tailguard bench`` writes, with a chosen stage mix in the P99 band."""
    body = body or {s: tail.get(s, 0.0) / 3 for s in STAGES}
    p99 = sum(tail.values())
    return {
        "schema": "tailguard.bench/v1",
        "summary": {"requests": {"sent": requests, "measured": requests, "completed": requests, "failed": 0},
                    "throughput": {"requests_per_s": 2.0, "offered_requests_per_s": 2.2}},
        "metrics": {"e2e": {"percentiles": {"p50": {"value": sum(body.values())}, "p99": {"value": p99}}}},
        "tokens": {"prompt_tokens": {"server_total": prompt_tokens * requests}, "output_tokens_total": 48 * requests},
        "stages": {
            "mode": mode, "stages": list(STAGES), "labels": {s: s for s in STAGES},
            "requests": requests,
            "p99_band_mean_s": {s: tail.get(s, 0.0) for s in STAGES},
            "bands": [{"band": "P90-P99", "requests": requests // 10, "mean_s": body},
                      {"band": "> P99", "requests": requests // 100, "mean_s": {s: tail.get(s, 0.0) for s in STAGES}}],
            "cannot_split": [],
        },
        "slo": {"baseline": {"profile": "baseline", "pass": slo_pass, "evaluated": 4,
                             "checks": [{"status": "pass" if slo_pass else "fail", "certain": True}]}},
        "bench_health": {"cpus": 2, "bench_is_bottleneck": False},
    }


QUEUE_HEAVY = {"tokenize": 0.01, "queue": 2.0, "prefill": 0.3, "decode": 0.5, "stream": 0.01, "network_client": 0.02}
PREFILL_HEAVY = {"tokenize": 0.01, "queue": 0.1, "prefill": 1.8, "decode": 0.4, "stream": 0.01, "network_client": 0.02}


def test_queue_dominated_tail_gets_batching_first():
    a = advise(bench_result(QUEUE_HEAVY))
    assert a["status"] == "recommend"
    assert a["attack_first"] == ["queue"]
    assert a["tail_composition"][0]["stage"] == "queue" and a["tail_composition"][0]["share"] > 0.7
    first = a["recommendations"][0]
    assert first["stage"] == "queue" and first["key"] == "continuous_batching" and first["tree_pick"]
    keys = [r["key"] for r in a["recommendations"]]
    assert "forecast_driven_batching" in keys and "scale_out" in keys


def test_prefill_dominated_tail_gets_prefill_techniques():
    a = advise(bench_result(PREFILL_HEAVY))
    assert a["attack_first"] == ["prefill"]
    keys = [r["key"] for r in a["recommendations"]]
    assert all(r["stage"] == "prefill" for r in a["recommendations"])
    assert "prefix_caching" in keys and "speculative_decoding" not in keys
    assert "attention_slicing" not in keys  # 200-token prompts: not the long-context case
    long = advise(bench_result(PREFILL_HEAVY, prompt_tokens=12_000))
    assert "attention_slicing" in [r["key"] for r in long["recommendations"]]


def test_every_stage_over_20_percent_is_attacked_and_the_tree_orders_techniques():
    mixed = {"queue": 0.3, "prefill": 0.1, "decode": 0.6, "tokenize": 0.0, "stream": 0.0, "network_client": 0.0}
    budget = advise(bench_result(mixed), priority="budget")
    assert budget["attack_first"] == ["decode", "queue"]
    decode = [r for r in budget["recommendations"] if r["stage"] == "decode"]
    assert decode[0]["key"] == "speculative_decoding"
    memory = advise(bench_result(mixed), priority="memory")
    decode = [r for r in memory["recommendations"] if r["stage"] == "decode"]
    assert decode[0]["key"] == "kv_cache_quantization"
    with pytest.raises(ValueError):
        advise(bench_result(mixed), priority="cheap")


def test_expected_effects_come_from_the_measured_table():
    effects = load_effects()
    a = advise(bench_result(QUEUE_HEAVY))
    for r in a["recommendations"]:
        entry = effects[r["key"]]
        if entry["p99_effect"] is None:
            assert r["expected"] == "not measured on this engine yet"
        else:
            assert r["expected"] == entry["p99_effect"]
        assert r["seed_claim"] == entry["seed_claim"]


def test_refuses_on_too_few_requests():
    a = advise(bench_result(QUEUE_HEAVY, requests=40))
    assert a["status"] == "insufficient_data" and not a["recommendations"]
    assert "too few requests" in a["reasons"][0]
    assert advise(bench_result(QUEUE_HEAVY, requests=40), min_requests=20)["status"] == "recommend"


def test_refuses_without_a_stage_breakdown_and_when_the_slo_is_met():
    client = bench_result(QUEUE_HEAVY, mode="client")
    a = advise(client)
    assert a["status"] == "no_stage_breakdown" and not a["recommendations"]
    met = advise(bench_result(QUEUE_HEAVY, slo_pass=True))
    assert met["status"] == "slo_met" and not met["recommendations"]
    assert met["tail_composition"][0]["stage"] == "queue"  # still shown


def test_fired_golden_rules_are_reported_even_when_the_slo_is_met():
    r = bench_result(QUEUE_HEAVY, slo_pass=True)
    r["advisories"] = [{"metric": "e2e", "rule": "P99 > 3 x P50", "ratio": 3.4, "fired": True,
                        "action": "plan improvements now"},
                       {"metric": "e2e", "rule": "P99 > 1.5 x P95", "ratio": 1.1, "fired": False, "action": None}]
    a = advise(r)
    assert a["status"] == "slo_met"
    assert [g["rule"] for g in a["golden_rules_fired"]] == ["P99 > 3 x P50"]
    assert any("P99 > 3 x P50" in n and "plan improvements now" in n for n in a["notes"])


def test_a_spread_tail_has_no_dominant_stage():
    spread = dict.fromkeys(STAGES, 1.0)
    a = advise(bench_result(spread))
    assert a["status"] == "no_dominant_stage" and not a["attack_first"]


def test_network_share_is_reported_not_treated_by_the_engine():
    net = {"queue": 0.1, "decode": 0.2, "network_client": 1.5}
    a = advise(bench_result(net))
    assert "network_client" in a["attack_first"]
    assert all(r["stage"] != "network_client" for r in a["recommendations"])
    assert any("network" in n for n in a["notes"])


def test_planner_settings_when_an_engine_profile_is_given():
    prof = ServiceProfile(1, 1, 800.0, {1: 90.0, 16: 360.0})
    a = advise(bench_result(QUEUE_HEAVY), engine_profile=prof)
    s = next(r for r in a["recommendations"] if r["key"] == "continuous_batching")["suggested"]
    assert s["at_requests_per_s"] == 2.2 and 2 <= s["max_num_seqs"] <= 16 and s["replicas"] >= 1


def test_a_thin_p99_band_is_said():
    a = advise(bench_result(QUEUE_HEAVY, requests=150))  # one request beyond the P99
    assert a["status"] == "recommend" and any("beyond the P99" in n for n in a["notes"])
    assert not any("beyond the P99" in n for n in advise(bench_result(QUEUE_HEAVY, requests=2000))["notes"])


def test_cli_engine_throughput_file(tmp_path, capsys):
    f = tmp_path / "results.json"
    f.write_text(json.dumps(bench_result(QUEUE_HEAVY)), encoding="utf-8")
    eng = tmp_path / "engine.json"
    eng.write_text(json.dumps({"results": {"tailguard native": {"prefill_tps": {"median": 800.0}, "aggregate": {
        "1": {"steady_tps": {"median": 90.0}}, "16": {"steady_tps": {"median": 360.0}}}}}}), encoding="utf-8")
    assert main(["advise", str(f), "--json", "--engine-throughput", str(eng)]) == 0
    recs = json.loads(capsys.readouterr().out)["recommendations"]
    assert next(r for r in recs if r["key"] == "scale_out")["suggested"]["replicas"] >= 1
    assert main(["advise", str(f), "--engine-throughput", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["advise", str(f), "--engine-throughput", str(f)]) == 2  # a bench result is no throughput result
    assert "engine_throughput" in capsys.readouterr().err


def test_tail_composition_shares_add_up():
    rows = tail_composition(bench_result(QUEUE_HEAVY)["stages"])
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert [r["share"] for r in rows] == sorted((r["share"] for r in rows), reverse=True)


# --- the command ----------------------------------------------------------------------------------------------------

def test_cli_json_and_text(tmp_path, capsys):
    f = tmp_path / "results.json"
    f.write_text(json.dumps(bench_result(QUEUE_HEAVY)), encoding="utf-8")
    assert main(["advise", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "tailguard.advise/v1" and out["attack_first"] == ["queue"]
    assert main(["advise", str(tmp_path)]) == 0  # the run's directory works too
    text = capsys.readouterr().out
    assert "queue" in text and "not measured on this engine yet" in text


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ('{"schema": "something/else"}', "not a tailguard bench result"),
    ("[1, 2]", "not a tailguard bench result"),
])
def test_cli_bad_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    f = tmp_path / "r.json"
    if content is not None:
        f.write_text(content, encoding="utf-8")
    assert main(["advise", str(f)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    with pytest.raises(ValueError):
        read_results(f)


def test_advise_reads_what_tailguard_bench_writes(tmp_path, capsys):
    """End to end: a real bench run against the fake server, whose decode (slow chunks) dominates the tail."""
    profile = tmp_path / "tight.yaml"
    profile.write_text("name: tight\nobjectives:\n  - {metric: e2e, percentile: 99, threshold: 20ms}\n")
    out = tmp_path / "run"
    with FakeServerProcess(FakeScript(ttft=0.005, itl=0.012, max_lifetime=120)) as srv:
        rc = main(["bench", "--url", srv.url, "--model", "fake", "--rate", "80", "--num-requests", "120",
                   "--output-tokens", "8", "--tokenizer", "approx", "--bootstrap", "100", "--quiet",
                   "--profiles", "baseline", "--profiles-file", str(profile), "--output-dir", str(out)])
    assert rc == 0
    capsys.readouterr()
    assert main(["advise", str(out / "results.json"), "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert a["stage_mode"] == "server" and a["requests"] == 120
    assert a["status"] == "recommend" and a["attack_first"][0] == "decode"
    assert a["recommendations"][0]["stage"] == "decode"
