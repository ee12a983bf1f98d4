"""The one interface the server talks to: the embedded ``AsyncLLMEngine`` and the scripted ``FakeEngine`` both fit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from tailguard.serving.config import ServerConfig


class Backend(Protocol):
    tokenizer: Any  # encode, encode_chat, render_chat, decode, stop_token_ids, vocab_size
    model_name: str
    max_model_len: int

    def check_request(self, num_prompt_tokens: int, sampling: Any) -> None: ...

    def generate(
        self, prompt_token_ids: list[int], sampling: Any, request_id: str, priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncIterator[Any]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> Any: ...

    def shutdown(self) -> None: ...


def build_backend(config: ServerConfig, engine_args: Any | None = None) -> Backend:
    """Load the engine named by ``config.model`` (slow for a real model: call it off the event loop)."""
    if config.model == "fake":
        from tailguard.engine.fake import FakeEngine, FakeTiming

        f = config.fake
        timing = FakeTiming(ttft=f.ttft, itl=f.itl, jitter=f.jitter, prefill_per_token=f.prefill_per_token,
                            max_num_seqs=f.max_num_seqs, output_text=f.output_text)
        return FakeEngine(timing, max_model_len=f.max_model_len, model_name="fake")
    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs

    if engine_args is None:
        engine_args = EngineArgs(model=config.model)
    for key, value in config.engine.items():
        if not hasattr(engine_args, key):
            raise ValueError(f"unknown engine setting {key!r} in the config file")
        setattr(engine_args, key, value)
    engine_args.model = config.model
    return AsyncLLMEngine.from_args(engine_args)
