"""The stream interruption rate: a stream that began (its first token left) and was ended by the server without its
answer (the engine failed mid-answer) counts; one that ended with its ``[DONE]``, or that the client left, does not.
The record says so, and the SLO monitor's window has the rate an objective can hold."""

from __future__ import annotations

from pathlib import Path

import httpx

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.engine.sequence import SequenceFailed
from tests.serving_helpers import fake_server, settle


class MidStreamFailure(FakeEngine):
    """Fails after its third token for requests whose id starts with ``cut``."""

    async def generate(self, prompt_token_ids, sampling, request_id, priority=0, arrival_time=None):
        n = 0
        async for ev in super().generate(prompt_token_ids, sampling, request_id, priority, arrival_time):
            yield ev
            n += 1
            if request_id.startswith("cut") and n == 3:
                raise SequenceFailed(request_id, "the engine failed on this request mid-answer")


def _stream(url: str, rid: str, max_tokens: int = 8, leave_after: int | None = None) -> list[str]:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": True}
    lines: list[str] = []
    with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/chat/completions", json=body,
                                                 headers={"X-Request-ID": rid}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if leave_after is not None and len(lines) >= leave_after:
                break
    return lines


def test_only_streams_the_server_cut_count(tmp_path: Path):
    engine = MidStreamFailure(FakeTiming(ttft=0.005, itl=0.01))
    with fake_server(tmp_path, engine=engine) as s:
        assert _stream(s.url, "whole-1")[-1] == "data: [DONE]"
        cut = _stream(s.url, "cut-1")
        assert '"error"' in cut[-2] or '"error"' in cut[-1]
        _stream(s.url, "gone-1", max_tokens=2000, leave_after=3)  # the client leaves: not the server's doing
        settle(s)
        store = s.state.store
        assert "interrupted" not in store.get("whole-1")
        assert store.get("cut-1")["interrupted"] is True
        gone = store.get("gone-1")
        assert gone["status"] == 499 and "interrupted" not in gone
        mon = s.state.slo
        assert mon is not None
        scope = next(iter(mon.evaluate().to_dict()["scopes"].values()))
        assert (scope["streams"], scope["interrupted"]) == (3, 1)
        assert abs(scope["interruption_rate"] - 1 / 3) < 1e-9
