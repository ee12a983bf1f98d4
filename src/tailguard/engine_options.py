"""The engine's command-line options, shared by ``tailguard serve``, ``demo`` and ``generate``."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace
from typing import Any

from tailguard.engine.speculative import check_method

MODELS_ACCEPTED = "smollm2 (the real SmolLM2-135M-Instruct), tiny (random weights, for tests), or a .gguf path"
# ``serve`` also takes the scripted fake engine (no model: for tests and load-testing the server itself).
SERVE_MODELS_ACCEPTED = ("smollm2 (the real SmolLM2-135M-Instruct), tiny (random weights, for tests), fake (a "
                         "scripted engine without a model), or a .gguf path")


class EngineOptionError(ValueError):
    """An engine setting the engine cannot run with, said in one line naming the option."""


def add_engine_args(p: argparse.ArgumentParser, model_default: str | None = "smollm2") -> None:
    """The engine's options on ``p``. ``model_default=None``: --model unset means the --config file's model (serve),
    which may also be ``fake``."""
    model_help = MODELS_ACCEPTED
    if model_default is None:
        model_help = SERVE_MODELS_ACCEPTED + " (default: the --config file's model, else smollm2)"
    p.add_argument("--model", default=model_default, help=model_help)
    p.add_argument("--weight-format", default="auto", choices=["auto", "native", "float32", "bfloat16", "int8"],
                   help="auto: native on the CPU (the GGUF's own blocks, float32's answers), bfloat16 on CUDA")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    # auto: 768MiB of int8 KV (the default with native weights) hold 67,776 tokens of SmolLM2: 33 conversations of 2K
    # (1.5GiB where the cache is float16). The budget is also the most the cache ever makes resident: the prefix cache
    # frees blocks to the tail of an LRU list and hands out never-used ones first, so under steady traffic every
    # block of the budget is touched in time.
    p.add_argument("--kv-cache-memory", default="auto",
                   help="KV cache budget: bytes (1.5GiB, 768MiB) or a share of available memory (0.2); it is also the "
                        "most the cache makes resident over time. auto: 768MiB with int8 KV (67,776 tokens of "
                        "SmolLM2: 33 conversations of 2K tokens), 1.5GiB with float16 (69,904 tokens: 34 conversations)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache capacity in tokens, instead of --kv-cache-memory (default: unset, the budget sizes it)")
    # int8 by default with native weights: its rows are turned by a Hadamard transform before rounding, which brings
    # the pooled perplexity to -0.04% of float32's, below llama.cpp Q4_1's (docs/benchmarks.md), at half float16's bytes.
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16", "float32", "int8"],
                   help="auto: int8 with native weights (K/V rows turned by a Hadamard transform, a float16 scale per "
                        "token and KV head: half float16's bytes, perplexity within 0.1%% of float32's), float16 "
                        "otherwise")
    p.add_argument("--runner", default="auto", choices=["auto", "native", "torch", "lean"],
                   help="auto: the native runner (the C step hosted by numpy: torch is not imported, ~190 MiB less) "
                        "wherever it can run (native weights on the CPU, no speculative decoding, no sampled "
                        "internals), else torch's; lean: the native runner's former name")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block, the unit the cache is paged in")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once: the batch cap")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
    p.add_argument("--max-prefill-chunk", type=int, default=512,
                   help="longest prompt chunk one sequence may take in a step (default 512: the whole token budget)")
    p.add_argument("--prefill-overrun", type=int, default=64, metavar="TOKENS", dest="prefill_overrun_tokens",
                   help="a prompt's last chunk may pass the token budget and the chunk cap by this many tokens (at "
                        "most an eighth of them) so that a prompt just over the budget takes one step, not two; "
                        "0: never")
    p.add_argument("--step-time-budget", type=_budget, default="auto", metavar="SECONDS",
                   help="while streams decode, size each step's prompt chunks so that the step's predicted time (a "
                        "cost model fitted online from every step's time) stays within this many seconds, the "
                        "decoding streams' inter-token budget; off: the token budget alone; auto (the default): "
                        "80 ms where the start-up calibration predicts a step with a whole prompt chunk at more "
                        "than 2.5 times that (CPUs without matrix units), else off")
    p.add_argument("--prompt-rank", type=float, default=0.0, metavar="SECONDS_PER_TOKEN",
                   help="within a priority, waiting requests are taken by arrival time plus this many seconds per "
                        "prompt token still to compute: short prompts pass long ones that arrived less than that "
                        "before them, which cuts the TTFT tail of mixed prompts; 0 (the default): first come, first "
                        "served")
    p.add_argument("--decode-rows-on-tiles", type=int, default=None, metavar="ROWS",
                   help="a step with at least this many decoding streams runs them on bfloat16 tiles with its prompt "
                        "rows: on AMX 2-4x faster products from 16 streams, but a stream's numbers then depend on how "
                        "many share its step (default: 8 on AMX, 0 on CPUs without it, where the tiles are no "
                        "faster for decode rows; 0: never, for numbers that do not depend on the batch)")
    p.add_argument("--max-background-seqs", type=int, default=None,
                   help="while a more important request (a lower priority value: the VIP lane) runs, at most this "
                        "many less important sequences take each step; the rest pause (default: no limit)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads of a step (the kernels' pool, and torch's if it is loaded; default: "
                        "OMP_NUM_THREADS, else the CPUs this process may use: its affinity, capped by its cgroup's "
                        "CPU quota)")
    p.add_argument("--speculative", default="off", type=_speculative_method, metavar="{off,ngram,self,draft:PATH}",
                   help="speculative decoding (exact for greedy): ngram (prompt lookup), self (the model's first "
                        "quarter of layers drafts), draft:PATH (a small GGUF model with the same tokenizer), or off "
                        "(the default)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="most tokens guessed per step and request (adaptive: fewer when a request accepts few)")
    p.add_argument("--speculative-max-running", type=int, default=2,
                   help="no speculation while more sequences than this run (the step is then compute-bound)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="share the KV cache of identical prompt prefixes (system prompts, earlier chat turns) between "
                        "requests (the default)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn prefix caching off")
    p.add_argument("--attention-slice-tokens", type=int, default=1024,
                   help="long contexts: attention runs over slices of this many keys merged by log-sum-exp, so memory "
                        "per step stays bounded (0: one slice; default 1024, measured fastest at 8K here)")
    p.add_argument("--internals-sample-rate", type=_share, default=0.0,
                   help="share of requests (0-1) whose prefill and every 16th decode step run instrumented: per-layer "
                        "times, hidden-state norms and attention entropy kept with the record (default 0: off)")


def _budget(text: str) -> float | str | None:
    """Seconds (> 0), off, or auto."""
    if text.lower() in ("off", "none", ""):
        return None
    if text.lower() == "auto":
        return "auto"
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("a step time budget is a positive number of seconds, off or auto")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text}")
    return value


def engine_args_from(ns: argparse.Namespace) -> Any:
    from tailguard.engine.engine import EngineArgs

    return EngineArgs(
        model=ns.model,
        weight_format=ns.weight_format,
        device=ns.device,
        kv_cache_memory=ns.kv_cache_memory,
        kv_cache_tokens=ns.kv_cache_tokens,
        kv_cache_dtype=ns.kv_cache_dtype,
        runner=ns.runner,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_prefill_chunk=ns.max_prefill_chunk,
        prefill_overrun_tokens=ns.prefill_overrun_tokens,
        max_background_seqs=ns.max_background_seqs,
        step_time_budget_s=ns.step_time_budget,
        prompt_rank_s_per_token=ns.prompt_rank,
        decode_rows_on_tiles=ns.decode_rows_on_tiles,
        num_threads=ns.threads,
        speculative=ns.speculative,
        num_speculative_tokens=ns.num_speculative_tokens,
        speculative_max_running=ns.speculative_max_running,
        enable_prefix_caching=ns.enable_prefix_caching,
        attention_slice_tokens=ns.attention_slice_tokens,
        internals_sample_rate=ns.internals_sample_rate,
    )


def _speculative_method(value: str) -> str:
    try:
        return check_method(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


# Lower bounds of the engine's integer settings: below them a step can take no work and the engine spins forever
# (--max-num-seqs 0), divides by zero (--block-size 0) or sizes nothing. None means "unset" where the field allows it.
_AT_LEAST: dict[str, tuple[int, bool]] = {  # field -> (least value, None allowed)
    "block_size": (1, False),
    "max_num_seqs": (1, False),
    "max_num_batched_tokens": (1, False),
    "max_prefill_chunk": (1, False),
    "prefill_overrun_tokens": (0, False),
    "kv_cache_tokens": (1, True),
    "max_model_len": (1, True),
    "max_background_seqs": (0, True),
    "decode_rows_on_tiles": (0, True),
    "num_threads": (1, True),
    "num_speculative_tokens": (1, False),
    "speculative_max_running": (1, False),
    "attention_slice_tokens": (0, False),
}
# The flag of each field whose name differs from the flag's (the others are --field-with-dashes).
_FLAGS = {"prefill_overrun_tokens": "--prefill-overrun", "num_threads": "--threads",
          "step_time_budget_s": "--step-time-budget", "prompt_rank_s_per_token": "--prompt-rank"}


def _flag(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def check_engine_args(ea: Any) -> None:
    """Raise EngineOptionError for a setting of ``ea`` (an EngineArgs) the engine cannot run with; checked before a
    model is loaded, so that a bad flag is one line, not a traceback, a hang or a server answering 503."""
    for field, (least, optional) in _AT_LEAST.items():
        value = getattr(ea, field)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise EngineOptionError(f"{_flag(field)} must be a whole number, not {value!r}")
        if value < least:
            raise EngineOptionError(f"{_flag(field)} must be at least {least}, not {value}")
    if ea.kv_cache_tokens is not None and ea.kv_cache_tokens < ea.block_size:
        raise EngineOptionError(f"--kv-cache-tokens must hold at least one block ({ea.block_size} tokens, "
                                f"--block-size), not {ea.kv_cache_tokens}")
    if ea.kv_cache_memory != "auto":
        from tailguard.engine.memory import parse_budget

        value = ea.kv_cache_memory
        if isinstance(value, float) and not math.isfinite(value):
            raise EngineOptionError(f"--kv-cache-memory must be a positive finite size, not {value!r}")
        try:
            parse_budget(value, SimpleNamespace(type="cpu"))  # the format and sign; the size is the engine's
        except ValueError as exc:
            raise EngineOptionError(f"--kv-cache-memory: {exc}") from None
    rank = ea.prompt_rank_s_per_token
    if isinstance(rank, bool) or not isinstance(rank, (int, float)) or not (math.isfinite(rank) and rank >= 0):
        raise EngineOptionError(f"--prompt-rank must be a finite number of seconds >= 0, not {rank!r}")
    share = ea.internals_sample_rate
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise EngineOptionError(f"--internals-sample-rate must be between 0 and 1, not {share!r}")
    from tailguard.engine.engine import check_step_time_budget

    try:
        check_step_time_budget(ea.step_time_budget_s)
    except ValueError:
        raise EngineOptionError(f"--step-time-budget must be a positive number of seconds, off or auto, not "
                                f"{ea.step_time_budget_s!r}") from None


def check_model(name: str, fake_ok: bool = False) -> None:
    """Raise EngineOptionError unless ``name`` is a model this machine can load (the file is found; it is not read)."""
    from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path

    if fake_ok and name == "fake":
        return
    accepted = SERVE_MODELS_ACCEPTED if fake_ok else MODELS_ACCEPTED
    if not isinstance(name, str) or not name:
        raise EngineOptionError(f"no model given: give {accepted}")
    if not name.endswith(".gguf") and name != "tiny" and name not in _aliases():
        raise EngineOptionError(f"unknown model {name!r}: give {accepted}")
    try:
        # tiny has random weights but SmolLM2's tokenizer and shapes: it needs SmolLM2's file too.
        resolve_model_path("smollm2" if name == "tiny" else name)
    except ModelNotFoundError as exc:
        raise EngineOptionError(str(exc)) from None


def _aliases() -> set[str]:
    from tailguard.engine.model_store import MODEL_ALIASES

    return set(MODEL_ALIASES)
