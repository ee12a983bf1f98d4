"""The step loop (schedule -> run -> post-process) and an async front that streams timestamped tokens.

``LLMEngine`` is synchronous and single-threaded: tests drive it step by step. ``AsyncLLMEngine`` runs it in a
background thread (the C step, called through ctypes, and torch's kernels release the GIL, so the event loop stays
responsive) and delivers each
step's tokens to per-request asyncio queues. Every timestamp is ``time.perf_counter()`` taken where the thing happens.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailguard.engine import kernels
from tailguard.engine.blocks import BlockPool
from tailguard.engine.events import EngineStats, TokenEvent
from tailguard.engine.internals import DEFAULT_DECODE_EVERY, DEFAULT_MAX_STEPS, InternalsSampler
from tailguard.engine.internals import check_settings as check_internals
from tailguard.engine.kv_layout import (
    CPU,
    DEFAULT_ATTENTION_SLICE_TOKENS,
    Device,
    decode_step_fits,
    kv_rotated,
)
from tailguard.engine.loader import load_gguf, write_tiny_gguf
from tailguard.engine.memory import bound_heap_retention, format_bytes, parse_budget, release_free_heap
from tailguard.engine.model_store import cache_dir, resolve_model_path
from tailguard.engine.native_runner import NativeModel, NativeRunner
from tailguard.engine.sampling import LogitsState, SampledToken
from tailguard.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from tailguard.engine.sequence import (
    EngineClosed,
    FinishReason,
    RequestError,
    SamplingParams,
    Sequence,
    SequenceFailed,
    SequenceStatus,
)
from tailguard.engine.speculative import BatchProposer, Proposer, SpeculationPolicy, make_proposer
from tailguard.engine.step_cost import StepCostModel, StepShape, chunk_keys
from tailguard.engine.structured import GrammarCompiler
from tailguard.engine.tokenizer import GGUFTokenizer, IncrementalDetokenizer

if TYPE_CHECKING:
    import torch

    from tailguard.engine.torch_model import LlamaModel

logger = logging.getLogger("tailguard.engine")

# Steps that fail in a row outside the model (the scheduler, the block pool) before the engine gives up and says so on
# /health and /ready: a failure inside a step's model run ends that step's requests and is never fatal.
MAX_FAILED_STEPS = 3
# The KV cache is anonymous memory that becomes resident as blocks are first written, so the process holds what its
# traffic needs; a page's first write is a fault (~2.6 us here), ~1,500 of them (~4 ms) in the step of a 512-token
# prompt with int8 KV. While idle, the server writes the next never-used blocks ahead of demand (LLMEngine.warm_kv):
# a window of at least this many tokens or two steps' budget (at most an eighth of the cache, so that a large step
# budget does not make most of the cache resident before any traffic), this many bytes at a time between looks for
# work (~2 ms: the most a request that arrives meanwhile waits).
KV_WARM_AHEAD_MIN_TOKENS = 2048
KV_WARM_PIECE_BYTES = 3 << 20


@dataclass
class EngineArgs:
    model: str = "smollm2"  # alias, "tiny", or a path to a .gguf file
    # auto: native (the GGUF's own blocks, float32 answers) on the CPU, bfloat16 on CUDA. Or float32 | bfloat16 | int8.
    weight_format: str = "auto"
    device: str = "auto"
    block_size: int = 16
    # The KV cache is sized from a memory budget: bytes ("1.5GiB") or a share of available memory (0.2). auto: what
    # holds 32 conversations of 2K tokens of SmolLM2 (and one more): 768MiB with int8 rows (11.6 KB a token),
    # 1.5GiB in float16 (23 KB). Pages become resident as they are used.
    kv_cache_memory: str | float = "auto"
    kv_cache_tokens: int | None = None  # an explicit capacity in tokens instead of the budget
    # auto: int8 with native weights (rows turned by a Hadamard transform, a float16 scale per token and head: pooled
    # perplexity -0.04% against float32's, interval -0.17..+0.09%, benchmarks/fidelity.py), float16 elsewhere |
    # float16 | float32 | int8
    kv_cache_dtype: str = "auto"
    # auto: the native runner (engine/native_runner.py: the C step hosted by numpy; torch is not imported until a step needs it)
    # wherever it can run (native weights on the CPU, no speculative decoding, no sampled internals) | lean | torch
    runner: str = "auto"
    max_model_len: int | None = None  # defaults to the model's context length, clamped to what the KV cache holds
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 512
    prefill_overrun_tokens: int = 64  # see SchedulerConfig
    # While streams decode, a step's prefill is sized to keep the step within this many seconds (the scheduler's
    # step cost model, fitted online from every step's time). None: the token budget alone. "auto": after the
    # start-up calibration, AUTO_STEP_TIME_BUDGET_S where a step of one whole prompt chunk is predicted to take more
    # than AUTO_BUDGET_TRIGGER budgets (the streams beside it would wait that long for their next token), else none
    # (resolve_step_time_budget). Without a calibration "auto" is none.
    step_time_budget_s: float | str | None = "auto"
    # Within a priority, waiting prompts are ordered by arrival plus this many seconds per prompt token (0: FCFS).
    prompt_rank_s_per_token: float = 0.0
    # A step with at least this many decode rows runs them on the matrix units (AMX bfloat16 tiles) with its prompt
    # rows, where the CPU has them: from ~8 rows a product is faster there (benchmarks/decode_rows_on_tiles.py:
    # 1.6-1.9x the requests/s of a queue), but a decode row's numbers then depend on how many rows share its step,
    # as in most serving engines. 0: the block kernels always (batch-independent numbers, token for token what a
    # request alone computes).
    # None: 8 where the tiles are AMX's, 0 on the software tile unit (AVX-512 BF16 without AMX), where decode rows
    # are no faster on tiles below 32 rows and 160 requests at once were served 0.91x as fast at 8
    # (results/decode_rows_on_tiles_epyc.json).
    decode_rows_on_tiles: int | None = None
    max_background_seqs: int | None = None  # see SchedulerConfig: the pace of important streams under batch load
    num_threads: int | None = None
    # Speculative decoding: off | ngram (prompt lookup) | self (the target's first layers, drafting.py) | draft:PATH
    # (a small model with the same tokenizer). Up to num_speculative_tokens guesses per step and request,
    # and none at all while more than speculative_max_running sequences run: on this CPU speculating on every stream
    # paid at 2 streams (formatted output) and cost 7-31% at 4 and 8 (benchmarks/speculative.py, docs/benchmarks.md).
    speculative: str = "off"
    num_speculative_tokens: int = 4
    speculative_max_running: int = 2
    # Prefix caching: requests that start with the same tokens (a system prompt, earlier chat turns) share the KV of
    # those full blocks instead of computing it again.
    enable_prefix_caching: bool = True
    # Attention over a context longer than this many keys runs slice by slice, merged by log-sum-exp, so a long
    # context's step holds one slice of float K/V and scores, not the whole context's (torch paths; the C decode step
    # always streams 256-key slices). 0: one slice whatever the length. Default: benchmarks/long_context.py.
    attention_slice_tokens: int = DEFAULT_ATTENTION_SLICE_TOKENS
    # Sampled internals (T2, engine/internals.py): this share of requests gets per-layer timings and activation
    # statistics for its prefill and every internals_decode_every-th decode step (at most internals_max_steps steps),
    # kept with its record. 0 = off, and then nothing of it runs.
    internals_sample_rate: float = 0.0
    internals_decode_every: int = DEFAULT_DECODE_EVERY
    internals_max_steps: int = DEFAULT_MAX_STEPS
    internals_seed: int | None = None  # fixes which requests are sampled (tests, benchmarks)
    # Before serving (AsyncLLMEngine.from_args), time a few steps of representative shapes: the step-cost model
    # (the time budget, predicted TTFTs) starts from this machine's figures instead of a generic prior, and first-use
    # costs are paid before the first request.
    calibrate: bool = True


@dataclass
class _Tracked:
    seq: Sequence
    detok: IncrementalDetokenizer
    emitted: int = 0  # characters of detok.text already sent
    stopped_text: str | None = None
    extra: dict = field(default_factory=dict)


def tiny_model_path(source: Path) -> Path:
    """The tiny random-weight model, written once into the cache next to the real one (it borrows its tokenizer).

    Untied output head: with tied embeddings a random model just repeats the last prompt token, which hides bugs.
    """
    path = cache_dir() / "tailguard-tiny-random-untied.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_tiny_gguf(partial, source, tie_embeddings=False)
        partial.replace(path)
    return path


KV_CACHE_DTYPES = ("auto", "float16", "float32", "int8")
RUNNERS = ("auto", "native", "torch")
DEFAULT_KV_MEMORY = {"int8": "768MiB", "float16": "1.5GiB", "float32": "1.5GiB"}


def kv_dtype_name(name: str, weight_format: str = "float32", head_dim: int = 64) -> str:
    """The KV cache's dtype for a kv_cache_dtype setting. auto: int8 with native weights where its rows are turned
    (head_dim a power of two: perplexity within 0.1% of float32's, half float16's bytes), else float16, which
    halves float32's cache and the bytes attention reads per token; float32 only where asked."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    if name == "auto":
        return "int8" if weight_format == "native" and kv_rotated("int8", head_dim) else "float16"
    return name


