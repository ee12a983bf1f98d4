"""``POST /v1/responses`` and ``POST /v1/embeddings`` through the gateway: passed on to a replica as the client
sent them and answered as the replica answers, under the same keys, lanes, admission and records as completions.

The gateway does not read these answers (no tokens to time one by one): the record's first token is the answer's
first byte, and its last the last byte. The embedded engine serves neither: a 404 says so.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.requests import ClientDisconnect

from tailguard.api_error import APIError
from tailguard.backends.upstream.proxy import Forwarded
from tailguard.observe.metrics import clean_label
from tailguard.observe.timeline import Outcome
from tailguard.policy.decision import clean_text
from tailguard.serving.endpoint import Endpoint
from tailguard.serving.exchange import Exchange, Incoming, Phase, forwarded_headers, identify
from tailguard.serving.prompt import PromptReader
from tailguard.serving.protocol import OWN_FIELDS, decode_json
from tailguard.serving.state import ServerState

log = logging.getLogger("tailguard.server")
perf_counter = time.perf_counter


def _estimate_tokens(data: dict[str, Any]) -> int:
    """Tokens the request holds for admission: its input at 4 characters a token, plus its output limit."""
    chars = len(str(data.get("input") or "")) + len(str(data.get("instructions") or ""))
    limit = data.get("max_output_tokens")
    return max(1, chars // 4) + (limit if type(limit) is int and limit > 0 else 0)


class ForwardEndpoint(Endpoint):
    def __init__(self, state: ServerState, path: str) -> None:
        super().__init__(state, path)
        self.prompts = PromptReader(state, chat=True)

    async def _exchange(self, ex: Exchange, request: Incoming) -> None:
        st, tl, policy, d = self.state, ex.tl, self.state.policy, ex.decision
        identify(st, ex, request)
        upstream = st.upstream
        if upstream is None:
            raise APIError(404, f"{self.path} is served through the gateway (tailguard serve --upstream URL), not by "
                                "the embedded engine", code="not_a_gateway")
        if not st.ready:
            raise APIError(503, "the gateway is still starting", code="model_not_ready", headers={"Retry-After": "5"})
        raw = await self.prompts.read_body(request, st.config.max_body_bytes)
        tl.body_arrived(perf_counter())
        data = decode_json(raw)
        model = data.get("model")
        if type(model) is not str or model not in st.model_names:
            raise APIError(404, f"The model `{clean_text(str(model), 200)}` does not exist; this server has: "
                                f"{', '.join(st.model_names)}", param="model", code="model_not_found")
        policy.shed(d, tl, clean_label(request.headers.get("x-business-type")))
        tokens = _estimate_tokens(data)
        tl.num_prompt_tokens = tokens
        await policy.charge(d, tl, 0)
        await policy.admit(d, tl, tokens)
        ex.enqueue()
        tl.stream = data.get("stream") is True
        tl.tokenized = tl.queued = perf_counter()
        body = {k: v for k, v in data.items() if k not in OWN_FIELDS}
        user = data.get("user")
        answer = upstream.forward(self.path, body, forwarded_headers(request),
                                  session=user if isinstance(user, str) else request.headers.get("x-session-id"))
        try:
            async for part in answer:
                if isinstance(part, Forwarded):
                    tl.scheduled = perf_counter()
                    tl.gateway = {**(tl.gateway or {}), "replica": part.replica}
                    status = part.status
                    await ex.start(status, [(b"content-type", part.content_type.encode())])
                    ex.move(Phase.RESPONDING)
                    continue
                if tl.first_token is None:  # the answer's first byte stands for its first token
                    tl.first_token = perf_counter()
                    tl.token_times.append(tl.first_token)
                await ex.chunk(part)
        except OSError:  # an ASGI server may report a gone client as a failed send
            raise ClientDisconnect() from None
        finally:
            await answer.aclose()
        tl.last_token = perf_counter()
        await ex.last(b"")
        tl.finalize(status, Outcome.SUCCESS if status < 400 else Outcome.INVALID if status < 500 else Outcome.ERROR)
