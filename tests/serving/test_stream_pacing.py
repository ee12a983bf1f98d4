"""Stream pacing that holds its budget: tokens held by a lane's pacing (``pace_itl_s``) or flushing
(``flush_every``) leave within the budget even when the engine goes quiet after a burst, by a timer, not only when
the next token comes. Measured from the server's own record: each token's send time against the time it was made."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import httpx
import pytest

from tailguard.engine.events import TokenEvent
from tailguard.engine.fake import FakeEngine
from tailguard.engine.sequence import FinishReason, SamplingParams
from tailguard.serving.respond import FLUSH_TIMER_S
from tests.serving_helpers import fake_server, settle

BURST, PAUSE_S, TOKENS = 4, 0.4, 12


class BurstyEngine(FakeEngine):
    """Tokens in bursts of ``BURST`` at once, then ``PAUSE_S`` of silence: an engine whose step made several tokens
    (speculation, a batched step) and then stalled behind other work."""

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                       priority: int = 0, arrival_time: float | None = None) -> AsyncGenerator[TokenEvent, None]:
        start = time.perf_counter()
        first = None
        for i in range(TOKENS):
            if i and i % BURST == 0:
                await asyncio.sleep(PAUSE_S)
            now = time.perf_counter()
            first = first or now
            yield TokenEvent(request_id, 65 + i % 26, chr(65 + i % 26), now)
        yield TokenEvent(request_id, None, "", time.perf_counter(), finished=True, finish_reason=FinishReason.LENGTH,
                         num_prompt_tokens=len(prompt_token_ids), num_output_tokens=TOKENS, arrival=arrival_time,
                         first_scheduled=start, first_token=first)


def _late(tmp_path: Path, lane: dict) -> tuple[float, str]:
    """The most any token waited at the server between being made and being sent, and the answer's text."""
    with fake_server(tmp_path, engine=BurstyEngine(), lanes={"standard": {"priority": 1, **lane}}) as s:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS,
                "stream": True}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        settle(s)
        rec = s.state.store.get(r.headers["x-request-id"])
    return max(sent - made for sent, made in zip(rec["token_sent"], rec["token_times"], strict=True)), text


@pytest.mark.parametrize(("lane", "budget"), [({"pace_itl_s": 0.05, "flush_every": 8}, 0.05),
                                             ({"flush_every": 8}, FLUSH_TIMER_S)])
def test_held_tokens_leave_within_the_budget_when_the_engine_goes_quiet(tmp_path, lane, budget):
    late, text = _late(tmp_path, lane)
    assert text == "".join(chr(65 + i % 26) for i in range(TOKENS))  # every token, in order
    # Without the timer the tokens held after a burst wait for the next burst: PAUSE_S (0.4 s) late.
    assert late < budget + 0.15 < PAUSE_S


def test_without_pacing_each_token_leaves_as_it_comes(tmp_path):
    late, _ = _late(tmp_path, {})
    assert late < 0.1


class SteadyBurstsEngine(FakeEngine):
    """Keeps up on average (20 tokens/s) but in bursts: 4 tokens at once every 0.2 s, as a speculating engine's
    accepted guesses or a replica's batched steps come."""

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                       priority: int = 0, arrival_time: float | None = None) -> AsyncGenerator[TokenEvent, None]:
        start = time.perf_counter()
        n = sampling.max_tokens
        for i in range(n):
            if i and i % 4 == 0:
                await asyncio.sleep(0.2)
            yield TokenEvent(request_id, 65 + i % 26, chr(65 + i % 26), time.perf_counter())
        yield TokenEvent(request_id, None, "", time.perf_counter(), finished=True, finish_reason=FinishReason.LENGTH,
                         num_prompt_tokens=len(prompt_token_ids), num_output_tokens=n, arrival=arrival_time,
                         first_scheduled=start, first_token=start)


def _client_gaps(tmp_path: Path, lane: dict, tokens: int = 40) -> tuple[list[float], str]:
    """The gaps between the content chunks as the client reads them (after the first), and the text."""
    with fake_server(tmp_path, engine=SteadyBurstsEngine(), lanes={"standard": {"priority": 1, **lane}}) as s:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                "stream": True}
        times, text = [], ""
        with httpx.Client(timeout=30) as c, c.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                content = "".join(ch["delta"].get("content") or "" for ch in chunk["choices"])
                if content:
                    times.append(time.perf_counter())
                    text += content
    return [b - a for a, b in zip(times, times[1:])], text


def test_smoothing_keeps_the_client_gaps_within_the_budget_while_the_engine_keeps_up(tmp_path):
    budget = 0.1
    plain, text_plain = _client_gaps(tmp_path / "plain", {})
    smooth, text_smooth = _client_gaps(tmp_path / "smooth", {"pace_itl_s": budget, "pace_reserve": 2})
    assert text_plain == text_smooth == "".join(chr(65 + i % 26) for i in range(40))
    # Unpaced, every burst is followed by its 0.2 s of silence; smoothed, two tokens of each burst fill it.
    assert max(plain) > 0.17
    assert sorted(smooth)[int(0.99 * (len(smooth) - 1))] < budget + 0.04
