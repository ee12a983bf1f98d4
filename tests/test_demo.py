"""``tailguard demo``: its report (per-request timelines from the server's records, clipped outputs, ids that do not
wrap, the machine and why the SLO profiles fail), the host-load measurement, and one small end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailguard import demo
from tailguard.demo_report import (
    DemoRecord,
    burst_figure,
    clip,
    describe_hardware,
    describe_load,
    explain_slo,
    gap_threshold,
    load_between,
    parse_proc_stat,
    prefill_spans,
    segments,
    split,
    step_ends,
    what_to_look_at,
    write_report,
)


def record(rid: str, origin: float, ts: dict[str, float], tokens: list[float], sent: list[float] | None = None,
           prompt: str = "Write a haiku about the sea.", output: str = "waves") -> DemoRecord:
    """A request as the demo keeps it: times relative to its arrival at ``origin`` (seconds since the burst)."""
    ts = {"received": 0.0, **ts}
    sent = tokens if sent is None else sent
    e2e = ts["last_byte"]
    return DemoRecord(
        request_id=rid, prompt=prompt, prompt_tokens=40, output_tokens=len(tokens),
        stages={"tokenize": ts["tokenized"], "queue": ts["scheduled"] - ts["tokenized"],
                "prefill": ts["first_token"] - ts["scheduled"], "decode": ts["last_token"] - ts["first_token"],
                "stream": ts["last_byte"] - ts["last_token"]},
        ttft_s=sent[0], e2e_s=e2e, tpot_s=0.05, client_ttft_s=sent[0], client_e2e_s=e2e, finish_reason="length",
        output=output, start_offset_s=origin, lang="zh" if "请" in prompt else "en", received_offset_s=origin,
        timestamps={**ts, "first_sent": sent[0]}, token_times=tokens, token_sent=sent)


@pytest.fixture
def burst() -> list[DemoRecord]:
    """Two requests. ``a`` decodes steadily from 0.10 s at one token per 50 ms until, at 0.25 s, ``b``'s prompt is
    computed in two engine steps (0.25-0.60, 0.60-0.95): a gets no token in between. Its first tokens are held
    until 0.20 s. ``b`` arrives at 0.05 s and waits in the queue until 0.25 s."""
    a = record("req-a", 0.0, {"tokenized": 0.01, "queued": 0.01, "scheduled": 0.02, "first_token": 0.10,
                              "last_token": 1.05, "last_byte": 1.06},
               [0.10, 0.15, 0.20, 0.25, 0.95, 1.00, 1.05],
               sent=[0.20, 0.20, 0.20, 0.25, 0.95, 1.00, 1.05], prompt="请解释一下为什么天空是蓝色的。",
               output="天空是蓝色的")
    # b's prefill takes two steps: the first ends at 0.60 (a decode step of neither: c's token marks it).
    b = record("req-b", 0.05, {"tokenized": 0.02, "queued": 0.02, "scheduled": 0.20, "first_token": 0.90,
                               "last_token": 1.00, "last_byte": 1.01}, [0.90, 0.95, 1.00])
    c = record("req-c", 0.0, {"tokenized": 0.01, "queued": 0.01, "scheduled": 0.55, "first_token": 0.60,
                              "last_token": 0.60, "last_byte": 0.61}, [0.60])
    return [a, b, c]


def test_clip_cuts_at_a_word_and_says_so():
    text = "The waves of the sea, a silver line under the moon"
    out = clip(text, 24)
    assert out.endswith("…") and len(out) <= 24
    kept = out[:-1]
    assert text.startswith(kept) and text[len(kept)] in " ,"  # a whole word, never half of one
    assert clip("short\nanswer", 40) == "short answer"  # one line, untouched when it fits
    zh = clip("天空是蓝色的因为瑞利散射使短波长的光散射得更多", 10)
    assert zh == "天空是蓝色的因为瑞…"  # 10 characters, the ellipsis one of them


def test_step_ends_are_the_instants_that_tokens_came_out(burst):
    steps = step_ends(burst)
    # a's 0.95 and b's 0.95 (0.05 + 0.90) are one step; c's token at 0.60 is one too.
    assert steps == pytest.approx([0.10, 0.15, 0.20, 0.25, 0.60, 0.95, 1.00, 1.05])


def test_segments_split_prefill_by_step_and_show_the_decode_gap(burst):
    a, b, _ = burst
    steps, spans = step_ends(burst), prefill_spans(burst)
    threshold = gap_threshold(burst)
    seg_a = segments(a, steps, threshold, spans)
    assert [s.stage for s in seg_a] == ["tokenize", "queue", "prefill", "decode", "decode", "decode", "decode gap",
                                        "decode", "decode", "stream"]
    gap = next(s for s in seg_a if s.stage == "decode gap")
    assert (gap.start, gap.end) == pytest.approx((0.25, 0.95))
    # b's and c's prompts were computed within the gap; an engine step (c's token at 0.60) ended without a token
    assert "prompts of 2 other requests" in gap.note and "1 engine step ended without a token" in gap.note
    # b's prefill ran over two engine steps, cut where c's token came out
    seg_b = segments(b, steps, threshold, spans)
    prefill = [t for s in seg_b if s.stage == "prefill" for t in (s.start, s.end)]
    assert prefill == pytest.approx([0.25, 0.60, 0.60, 0.95])
    # the segments tile the request end to end: they add up to its E2E
    for r, segs in ((a, seg_a), (b, seg_b)):
        assert sum(s.end - s.start for s in segs) == pytest.approx(r.e2e_s)
        assert all(x.end == pytest.approx(y.start) for x, y in zip(segs, segs[1:]))
    t = split(a, seg_a)
    assert t["waiting"] == pytest.approx(0.10)  # made at 0.10, first sent at 0.20
    assert t["prefill steps"] == 1 and t["gaps"] == 1 and t["decode gap"] == pytest.approx(0.70)


def test_a_gap_with_steps_and_no_prefill_is_a_pause():
    a = record("a", 0.0, {"tokenized": 0.0, "queued": 0.0, "scheduled": 0.0, "first_token": 0.1, "last_token": 0.9,
                          "last_byte": 0.9}, [0.1, 0.15, 0.2, 0.9])
    b = record("b", 0.0, {"tokenized": 0.0, "queued": 0.0, "scheduled": 0.0, "first_token": 0.1, "last_token": 0.4,
                          "last_byte": 0.4}, [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4])
    recs = [a, b]
    gap = next(s for s in segments(a, step_ends(recs), gap_threshold(recs), prefill_spans(recs))
               if s.stage == "decode gap")
    assert "4 engine steps ended without a token for this request (paused or preempted)" in gap.note
    assert "prompts" not in gap.note


def test_the_figure_draws_each_stage_as_recorded(burst):
    fig = burst_figure(burst)
    traces = {t.name: t for t in fig.data if t.name}
    assert len(traces["prefill"].x) == 4  # a: 1 step, b: 2 steps, c: 1 step
    assert len(traces["decode gap"].x) == 1 and traces["decode gap"].x[0] == pytest.approx(0.70)
    assert list(traces["waiting (made, not sent)"].base) == pytest.approx([0.10])
    assert list(traces["first token sent (TTFT)"].x) == pytest.approx([0.20, 0.95, 0.60])


def test_host_load_is_what_other_processes_used():
    stat = "cpu  100 0 50 1000 10 0 0 5 0 0\ncpu0 50 0 25 500 5 0 0 2 0 0\n"
    assert parse_proc_stat(stat) == {"busy": 150, "idle": 1010, "steal": 5}
    start = (10.0, {"busy": 150, "idle": 1010, "steal": 5}, 3.0)
    end = (12.0, {"busy": 450, "idle": 1110, "steal": 25}, 4.0)  # 3 CPU-s busy in 2 s, 1 of them ours
    load = load_between(start, end, hz=100, cpus=2)
    assert load["host_busy_cores"] == pytest.approx(1.5) and load["own_cores"] == pytest.approx(0.5)
    assert load["others_cores"] == pytest.approx(1.0) and load["steal_cores"] == pytest.approx(0.1)
    text = describe_load(load, "the burst")
    assert "other processes 1.00 of the 2 cores" in text and "steal" in text and "competition" in text
    assert "too short" in describe_load({**load, "wall_s": 0.05}, "the burst")


def test_hardware_is_named():
    hw = {"cpu_model": "Some CPU", "logical_cpus": 2, "usable_cpus": 2, "device": "cpu", "gpus": [],
          "compute_threads": 2}
    text = describe_hardware(hw)
    assert "Some CPU" in text and "2 of 2 logical CPUs" in text and "GPU: none found" in text and "on the CPU" in text
    assert "GPU: NVIDIA H100" in describe_hardware({**hw, "gpus": ["NVIDIA H100"], "device": "cuda"})


BENCH = {
    "run": {"workload": {"output_tokens": 32}},
    "metrics": {"tpot": {"percentiles": {"p50": {"value": 0.021}}}},
    "stages": {"mean_s": {"prefill": 0.143, "queue": 0.019}, "labels": {"queue": "queue wait"},
               "share_of_e2e": {"tokenize": 0.001, "queue": 0.02, "prefill": 0.17, "decode": 0.8}},
    "slo": {
        "baseline": {"pass": False, "checks": [
            {"objective": "E2E P50 <= 450 ms", "metric": "e2e", "status": "fail", "value_s": 0.81,
             "threshold_s": 0.45},
            {"objective": "E2E P99 <= 2 s", "metric": "e2e", "status": "pass", "value_s": 1.1, "threshold_s": 2.0}]},
        "advanced": {"pass": False, "checks": [
            {"objective": "E2E P50 <= 450 ms", "metric": "e2e", "status": "fail", "value_s": 0.81,
             "threshold_s": 0.45},
            {"objective": "TTFT P99 <= 350 ms", "metric": "ttft", "status": "fail", "value_s": 0.446,
             "threshold_s": 0.35}]},
        "custom": {"pass": True, "checks": []},
    },
}


def test_the_slo_failures_are_explained_from_the_run():
    lines = explain_slo(BENCH, {"device": "cpu", "usable_cpus": 2, "gpus": []})
    assert "baseline FAIL, advanced FAIL, custom PASS" in lines[0] and "GPU" in lines[0] and "2 cores" in lines[0]
    e2e = next(ln for ln in lines if ln.startswith("E2E P50"))
    # 31 tokens after the first at 21 ms each: 651 ms of decode, over the 450 ms bound by itself
    assert "measured 810 ms, 1.8x the bound" in e2e and "651 ms in decode alone" in e2e and "already over" in e2e
    ttft = next(ln for ln in lines if ln.startswith("TTFT P99"))
    assert "143 ms" in ttft and "19 ms" in ttft
    assert len([ln for ln in lines if ln.startswith("E2E P50")]) == 1  # one check failing in two profiles: once
    assert not any(ln.startswith("E2E P99") for ln in lines)  # a passing check is not explained
    assert "decode 80%, prefill 17%, queue wait 2% of E2E" in lines[1]
    assert "miss them" in lines[0]
    assert explain_slo({}, {}) == []
    passing = {"slo": {"baseline": {"pass": True, "checks": [{"objective": "E2E P50", "status": "pass"}]}}}
    said = explain_slo(passing, {"device": "cpu", "usable_cpus": 2, "gpus": []})[0]
    assert "met them all" in said and "miss them" not in said  # no misses announced when there are none


def test_the_report_says_what_the_run_shows(tmp_path, burst):
    long_out = "The capital of France is Paris, a city on the Seine with many museums and " * 3
    burst[1].output = long_out
    summary = {"requests": 3, "model": "smollm2", "weight_format": "auto", "device": "cpu", "output_tokens": 11,
               "wall_s": 1.06, "tokens_per_s": 10.4, "percentiles": {"TTFT": {"p50": 0.2, "p95": 0.9, "p99": 0.95}},
               "hardware": {"cpu_model": "Some CPU", "logical_cpus": 2, "usable_cpus": 2, "device": "cpu", "gpus": []},
               "host_load": {"wall_s": 1.06, "cpus": 2, "host_busy_cores": 1.9, "own_cores": 1.0,
                             "others_cores": 0.9, "steal_cores": 0.0},
               "warmup_note": "Before the burst: 3 warm-up requests."}
    path = tmp_path / "report.html"
    write_report(burst, summary, path, Path("bench/report.html"), BENCH)
    page = path.read_text()
    assert "td.id,th{white-space:nowrap}" in page and "<td class='id'>req-a</td>" in page
    assert "GPU: none found" in page and "other processes 0.90 of the 2 cores" in page
    assert "Before the burst: 3 warm-up requests." in page
    assert "651 ms in decode alone" in page  # the SLO explanation
    assert "Slowest first token: req-b" in page
    # the output is clipped at a word with an ellipsis; all of it is in the cell's title
    assert f"title='{long_out}'" in page
    cell = page.split(f"title='{long_out}'>", 1)[1].split("</td>", 1)[0]
    assert cell.endswith("…") and long_out.startswith(cell[:-1]) and long_out[len(cell) - 1] in " ,"


def test_what_to_look_at_names_the_slowest_request(burst):
    lines = what_to_look_at(burst)
    assert lines[0].startswith("Slowest first token: req-b (en): TTFT 900 ms")
    assert "prefill 700 ms over 2 engine steps" in lines[0]
    lang = next(ln for ln in lines if ln.startswith("Language"))
    assert "the first tokens waited (made, not yet sent) 0 ms and 100 ms" in lang and "Chinese character" in lang


def test_wait_quiet_gives_up_after_its_bound(monkeypatch):
    import asyncio

    class Busy:
        def __enter__(self):
            return self

        def measure(self):
            return {"others_cores": 1.5}

    monkeypatch.setattr(demo, "HostLoad", Busy)
    out = asyncio.run(demo.wait_quiet(max_wait_s=0.05, window_s=0.01))
    assert out["quiet"] is False and out["others_cores"] == 1.5 and out["waited_s"] >= 0.05


def test_demo_end_to_end_on_the_tiny_model(tmp_path, monkeypatch):
    from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2")  # the tiny model borrows the real model's tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")
    from tailguard.cli import build_parser

    monkeypatch.setattr(demo, "QUIET_WAIT_S", 0.0)
    args = build_parser().parse_args(["demo", "--model", "tiny", "--requests", "4", "--max-tokens", "6",
                                      "--bench-requests", "0", "--output-dir", str(tmp_path)])
    assert demo.run_demo(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    s, recs = res["summary"], res["requests"]
    assert [r["request_id"].rsplit("-", 1)[1] for r in recs] == ["000", "001", "002", "003"]  # no warm-up record
    assert s["hardware"]["device"] == "cpu" and s["warmup_s"] > 0 and s["engine_steps"] > 0
    assert s["host_load"] is None or {"others_cores", "own_cores", "steal_cores"} <= set(s["host_load"])
    for r in recs:
        assert len(r["token_times"]) == r["output_tokens"] and r["received_offset_s"] is not None
        assert r["timestamps"]["first_token"] <= r["timestamps"]["first_sent"]
    # The warm-up has a system prompt of its own: it leaves nothing in the prefix cache that the burst's first
    # prompt could reuse, so at least one burst request computed its whole prompt.
    assert min(r["cached_prompt_tokens"] for r in recs) == 0
    page = (tmp_path / "report.html").read_text()
    assert recs[0]["request_id"] in page and "What this run shows" in page



@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_console_table_never_wraps_or_cuts_ids_and_figures(burst, width):
    from rich.console import Console

    console = Console(width=width, record=True)
    console.print(demo._table(burst, width))
    text = console.export_text()
    rows = [ln for ln in text.splitlines() if "req-" in ln]
    assert len(rows) == len(burst)  # one line per request: nothing wrapped
    for r, line in zip(burst, rows):
        assert r.request_id in line and f"{r.e2e_s * 1000:.0f}" in line  # whole id, whole E2E
        assert max(len(ln) for ln in text.splitlines()) <= width
    assert ("output" in text) == (width >= 175)  # the extras go first on a narrow console
