"""The timeline: stages telescope to E2E, missing boundaries charge the current stage, TTFT/ITL/TPOT definitions."""

from __future__ import annotations

import pytest

from tailguard.observe.timeline import STAGES, Outcome, Timeline


def _tl(**kw) -> Timeline:
    tl = Timeline(request_id="r", endpoint="/v1/chat/completions", received=100.0, received_unix=1.0e9)
    for k, v in kw.items():
        setattr(tl, k, v)
    return tl


def test_stages_add_up_and_match_boundaries():
    tl = _tl(tokenized=100.001, scheduled=100.011, first_token=100.111, last_token=100.511, stream=True,
             token_times=[100.111, 100.311, 100.511], num_output_tokens=3)
    tl.add_tokens_sent(1, 100.112)
    tl.add_tokens_sent(1, 100.312)
    tl.add_tokens_sent(1, 100.512)
    assert tl.finalize(200, Outcome.SUCCESS, at=100.513)
    s = tl.summary()
    assert list(s.stages) == list(STAGES)
    assert s.stages["tokenize"] == pytest.approx(0.001)
    assert s.stages["queue"] == pytest.approx(0.010)
    assert s.stages["prefill"] == pytest.approx(0.100)
    assert s.stages["decode"] == pytest.approx(0.400)
    assert s.stages["stream"] == pytest.approx(0.002)
    assert sum(s.stages.values()) == pytest.approx(s.e2e, abs=1e-12)
    assert s.e2e == pytest.approx(0.513)
    # Streaming: TTFT and ITL are measured where tokens leave the server.
    assert s.ttft == pytest.approx(0.112)
    assert s.itl == pytest.approx([0.2, 0.2])
    assert s.tpot == pytest.approx((0.513 - 0.112) / 2)


def test_finalize_only_once():
    tl = _tl()
    assert tl.finalize(400, Outcome.INVALID, at=100.5)
    assert not tl.finalize(500, Outcome.ERROR, at=101.0)
    assert tl.status == 400 and tl.outcome is Outcome.INVALID and tl.last_byte == 100.5


def test_rejected_request_charges_the_stage_it_was_in():
    # Refused after tokenization (queue full): everything after tokenization is queue time.
    tl = _tl(tokenized=100.002)
    tl.finalize(429, Outcome.REJECTED, at=100.003)
    s = tl.summary()
    assert s.stages["tokenize"] == pytest.approx(0.002)
    assert s.stages["queue"] == pytest.approx(0.001)
    assert s.stages["prefill"] == s.stages["decode"] == s.stages["stream"] == 0
    assert s.ttft is None and s.tpot is None
    assert sum(s.stages.values()) == pytest.approx(s.e2e, abs=1e-12)


def test_abort_without_scheduling_time_counts_as_queue():
    # The engine reports first_scheduled only on its final event; an aborted stream never gets it.
    tl = _tl(tokenized=100.001, first_token=100.2, token_times=[100.2, 100.3], stream=True)
    tl.add_tokens_sent(2, 100.31)
    tl.finalize(499, Outcome.ABORTED, at=100.4)
    s = tl.summary()
    assert s.stages["queue"] == pytest.approx(0.199)
    assert s.stages["prefill"] == 0
    assert sum(s.stages.values()) == pytest.approx(s.e2e, abs=1e-12)


def test_chunk_of_k_tokens_gives_k_minus_1_zero_gaps():
    tl = _tl(stream=True, token_times=[100.1, 100.2, 100.3], num_output_tokens=3)
    tl.add_tokens_sent(1, 100.11)
    tl.add_tokens_sent(2, 100.31)  # the second token had no visible text: it left with the third
    tl.finalize(200, Outcome.SUCCESS, at=100.32)
    assert tl.summary().itl == pytest.approx([0.2, 0.0])


def test_non_streaming_uses_engine_token_times_and_server_timing():
    tl = _tl(tokenized=100.001, scheduled=100.002, first_token=100.05, last_token=100.09,
             token_times=[100.05, 100.07, 100.09], num_output_tokens=3)
    tl.finalize(200, Outcome.SUCCESS, at=100.1)
    s = tl.summary()
    assert s.ttft == pytest.approx(0.05)
    assert s.itl == pytest.approx([0.02, 0.02])
    header = tl.server_timing()
    parts = dict(p.split(";dur=") for p in header.split(", "))
    assert set(parts) == {*STAGES, "ttft", "total"}
    assert float(parts["total"]) == pytest.approx(100.0, abs=1e-3)
    assert sum(float(parts[k]) for k in STAGES) == pytest.approx(float(parts["total"]), abs=0.01)


def test_out_of_order_timestamps_are_clamped_monotone():
    tl = _tl(tokenized=100.01, scheduled=100.005, first_token=100.02, last_token=100.03)
    tl.finalize(200, Outcome.SUCCESS, at=100.04)
    s = tl.summary()
    assert all(v >= 0 for v in s.stages.values())
    assert sum(s.stages.values()) == pytest.approx(s.e2e, abs=1e-12)


def test_record_shape():
    tl = _tl(tokenized=100.001, scheduled=100.002, first_token=100.01, last_token=100.02,
             token_times=[100.01, 100.02], num_output_tokens=2, num_prompt_tokens=7, finish_reason="length")
    tl.finalize(200, Outcome.SUCCESS, at=100.03)
    rec = tl.to_record()
    assert rec["outcome"] == "success" and rec["status"] == 200
    assert rec["timestamps"]["received"] == 0.0 and rec["timestamps"]["last_byte"] == pytest.approx(0.03)
    assert rec["token_times"] == pytest.approx([0.01, 0.02])
    assert "prompt_text" not in rec