def resolve_kv_dtype(name: str, weight_format: str = "float32", head_dim: int = 64):
    """kv_dtype_name as a torch dtype (the torch runner's; imports torch)."""
    import torch

    return getattr(torch, kv_dtype_name(name, weight_format, head_dim))


def resolve_device(name: str = "auto") -> Any:
    """kv_layout.CPU, or a torch device. auto: CUDA where torch sees a GPU; torch is asked only where a GPU driver (NVIDIA's
    or ROCm's) is installed, so that a CPU machine never imports it for the question."""
    gpu_driver = any(Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd"))  # NVIDIA, ROCm
    if name == "cpu" or (name == "auto" and not gpu_driver):
        return CPU
    import torch

    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else CPU
    return torch.device(name)


def resolve_weight_format(name: str, device: Any) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16"
    return "native" if kernels.available() else "float32"


DECODE_ROWS_ON_AMX_TILES = 8  # decode rows that go on AMX's tiles by default (benchmarks/decode_rows_on_tiles.py)


# The automatic step time budget. Measured on two CPUs (docs/benchmarks.md, "What does the step time budget do?"):
# where AVX-512 BF16 without AMX takes ~0.35 s for a 512-token prompt step, a budget of 80 ms held the streams' ITL
# P99 at 89-93 ms at 3.4 req/s (141-168 ms without) for the same TTFT P50; where AMX takes ~0.1 s for it, a budget
# gained nothing below saturation and cost capacity near it (more, smaller steps, each reading all the weights).
# The trigger (200 ms) sits well between the two, so that a busy moment during the calibration of an AMX machine
# (its speed moved 1.6x within minutes) does not turn the budget on.
AUTO_STEP_TIME_BUDGET_S = 0.08
AUTO_BUDGET_TRIGGER = 2.5
# With the automatic budget a prompt lifts it after waiting 8 budgets (0.64 s), not the 4 of a budget set by hand:
# on that machine, two A/B rounds at 3.4 and 4.5 req/s gave ITL P99 86-88 and 94-133 ms against 96-99 and 190-210 ms
# with 4, for a TTFT P99 ~10% longer (its prompt steps are compute-bound, so smaller chunks cost prompts little).
AUTO_PROMPT_WAIT_GUARD_S = 8 * AUTO_STEP_TIME_BUDGET_S


def check_step_time_budget(setting: float | str | None) -> float | None:
    """The budget the scheduler starts with: seconds, or None for none and for "auto" (settled after calibration)."""
    if setting is None or setting == "auto":
        return None
    if isinstance(setting, str) or not setting > 0:
        raise ValueError(f"step_time_budget_s is a positive number of seconds, None or 'auto', not {setting!r}")
    return float(setting)


def resolve_decode_rows_on_tiles(setting: int | None) -> int:
    """``EngineArgs.decode_rows_on_tiles`` as the runner takes it: None is 8 on AMX's tiles, 0 (never) elsewhere."""
    if setting is not None:
        return setting
    return DECODE_ROWS_ON_AMX_TILES if kernels.available() and kernels.tile_unit() == "AMX" else 0


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        bound_heap_retention()  # before the weights load: large freed blocks go back to the OS (engine/memory.py)
        if args.runner == "lean":  # its name before 2026-12-06 (CHANGELOG.md), still accepted
            args.runner = "native"
        if args.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, not {args.runner!r}")
        self.args = args
        # a bad value fails before the model loads
        proposer: Proposer | BatchProposer | None = make_proposer(args.speculative)
        check_internals(args.internals_sample_rate, args.internals_decode_every, args.internals_max_steps)
        if args.speculative != "off" and (args.num_speculative_tokens < 1 or args.speculative_max_running < 1):
            raise ValueError("num_speculative_tokens and speculative_max_running must be at least 1")
        if args.attention_slice_tokens < 0:
            raise ValueError("attention_slice_tokens must be 0 (no slicing) or a number of keys per slice")
        if args.model == "tiny":
            path = tiny_model_path(resolve_model_path("smollm2"))
        else:
            path = resolve_model_path(args.model)
        self.model_path = path
        self.model_name = "tiny" if args.model == "tiny" else Path(path).stem if args.model.endswith(".gguf") else args.model
        device = resolve_device(args.device)
        self.tokenizer = GGUFTokenizer(path)
        self.weight_format = resolve_weight_format(args.weight_format, device)
        weights = load_gguf(path, packed=self.weight_format == "native")
        self.config = weights.config
        native_ok = (self.weight_format == "native" and device.type == "cpu" and args.speculative == "off"
                   and args.internals_sample_rate == 0 and decode_step_fits(self.config))
        if args.runner == "native" and not native_ok:
            raise ValueError("the native runner needs native weights on the CPU, no speculative decoding, no sampled "
                             "internals and an attention shape the C step takes")
        self.native = native_ok and args.runner != "torch"
        kv_name = kv_dtype_name(args.kv_cache_dtype, self.weight_format, self.config.head_dim)
        if self.native:
            if args.num_threads:
                kernels.set_num_threads(args.num_threads)
            self.device: Device | torch.device = CPU
            self.model: NativeModel | LlamaModel = NativeModel(weights)
            self.kv_dtype: Any = kv_name
        else:
            import torch

            from tailguard.engine.torch_model import LlamaModel

            if args.num_threads:
                torch.set_num_threads(args.num_threads)
            torch_device = device if device is not CPU else torch.device("cpu")
            self.device = torch_device
            self.model = LlamaModel(weights, self.weight_format, torch_device)
            self.kv_dtype = getattr(torch, kv_name)
        self.model.attention_slice_tokens = args.attention_slice_tokens
        per_token = self.model.kv_bytes_per_token(self.kv_dtype)
        if args.kv_cache_tokens is not None:
            if args.kv_cache_tokens < args.block_size:
                raise ValueError(f"kv_cache_tokens must hold at least one block ({args.block_size} tokens)")
            num_blocks = args.kv_cache_tokens // args.block_size
        else:
            memory = DEFAULT_KV_MEMORY[kv_name] if args.kv_cache_memory == "auto" else args.kv_cache_memory
            budget = parse_budget(memory, self.device)
            num_blocks = budget // (per_token * args.block_size)
            if num_blocks < 1:
                raise ValueError(f"a KV cache budget of {format_bytes(budget)} holds no block of {args.block_size} "
                                 f"tokens ({format_bytes(per_token * args.block_size)} a block)")
        self.kv_capacity_tokens = num_blocks * args.block_size
        self.kv_cache_bytes = self.kv_capacity_tokens * per_token
        # A request can never be longer than the cache holds: clamp the context to it (and say so at start-up), so
        # that a default max_tokens derived from max_model_len always fits.
        max_len = min(args.max_model_len or self.config.max_position, self.config.max_position, self.kv_capacity_tokens)
        self.pool = BlockPool(num_blocks, args.block_size)
        self._kv_warm_to = 0  # blocks below this are resident (warm_kv)
        self._kv_warm_ahead = self._warm_window(args.max_num_batched_tokens)
        self._kv_warm_piece = max(1, KV_WARM_PIECE_BYTES // (per_token * args.block_size))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=max_len,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_prefill_chunk=args.max_prefill_chunk,
                prefill_overrun_tokens=args.prefill_overrun_tokens,
                max_background_seqs=args.max_background_seqs,
                enable_prefix_caching=args.enable_prefix_caching,
                step_time_budget_s=check_step_time_budget(args.step_time_budget_s),
                prompt_rank_s_per_token=args.prompt_rank_s_per_token,
            ),
            self.pool,
        )
        if self.native:
            assert isinstance(self.model, NativeModel)  # lean: the C step's model
            rows_on_tiles = resolve_decode_rows_on_tiles(args.decode_rows_on_tiles)
            self.runner: Any = NativeRunner(self.model, num_blocks, args.block_size, kv_name, args.num_threads,
                                            decode_rows_on_tiles=rows_on_tiles)
        else:
            from tailguard.engine.torch_model import LlamaModel
            from tailguard.engine.torch_runner import ModelRunner

            assert isinstance(self.model, LlamaModel)  # not lean: the torch model
            self.runner = ModelRunner(self.model, num_blocks, args.block_size, self.kv_dtype)
        if args.speculative == "self":
            from tailguard.engine.drafting import make_self_draft

            proposer = make_self_draft(self.runner)
        elif args.speculative.startswith("draft:"):
            from tailguard.engine.drafting import make_draft_model

            proposer = make_draft_model(args.speculative.removeprefix("draft:"), self.runner, self.tokenizer,
                                        num_blocks)
        self.speculation = (SpeculationPolicy(proposer, args.num_speculative_tokens, args.speculative_max_running)
                            if proposer is not None else None)
        cfg = self.config
        self.internals = InternalsSampler(args.internals_sample_rate, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                          self.device, args.internals_decode_every, args.internals_max_steps,
                                          seed=args.internals_seed)
        release_free_heap()  # the file's header and the weights' staging copies
        logger.info("%s", self.describe())
        self.stop_ids = set(self.tokenizer.stop_token_ids)
        # Structured output: specs compiled once each against this tokenizer (llguidance is loaded on first use).
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.stop_ids)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.steps = 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def describe(self) -> str:
        """One line for start-up logs: weights, KV cache budget in bytes and tokens, context."""
        dtype = kernels.dtype_name(self.kv_dtype)
        if dtype == "int8":
            # what the same bytes would hold in float16: the capacity the quantization buys
            gain = self.model.kv_bytes_per_token("float16") / self.model.kv_bytes_per_token("int8")
            turned = ", rows turned by a Hadamard transform" if kv_rotated("int8", self.config.head_dim) else ""
            dtype += f" (float16 scale per token and head{turned}; {gain:.2f}x float16's tokens per byte)"
        full = self.kv_capacity_tokens // max(1, self.max_model_len)
        return (f"{self.model_name}: {self.weight_format} weights ({format_bytes(self.model.weight_bytes())} read per "
                f"token) on {self.device}{' (native runner)' if self.native else ''}{self._prompt_path()}; KV cache "
                f"{format_bytes(self.kv_cache_bytes)} {dtype} = "
                f"{self.kv_capacity_tokens:,} tokens ({full} sequences of the full {self.max_model_len:,}-token "
                f"context, {self.kv_capacity_tokens // 2048} of 2,048)")

    def _prompt_path(self) -> str:
        """Where prompt rows of the C step are multiplied, when not by the block kernels."""
        step = getattr(self.runner, "_step", None)
        if step is not None and getattr(step, "prompt_bf16", False):
            return (f", prompt rows on bfloat16 tiles ({kernels.tile_unit()}, {format_bytes(step.bf16_bytes)} of "
                    "bfloat16 weights)")
        return ""

    # --- requests -------------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        sampling = sampling or SamplingParams()
        sampling.validate(self.config.vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        request_id = request_id or f"req-{next(self._ids)}"
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            priority=priority,
            arrival_time=arrival_time if arrival_time is not None else time.perf_counter(),
        )
        if sampling.transforms_logits:
            # Penalties, a logit bias or a grammar (compiled here, once per distinct spec; a spec that does not
            # compile is this request's RequestError). Every other request keeps logits_state None: no work a step.
            matcher = self.grammars.matcher(sampling.structured) if sampling.structured is not None else None
            seq.logits_state = LogitsState(seq, matcher)
        self.scheduler.add(seq)
        self._tracked[request_id] = _Tracked(seq, IncrementalDetokenizer(self.tokenizer))
        self.internals.admit(request_id)
        return request_id

    def abort(self, request_id: str) -> TokenEvent | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.seq, FinishReason.ABORT)
        self.runner.release(request_id)
        finished = tracked.seq.times.finished
        assert finished is not None  # Scheduler.finish stamps it
        return self._final_event(tracked, "", finished)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def warm_kv(self, max_blocks: int | None = None) -> bool:
        """Make up to ``max_blocks`` (default: KV_WARM_PIECE_BYTES' worth) of the never-used KV blocks that come next
        resident, so that a prompt's step does not take their page faults; False once a window of
        KV_WARM_AHEAD_MIN_TOKENS (or two steps' budget, at most an eighth of the cache) past the highest block ever
        handed out is ready. Only never-used blocks are written (with the zeros they read as), and only from the
        thread that steps (AsyncLLMEngine calls it while idle)."""
        touch = getattr(self.runner, "touch_kv_blocks", None)
        if touch is None:
            return False
        fresh = self.pool.fresh_from
        first = max(fresh, self._kv_warm_to)
        end = min(self.pool.num_blocks, fresh + self._kv_warm_ahead, first + (max_blocks or self._kv_warm_piece))
        if first >= end:
            return False
        touch(first, end)
        # A separate draft model keeps its own cache over the same block ids: its pages fault on the same blocks.
        proposer = getattr(self.speculation, "proposer", None)
        if proposer is not None and getattr(proposer, "shares_target_kv", True) is False:
            proposer.runner.touch_kv_blocks(first, end)
        self._kv_warm_to = end
        return True

    def _warm_window(self, step_tokens: int) -> int:
        """Blocks kept warm past the highest ever handed out: two steps' budget, at least KV_WARM_AHEAD_MIN_TOKENS, at
        most an eighth of the cache; none for a GPU's cache, which is resident from the start."""
        if self.device.type != "cpu":
            return 0
        return min(self.pool.blocks_for(max(KV_WARM_AHEAD_MIN_TOKENS, 2 * step_tokens)), self.pool.num_blocks // 8)

    def set_caps(self, max_num_seqs: int, max_num_batched_tokens: int | None = None) -> None:
        """Running-sequence cap and per-step token budget, from any thread; applied at the next step (scheduler).
        The warm window follows the budget."""
        self.scheduler.set_caps(max_num_seqs, max_num_batched_tokens)
        if max_num_batched_tokens is not None:
            self._kv_warm_ahead = self._warm_window(max_num_batched_tokens)

    def set_background(self, max_background_seqs: int | None, protected_priority: int | None = None) -> None:
        """The background cap (SchedulerConfig.max_background_seqs) from any thread; applied at the next step."""
        self.scheduler.set_background(max_background_seqs, protected_priority)

    def request_ids(self) -> list[str]:
        """The requests the engine still holds (waiting or running)."""
        return list(self._tracked)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_used=self.pool.num_used,
            num_preemptions=self.scheduler.num_preemptions,
            steps=self.steps,
            num_spec_proposed=self.speculation.total_proposed if self.speculation else 0,
            num_spec_accepted=self.speculation.total_accepted if self.speculation else 0,
            num_spec_steps=self.speculation.num_verify_steps if self.speculation else 0,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            kv_blocks_cached=self.pool.num_cached,
        )

    # --- the step -------------------------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        spec = self.speculation
        draft_for: Callable[[Sequence], list[int]] | None = None
        if spec is not None and spec.batch_speculates(len(self.scheduler.running)):
            running = self.scheduler.running
            if spec.batched:
                # A draft model guesses for the whole step at once, before scheduling; one block per running
                # sequence stays free so that guessing never takes a block a plain decode needs. A request with
                # penalties, a logit bias or a grammar never speculates (verification samples without them).
                drafts = spec.draft_batch([s for s in running if s.logits_state is None], self.scheduler.tables,
                                          len(running))

                def draft_for(seq: Sequence) -> list[int]:
                    return drafts.get(seq.request_id, [])
            else:
                plain_draft = spec.draft

                def draft_for(seq: Sequence) -> list[int]:
                    return plain_draft(seq) if seq.logits_state is None else []
        failed: dict[str, str] = {}  # requests whose own part of this step failed, with why
        if draft_for is not None:
            draft_for = self._guarded_drafts(draft_for, failed)
        began = time.perf_counter()
        out = self.scheduler.schedule(draft_for)
        if out.is_empty:
            return []
        try:
            probe = self.internals.plan(out.chunks, self.scheduler.tables)  # None unless a sampled request's step
            sampled = self.runner.execute(out.chunks, self.scheduler.tables, self.stop_ids, probe)
            self.internals.collect(probe)
        except Exception as exc:  # noqa: BLE001 - the step's requests end with an error; the engine goes on
            logger.exception("engine step %d failed; its %d requests end with an error", self.steps, len(out.chunks))
            reason = f"the engine step failed: {type(exc).__name__}: {str(exc)[:200]}"
            ids = dict.fromkeys(c.seq.request_id for c in out.chunks)
            return [ev for rid in ids if (ev := self.fail_request(rid, reason)) is not None]
        now = time.perf_counter()
        self.scheduler.advance(out)
        self.steps += 1
        events: list[TokenEvent] = []
        for chunk, tokens in zip(out.chunks, sampled):
            rid = chunk.seq.request_id
            try:
                if rid in failed:
                    raise SequenceFailed(failed[rid])
                self._take_tokens(chunk, tokens, now, events)
            except Exception as exc:  # noqa: BLE001 - this request alone ends; its neighbours keep their tokens
                if not isinstance(exc, SequenceFailed):
                    logger.exception("request %s failed in post-processing", rid)
                reason = str(exc) if isinstance(exc, SequenceFailed) else \
                    f"post-processing failed: {type(exc).__name__}: {str(exc)[:200]}"
                ev = self.fail_request(rid, reason)
                if ev is not None:
                    events.append(ev)
        # The whole step as the decoding streams feel it: schedule, run, post-process (for the step time budget and
        # Scheduler.predict_ttft; ~0.05 ms a step on average, the refit every 8 steps included).
        self.scheduler.cost.observe(out.shape, time.perf_counter() - began)
        return events

    def _take_tokens(self, chunk: ScheduledChunk, tokens: list[SampledToken], now: float,
                     events: list[TokenEvent]) -> None:
        spec = self.speculation
        if any(t.error is not None for t in tokens):
            raise SequenceFailed(next(t.error for t in tokens if t.error is not None))
        if chunk.draft:
            assert spec is not None
            spec.record(chunk.seq.request_id, len(chunk.draft), len(tokens) - 1)
        tracked = self._tracked[chunk.seq.request_id]
        # Several tokens at once (accepted guesses): each goes through the stop checks in order, and the first
        # that ends the request drops the rest, so EOS, stop strings and max_tokens hold exactly.
        for token in tokens:
            events.append(self._post_process(tracked, token, now))
            if events[-1].finished:
                break
        if chunk.draft and not chunk.seq.is_finished:
            self.scheduler.roll_back(chunk.seq, len(tokens) - 1)

    @staticmethod
    def _guarded_drafts(draft_for: Callable[[Sequence], list[int]],
                        failed: dict[str, str]) -> Callable[[Sequence], list[int]]:
        """A proposer whose failure for one sequence ends that request alone (its step goes on without a guess)."""

        def guarded(seq: Sequence) -> list[int]:
            try:
                return draft_for(seq)
            except Exception as exc:  # noqa: BLE001
                logger.exception("the speculative proposer failed for request %s", seq.request_id)
                failed[seq.request_id] = f"speculative drafting failed: {type(exc).__name__}: {str(exc)[:200]}"
                return []

        return guarded

    def fail_request(self, request_id: str, reason: str) -> TokenEvent | None:
        """End one request with an error of its own (``request_failed``), freeing what it holds; None if unknown."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        seq = tracked.seq
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq, FinishReason.ERROR)
        now = time.perf_counter()
        try:
            self.runner.release(request_id)
            event = self._final_event(tracked, "", now)
        except Exception:  # noqa: BLE001 - the request ends either way; what it held is logged
            logger.exception("cleaning up failed request %s", request_id)
            event = TokenEvent(request_id, None, "", now, finished=True, num_prompt_tokens=seq.num_prompt_tokens,
                               num_output_tokens=len(seq.output_token_ids), arrival=seq.times.arrival,
                               first_scheduled=seq.times.first_scheduled, first_token=seq.times.first_token)
        event.finish_reason = FinishReason.ERROR
        event.error = reason
        event.request_failed = True
        return event

    def _post_process(self, tracked: _Tracked, token, now: float) -> TokenEvent:
        seq = tracked.seq
        sp = seq.sampling
        seq.output_token_ids.append(token.token_id)
        seq.times.token_times.append(now)
        if seq.times.first_token is None:
            seq.times.first_token = now
        tracked.detok.add(token.token_id)
        reason: FinishReason | None = None
        grammar_done = False
        state = seq.logits_state
        if state is not None and state.matcher is not None:
            try:
                grammar_done = state.matcher.advance(token.token_id)
            except ValueError as exc:
                raise SequenceFailed(f"structured output failed: {exc}") from exc
        n_out = len(seq.output_token_ids)
        if n_out >= sp.min_tokens and (
            (token.token_id in self.stop_ids and not sp.ignore_eos) or token.token_id in sp.stop_token_ids
        ):
            reason = FinishReason.STOP
        text = tracked.detok.text
        cut = len(text)
        if sp.stop and n_out >= sp.min_tokens:
            # Search only text not yet emitted (plus the overlap a stop string may straddle): a stop string seen
            # before min_tokens was reached is part of the output and must not end the request later.
            hit = min(
                ((i, s) for s in sp.stop if (i := text.find(s, max(0, tracked.emitted - len(s) + 1))) >= 0), default=None
            )
            if hit is not None:
                cut = hit[0]
                seq.stop_string_hit = hit[1]
                reason = FinishReason.STOP
        if reason is None and grammar_done:  # the grammar is complete: nothing but EOS could follow
            reason = FinishReason.STOP
        if reason is None and n_out >= sp.max_tokens:
            reason = FinishReason.LENGTH
        if reason is None and sp.stop:
            # Hold back a tail that could still grow into a stop string.
            cut = len(text) - _stop_prefix_overlap(text, sp.stop)
        delta = text[tracked.emitted : max(cut, tracked.emitted)]
        tracked.emitted = max(cut, tracked.emitted)
        if reason is None:
            return TokenEvent(seq.request_id, token.token_id, delta, now, token.logprob, token.top_logprobs)
        self._tracked.pop(seq.request_id, None)
        self.scheduler.finish(seq, reason)
        self.runner.release(seq.request_id)
        event = self._final_event(tracked, delta, now)
        event.token_id, event.logprob, event.top_logprobs = token.token_id, token.logprob, token.top_logprobs
        return event

    def _final_event(self, tracked: _Tracked, delta: str, now: float) -> TokenEvent:
        seq = tracked.seq
        spec_state = self.speculation.forget(seq.request_id) if self.speculation else None
        return TokenEvent(
            seq.request_id,
            None,
            delta,
            now,
            finished=True,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            arrival=seq.times.arrival,
            first_scheduled=seq.times.first_scheduled,
            first_token=seq.times.first_token,
            num_preemptions=seq.num_preemptions,
            num_spec_proposed=spec_state.proposed if spec_state else 0,
            num_spec_accepted=spec_state.accepted if spec_state else 0,
            num_cached_tokens=seq.num_cached_tokens,
            internals=self.internals.finish(seq.request_id),
        )

    def calibrate(self) -> float:
        """Time a few steps of the shapes serving makes to fit the step-cost model; returns the seconds it took
        (SmolLM2 on two cores: 1-3 s). After one untimed prompt (first-use costs), budget-sized steps of one prompt,
        of four short ones and of a long prompt's second chunk hold the same number of prompt tokens and very
        different numbers of keys, which tells the model's two prompt terms apart; then a few streams decode, and
        16. Its requests leave no trace in what the engine reports: the step and prefix-cache counts and the cached
        blocks are as they were. Skipped when the KV cache or context is too small for its prompts."""
        t0 = time.perf_counter()
        big = min(self.scheduler.config.max_num_batched_tokens, self.scheduler.config.max_prefill_chunk, 512)
        if self.kv_capacity_tokens < 4 * (2 * big + 256) or self.scheduler.config.max_model_len < 2 * big + 16:
            return 0.0
        vocab = self.config.vocab_size

        def prompt(n: int, salt: int) -> list[int]:
            return [(salt * 7919 + i * 104729) % (vocab - 256) + 128 for i in range(n)]

        sched = self.scheduler
        counts = (self.steps, sched.prefix_cache_queries, sched.prefix_cache_hits, sched.num_preemptions)
        short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        self.generate([prompt(big, 0)], short)  # first use: pages of the weights and tiles touched, then timed anew
        sched.cost = StepCostModel()
        self.generate([prompt(big, 22)], short)
        self.generate([prompt(big // 4, k) for k in range(1, 5)], sampling)
        self.generate([prompt(2 * big, 5)], short)
        self.generate([prompt(24, k) for k in range(6, 22)], sampling)
        self.steps, sched.prefix_cache_queries, sched.prefix_cache_hits, sched.num_preemptions = counts
        self.pool.reset_cache()
        return time.perf_counter() - t0

    def resolve_step_time_budget(self) -> str | None:
        """Settle ``step_time_budget_s="auto"`` from the step-cost model (call after ``calibrate``): a budget of
        AUTO_STEP_TIME_BUDGET_S (lifted by a prompt waiting AUTO_PROMPT_WAIT_GUARD_S) where a step carrying one whole
        prompt chunk beside a few decoding streams is predicted to take more than AUTO_BUDGET_TRIGGER budgets, else
        none. Returns a line saying what was chosen and why, or None when the setting is not "auto"."""
        if self.args.step_time_budget_s != "auto":
            return None
        if self.scheduler.cost.observed == 0:  # calibration skipped (a cache too small for its prompts): no evidence
            return "no step time budget: no step was timed at start-up to decide by"
        cfg = self.scheduler.config
        chunk = min(cfg.max_num_batched_tokens, cfg.max_prefill_chunk)
        full = self.scheduler.cost.predict(StepShape(decode_rows=4, decode_keys=4 * 256, prefill_tokens=chunk,
                                                     prefill_keys=chunk_keys(0, chunk)))
        if full > AUTO_BUDGET_TRIGGER * AUTO_STEP_TIME_BUDGET_S:
            guard = cfg.prompt_wait_guard_s if cfg.prompt_wait_guard_s is not None else AUTO_PROMPT_WAIT_GUARD_S
            self.scheduler.config = dataclasses.replace(cfg, step_time_budget_s=AUTO_STEP_TIME_BUDGET_S,
                                                        prompt_wait_guard_s=guard)
            return (f"step time budget {AUTO_STEP_TIME_BUDGET_S * 1e3:.0f} ms (lifted while a prompt has waited "
                    f"{guard * 1e3:.0f} ms): a step with a {chunk}-token prompt chunk is predicted at "
                    f"{full * 1e3:.0f} ms here")
        return (f"no step time budget: a step with a {chunk}-token prompt chunk is predicted at {full * 1e3:.0f} ms "
                f"here (a budget of {AUTO_STEP_TIME_BUDGET_S * 1e3:.0f} ms applies from "
                f"{AUTO_BUDGET_TRIGGER * AUTO_STEP_TIME_BUDGET_S * 1e3:.0f} ms)")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None) -> list[list[int]]:
        """Run prompts to completion (offline use and tests); returns output token ids per prompt."""
        ids = [self.add_request(p, SamplingParams(**vars(sampling)) if sampling else None) for p in prompts]
        seqs = {rid: self._tracked[rid].seq for rid in ids}
        while self.has_unfinished():
            self.step()
        return [list(seqs[rid].output_token_ids) for rid in ids]


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    if not text:
        return 0
    last = text[-1]
    for s in stops:
        # Only a prefix that ends in the text's last character can be a suffix of it: jump between those (a stop
        # string is checked on every token, so this stays linear in its length, not quadratic).
        end = min(len(s) - 1, len(text))
        while end > best:
            k = s.rfind(last, 0, end) + 1
            if k <= best:
                break
            if text.endswith(s[:k]):
                best = k
                break
            end = k - 1
    return best


class AsyncLLMEngine:
    """Runs an LLMEngine in a background thread and streams TokenEvents to asyncio consumers.

    Every request that registers gets an end: its last token, an error, or - when the engine shuts down or its thread
    dies - an error event naming why. Registration and the thread's death are decided under one lock, so a request
    cannot slip in after the final errors went out and wait forever. The decode step runs in C with the GIL released
    (ctypes), so the event loop keeps serving while a step computes.
    """

    def __init__(self, engine: LLMEngine | None = None, *, args: EngineArgs | None = None) -> None:
        """Front an engine built elsewhere (``engine``), or build one from ``args`` on the engine thread itself
        (``from_args``: see there why)."""
        if (engine is None) == (args is None):
            raise ValueError("AsyncLLMEngine needs an engine or the EngineArgs to build one, not both")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, _EventStream]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed: str | None = None  # why no new request is taken; set under _lock
        # Requests submitted and not yet added by the engine thread (it takes them between steps): their prompt
        # tokens and priority, for predict_ttft; changed under _lock.
        self._submitted: dict[str, tuple[int, int]] = {}
        self.error: BaseException | None = None
        built = threading.Event()
        build_error: list[BaseException] = []

        def run() -> None:
            if args is not None:
                try:
                    built_engine = LLMEngine(args)
                    if args.calibrate:
                        took = built_engine.calibrate()
                        logger.info("step-cost model calibrated in %.2f s: %s", took,
                                    built_engine.scheduler.cost.snapshot())
                        chosen = built_engine.resolve_step_time_budget()
                        if chosen is not None:
                            logger.info("%s", chosen)
                    self._attach(built_engine)
                except BaseException as exc:  # noqa: BLE001 - re-raised by the constructor, on the caller's thread
                    build_error.append(exc)
                    return
                finally:
                    built.set()
            self._loop()

        if engine is not None:
            self._attach(engine)
        self._thread = threading.Thread(target=run, name="tailguard-engine", daemon=True)
        self._thread.start()
        if args is not None:
            built.wait()
            if build_error:
                raise build_error[0]

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self._last_stats = engine.stats()

    @classmethod
    def from_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        """Load the model on the engine thread, which then steps it: the thread that loads is the thread that steps.
        With OpenMP's pool (``TAILGUARD_THREAD_POOL=openmp``) this matters: libgomp keeps a pool per thread that opens
        parallel regions, and a second, idle pool made every barrier pay a wake-up (measured with 2 threads on 2
        cores: ~270 sleeps per step and thread, against ~18 this way); the kernels' own pool (the default) is one per
        process either way. Blocks until the model is loaded."""
        return cls(args=args)

    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        sampling.validate(self.engine.config.vocab_size)
        self.engine.scheduler.check_fits(num_prompt_tokens, sampling.max_tokens)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """Stream a request's tokens. Leaving the iterator early (client gone, cancel) aborts the request."""
        self.check_request(len(prompt_token_ids), sampling)
        if sampling.structured is not None:
            # Compile its spec (once per distinct spec) on a worker thread: neither this event loop nor the engine's
            # thread, whose steps every running stream waits on, is held up by it. A spec that does not compile
            # raises RequestError here; the engine's admission then finds it compiled.
            await asyncio.get_running_loop().run_in_executor(None, self.engine.grammars.compiled, sampling.structured)
        loop = asyncio.get_running_loop()
        stream = _EventStream(loop)
        with self._lock:
            if self._closed is not None:
                raise EngineClosed(self._closed)
            if request_id in self._queues:
                raise RequestError(f"duplicate request id {request_id!r}")
            self._queues[request_id] = (loop, stream)
            self._submitted[request_id] = (len(prompt_token_ids), priority)
        self._commands.put(("add", (prompt_token_ids, sampling, request_id, priority, arrival_time)))
        finished = False
        pending = stream.pending
        try:
            while True:
                if not pending:
                    await stream.wait()
                event: TokenEvent = pending.popleft()
                if event.error is not None:
                    finished = True
                    if event.finish_reason is None:
                        raise RequestError(event.error)
                    if event.request_failed:
                        raise SequenceFailed(event.error)
                    raise EngineClosed(event.error)
                yield event
                if event.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
            if not finished and self._closed is None:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def set_caps(self, max_num_seqs: int, max_num_batched_tokens: int | None = None) -> None:
        self.engine.set_caps(max_num_seqs, max_num_batched_tokens)  # thread-safe: applied at a step boundary

    def set_background(self, max_background_seqs: int | None, protected_priority: int | None = None) -> None:
        self.engine.set_background(max_background_seqs, protected_priority)

    def protect_priority(self, max_background_seqs: int, protected_priority: int) -> None:
        """While a request of ``protected_priority`` or above runs, at most this many others take a step, unless
        ``--max-background-seqs`` was given (the operator's setting wins)."""
        if self.engine.args.max_background_seqs is None:
            self.set_background(max_background_seqs, protected_priority)

    def predict_ttft(self, num_prompt_tokens: int, priority: int = 0) -> float:
        """Seconds until a prompt submitted now would get its first token (``Scheduler.predict_ttft``), counting the
        prompts submitted ahead of it that the engine thread has not taken in yet. Read from the caller's thread
        while the engine thread steps: a sequence that starts or ends during the read may count or not, which moves
        the figure by one step at most."""
        with self._lock:
            queued = [n for n, p in self._submitted.values() if p <= priority]
        return self.engine.scheduler.predict_ttft(num_prompt_tokens, priority, queued_ahead=queued)

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.config.max_num_seqs

    @property
    def speculates(self) -> bool:
        return self.engine.speculation is not None

    def stats(self) -> EngineStats:
        return self._last_stats

    @property
    def is_running(self) -> bool:
        return self._closed is None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; every request still in flight ends with an error event (never a hang)."""
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout=timeout)
        self._close_all("engine shut down")
        if not self._thread.is_alive():  # the engine is ours again: free what the ended requests held
            for request_id in self.engine.request_ids():
                self.engine.abort(request_id)

    # --- engine thread ----------------------------------------------------------------------------------------------
    def _close_all(self, reason: str) -> None:
        """Refuse new requests and end every registered one with an error event naming ``reason``."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            pending = list(self._queues)
        now = time.perf_counter()
        self._deliver([TokenEvent(r, None, "", now, finished=True, finish_reason=FinishReason.ERROR, error=reason)
                       for r in pending])

    def _deliver(self, events: list[TokenEvent]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_EventStream, TokenEvent]]] = {}
        with self._lock:
            for ev in events:
                target = self._queues.get(ev.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], ev))
        for loop, items in by_loop.items():
            try:
                # One wake-up of the event loop per step, not one per token.
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                # That consumer's event loop is closed: nobody is left to read these streams. Abort them here rather
                # than let one dead loop take the engine down for every other request.
                dead = {ev.request_id for _, ev in items if not ev.finished}
                with self._lock:
                    for _, ev in items:
                        self._queues.pop(ev.request_id, None)
                for rid in dead:  # through the command queue: only the engine thread touches the engine
                    self._commands.put(("abort", rid))

    def _handle(self, command: tuple) -> None:
        kind, payload = command
        if kind == "add":
            prompt, sampling, request_id, priority, arrival = payload
            with self._lock:
                registered = request_id in self._queues
                self._submitted.pop(request_id, None)
            if not registered:  # the client left before its request reached the engine
                return
            try:
                self.engine.add_request(prompt, sampling, request_id, priority, arrival)
            except RequestError as exc:
                self._deliver([TokenEvent(request_id, None, "", time.perf_counter(), finished=True, error=str(exc))])
            except Exception as exc:  # noqa: BLE001 - this request alone could not be added
                logger.exception("adding request %s failed", request_id)
                ev = self.engine.fail_request(request_id, f"the engine could not take the request: {exc!r}"[:300])
                self._deliver([ev or TokenEvent(request_id, None, "", time.perf_counter(), finished=True,
                                                finish_reason=FinishReason.ERROR, request_failed=True,
                                                error=f"the engine could not take the request: {exc!r}"[:300])])
        elif kind == "abort":
            # The final event says where the request was when it was aborted (scheduled? first token?), so the
            # server charges its time to the stages that really happened.
            try:
                final = self.engine.abort(payload)
            except Exception:  # noqa: BLE001 - an abort that fails still ends the request
                logger.exception("aborting request %s failed", payload)
                final = self.engine.fail_request(payload, "aborted")
            if final is not None:
                self._deliver([final])

    def _loop(self) -> None:
        failures = 0
        try:
            warm = True
            while not self._stop.is_set():
                block = not self.engine.has_unfinished()
                if block and warm and self._commands.empty():
                    try:
                        block = not self.engine.warm_kv()  # a piece at a time, looking for work in between
                    except Exception:  # noqa: BLE001 - an optimisation: the steps fault the pages in as before
                        logger.exception("warming the KV cache failed; its pages fault in as blocks are written")
                        warm = False
                try:
                    command = self._commands.get(block=block, timeout=0.5 if block else None) if block else self._commands.get_nowait()
                    self._handle(command)
                    while True:
                        self._handle(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    try:
                        events = self.engine.step()
                        failures = 0
                    except Exception:  # noqa: BLE001 - outside the model (the scheduler): retried, then fatal
                        failures += 1
                        logger.exception("engine step failed outside the model (%d in a row)", failures)
                        if failures >= MAX_FAILED_STEPS:
                            raise
                        continue
                    self._last_stats = self.engine.stats()
                    if events:
                        self._deliver(events)
                else:
                    self._last_stats = self.engine.stats()
        except BaseException as exc:  # noqa: BLE001 - surface any engine crash to every waiting request
            self.error = exc
            logger.exception("engine thread failed")
            self._close_all(f"engine failure: {exc!r}")
            return  # logged and delivered to every request; re-raising would only reach threading's excepthook
        self._close_all("engine shut down")


class _EventStream:
    """One request's events on its event loop: a deque and at most one waiter, lighter than an ``asyncio.Queue`` on
    the per-token path (no getter bookkeeping, no ``task_done`` counting). Touched only on the consumer's loop."""

    __slots__ = ("loop", "pending", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: collections.deque[TokenEvent] = collections.deque()
        self.waiter: asyncio.Future | None = None

    def put(self, event: TokenEvent) -> None:
        self.pending.append(event)
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    async def wait(self) -> None:
        w = self.waiter = self.loop.create_future()
        try:
            await w
        finally:
            self.waiter = None


def _put_all(items: list[tuple[_EventStream, TokenEvent]]) -> None:
    for stream, ev in items:
        stream.put(ev)
