"""A scripted OpenAI-compatible streaming upstream that costs next to nothing per token, for overhead benchmarks.

    .venv/bin/python benchmarks/sse_upstream.py --port 9000 --ttft 0.05 --itl 0.2

``tailguard serve --model fake`` scripts the same timings, but it is a whole server (records, metrics, the store) and
spends about as much CPU per token as the gateway under test; on a 2-core machine it then queues beside the load
generator and the direct path is itself the noisy part of a gateway-overhead run. This one is an aiohttp app on uvloop
that answers ``/v1/models``, ``/ready`` and streaming ``/v1/chat/completions`` and ``/v1/completions``: the first
token ``--ttft`` seconds after the request (with vLLM's opening chunk, role and empty content, just before it), then one
every ``--itl`` seconds, ``max_tokens`` in all, in vLLM's chunk shape (a usage chunk when ``stream_options.include_usage`` asks for it), then ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

MODEL = "fake"


def chunk(rid: str, created: int, chat: bool, text: str | None, finish: str | None = None, role: bool = False
          ) -> bytes:
    if chat:
        delta = {"content": text} if text is not None else {}
        if role:
            delta = {"role": "assistant", **delta}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def make_app(ttft: float, itl: float, text: str, end_delay: float = 0.0) -> web.Application:
    counter = iter(range(1 << 62))

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})

    async def ready(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def complete(request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
            n = int(body.get("max_tokens") or 16)
        except (ValueError, TypeError):
            return web.json_response({"error": {"message": "bad request", "type": "invalid_request_error"}},
                                     status=400)
        if not body.get("stream"):
            return web.json_response({"error": {"message": "this upstream only streams",
                                                 "type": "invalid_request_error"}}, status=400)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        rid, created = f"cmpl-{next(counter)}", int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        due = loop.time() + ttft
        try:
            for i in range(n):
                # Sleep to a schedule, not for a fixed gap, so the upstream's own delays do not add up.
                await asyncio.sleep(max(0.0, due - loop.time()))
                if i == 0 and chat:  # vLLM's opening chunk, sent with the first token
                    await resp.write(chunk(rid, created, chat, "", role=True))
                await resp.write(chunk(rid, created, chat, text))
                due += itl
            await resp.write(chunk(rid, created, chat, None if chat else "", "length"))
            if usage:
                u = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                     "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}
                await resp.write(b"data: " + json.dumps(u, separators=(",", ":")).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            if end_delay:  # the body's end comes apart from [DONE] (as a write of its own can, on a busy server)
                await asyncio.sleep(end_delay)
        except ConnectionError:  # the client went away: nothing left to send
            return resp
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/ready", ready)
    app.router.add_get("/health", ready)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.05)
    p.add_argument("--text", default="word ")
    p.add_argument("--end-delay", type=float, default=0.0, help="seconds between data: [DONE] and the body's end")
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(make_app(a.ttft, a.itl, a.text, a.end_delay), host=a.host, port=a.port, access_log=None, print=None,
                backlog=4096)


if __name__ == "__main__":
    main()
