"""The backend a server's config names: upstream replicas (``upstreams``), the scripted fake (``model: fake``), or
the embedded engine (any other model)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tailguard.backends.base import Backend
from tailguard.serving.config import ServerConfig

if TYPE_CHECKING:
    from tailguard.engine.engine import EngineArgs


def build_backend(config: ServerConfig, engine_args: EngineArgs | None = None) -> Backend:
    """Load the engine named by ``config.model`` (slow for a real model: call it off the event loop)."""
    from tailguard.backends.local import LocalBackend

    if config.upstreams:
        from tailguard.backends.upstream.pool import UpstreamPool
        from tailguard.backends.upstream.proxy import UpstreamBackend

        name = config.served_model_names[0] if config.served_model_names else None
        return UpstreamBackend(UpstreamPool(config.upstreams, config.routing), model_name=name)
    if config.model == "fake":
        from tailguard.engine.fake import FakeEngine, FakeTiming

        f = config.fake
        timing = FakeTiming(ttft=f.ttft, itl=f.itl, jitter=f.jitter, prefill_per_token=f.prefill_per_token,
                            max_num_seqs=f.max_num_seqs, output_text=f.output_text, itl_per_running=f.itl_per_running,
                            priority_scheduling=f.priority_scheduling)
        return LocalBackend(FakeEngine(timing, max_model_len=f.max_model_len, model_name="fake"))
    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs

    return LocalBackend(AsyncLLMEngine.from_args(engine_args_for(config, engine_args or EngineArgs(model=config.model))))


def engine_args_for(config: ServerConfig, engine_args: EngineArgs) -> EngineArgs:
    """``engine_args`` with the configuration's ``engine:`` settings (the config file's, and the engine flags given on
    the command line) applied over them, and the configuration's model."""
    for key, value in config.engine.items():
        if not hasattr(engine_args, key):
            raise ValueError(f"unknown engine setting {key!r} in the config file")
        setattr(engine_args, key, value)
    engine_args.model = config.model
    return engine_args
