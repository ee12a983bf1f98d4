"""The server's clock stops while the answer waits for the client to read (``Timeline.client_waits``): whether the
engine stopped producing during the wait (a lazy producer, an upstream read paused behind the client) or went on
queueing tokens, the figures are what a reader that kept up would have seen, and the record keeps what happened."""

from __future__ import annotations

import pytest

from tailguard.observe.timeline import Outcome, Timeline


def _stream(**kw) -> Timeline:
    tl = Timeline(request_id="r", endpoint="/v1/chat/completions", received=100.0, received_unix=1.0e9, stream=True,
                  tokenized=100.001, scheduled=100.002)
    for k, v in kw.items():
        setattr(tl, k, v)
    return tl


def test_a_producer_held_back_by_the_wait_loses_the_wait():
    # Tokens every 0.1 s; the 4th token's write waits 5 s for the client, and the engine makes nothing meanwhile (it
    # is asked for the next token only after the write): the 5th comes 0.1 s after the wait.
    made = [100.1, 100.2, 100.3, 100.4, 105.5]
    tl = _stream(first_token=100.1, last_token=105.5, token_times=made, num_output_tokens=5)
    for t in made[:3]:
        tl.add_tokens_sent(1, t)
    tl.client_waited(100.4, 105.4)
    tl.add_tokens_sent(1, 105.4)
    tl.add_tokens_sent(1, 105.5)
    tl.finalize(200, Outcome.SUCCESS, at=105.5)
    s = tl.summary()
    assert tl.client_wait == pytest.approx(5.0)
    assert s.itl == pytest.approx([0.1] * 4)
    assert s.ttft == pytest.approx(0.1)
    assert s.e2e == pytest.approx(0.5)
    assert s.tpot == pytest.approx(0.1)
    assert s.stages["decode"] == pytest.approx(0.4)
    assert sum(s.stages.values()) == pytest.approx(s.e2e, abs=1e-12)
    rec = tl.to_record()
    # The record: figures on the server's clock, timestamps as they happened, the wait on its own.
    assert rec["e2e"] == pytest.approx(0.5) and rec["timestamps"]["last_byte"] == pytest.approx(5.5)
    assert rec["token_sent"][3] == pytest.approx(5.4)
    assert rec["client_wait"] == pytest.approx(5.0) and rec["client_waits"] == [[pytest.approx(0.4), 5.4]]


def test_an_engine_that_keeps_producing_is_timed_as_it_produced():
    # The 3rd token's write waits 5 s; the engine goes on making a token every 0.1 s (queued), and they leave in a
    # burst after the wait: to a reader that kept up they would have left as they were made.
    made = [100.0 + 0.1 * k for k in range(1, 11)]
    tl = _stream(first_token=made[0], last_token=made[-1], token_times=made, num_output_tokens=10)
    tl.add_tokens_sent(1, made[0])
    tl.add_tokens_sent(1, made[1])
    tl.client_waited(100.3, 105.3)
    for k in range(8):
        tl.add_tokens_sent(1, 105.3 + 0.001 * k)
    tl.finalize(200, Outcome.SUCCESS, at=105.31)
    s = tl.summary()
    assert s.itl == pytest.approx([0.1] * 9)
    assert s.e2e == pytest.approx(1.0)
    assert s.tpot == pytest.approx(0.1)
    assert sum(s.stages.values()) == pytest.approx(s.e2e, abs=1e-12)


def test_no_wait_changes_nothing():
    tl = _stream(first_token=100.1, last_token=100.3, token_times=[100.1, 100.2, 100.3], num_output_tokens=3)
    for t in (100.11, 100.21, 100.31):
        tl.add_tokens_sent(1, t)
    tl.finalize(200, Outcome.SUCCESS, at=100.32)
    s = tl.summary()
    assert s.e2e == pytest.approx(0.32) and s.itl == pytest.approx([0.1, 0.1])
    assert tl.client_wait == 0 and "client_wait" not in tl.to_record()
