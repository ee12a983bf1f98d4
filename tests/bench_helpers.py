"""Helpers for the bench tests: a socket-free transport that replays the fake server's script at virtual times.

``ScriptedTransport`` answers each request with the SSE bytes the fake server would send, and hands them to the
bench's own SSE parser stamped with the *scripted* times (intended send + TTFT + gaps) instead of the clock. The
whole measurement path (parser, tokens per chunk, ITL with zero gaps, TPOT, percentiles, bootstrap, verdicts,
outputs) then runs exactly as in a real run, without the machine's scheduling noise. Tests give it known latencies
(``latency``) and work out the expected figures themselves, rather than reading back what the transport planned, and
make it fail chosen requests (``fail``: a 429, a cut stream, a timeout).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tailguard.bench.client import RequestResult, SSEParser, _Transport
from tailguard.bench.fakeserver import FakeScript, plan


class ScriptedTransport(_Transport):
    name = "scripted"

    def __init__(self, script: FakeScript, packet: int = 37, by_index: bool = False,
                 latency: Callable[[int], tuple[float, float]] | None = None,
                 fail: Callable[[int], str | None] | None = None) -> None:
        self.script = script
        # latency(index) -> (ttft, gap): a known TTFT and a known gap between every two chunks of measured request
        # ``index`` (no jitter), so that tests can check the bench against figures they computed themselves
        self.latency = latency
        # fail(index) -> None, "429" (refused), "cut" (the stream stops halfway, no [DONE]) or "timeout"
        self.fail = fail
        self.packet = packet  # split every response into reads of this many bytes (all at their event's time)
        # by_index: the script's randomness follows the request's index, not its run-unique ID, so that two runs
        # of one configuration see exactly the same stream
        self.by_index = by_index
        self.planned: dict[str, tuple[float, list[tuple[float, int]], str]] = {}

    async def start(self, max_connections: int, timeout: float) -> None:
        return None

    async def close(self) -> None:
        return None

    async def get_json(self, url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        return 404, None

    async def post(self, url, body, headers, res: RequestResult, stream, chat) -> None:
        req = json.loads(body)
        rid = headers["X-Request-ID"]
        prompt = req.get("prompt") or " ".join(m["content"] for m in req.get("messages", []))
        key = rid.rsplit("-", 1)[-1] if self.by_index else rid
        ttft, chunks, finish = plan(self.script, key, int(req["max_tokens"]), len(prompt.split()),
                                    bool(req.get("ignore_eos")))
        if self.latency is not None and res.index >= 0:
            ttft, gap = self.latency(res.index)
            chunks = [(0.0 if i == 0 else gap, k) for i, (_, k) in enumerate(chunks)]
        self.planned[rid] = (ttft, chunks, finish)
        res.sent = res.intended
        res.headers_at = res.intended
        res.server_request_id = rid
        failure = self.fail(res.index) if self.fail is not None and res.index >= 0 else None
        if failure == "429":
            res.status = 429
            # like a careless server, echo the credential back: the bench must keep it out of its outputs
            res.error = f"HTTP 429: too many requests for {headers.get('Authorization', 'anonymous')}"
            res.end = res.intended + 0.001
            return
        if failure == "timeout":
            raise TimeoutError
        if failure == "cut":
            chunks = chunks[: len(chunks) // 2]
        res.status = 200
        parser = SSEParser(res, chat)
        t = res.intended + ttft
        base = {"id": rid, "object": "chat.completion.chunk", "model": req["model"]}

        def feed(payload: dict | str, at: float) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            raw = f"data: {data}\n\n".encode()
            for i in range(0, len(raw), self.packet):
                parser.feed(raw[i : i + self.packet], at)

        if chat:
            feed({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, t)
        done = 0
        for i, (gap, size) in enumerate(chunks):
            t += gap
            done += size
            text = self.script.token_text * size
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            if i == len(chunks) - 1 and not chat:
                choice["finish_reason"] = finish
            feed({**base, "choices": [choice]}, t)
        end = t + 0.0001
        if failure == "cut":  # what the real transports conclude when the stream ends without [DONE]
            res.error, res.end = "stream ended without [DONE]", end
            return
        if chat:
            feed({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}, end)
        if req.get("stream_options", {}).get("include_usage"):
            feed({**base, "choices": [], "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": done,
                                                   "total_tokens": done + len(prompt.split())}}, end)
        feed("[DONE]", end)
        res.end = end


def bench_config(url: str = "http://127.0.0.1:9", **kw: Any):
    from tailguard.bench.runner import BenchConfig

    kw.setdefault("model", "fake")
    kw.setdefault("tokenizer", "approx")
    kw.setdefault("bootstrap", 200)
    kw.setdefault("input_tokens", 32)
    kw.setdefault("output_tokens", 12)
    kw.setdefault("join", "off")
    return BenchConfig(url=url, **kw)
