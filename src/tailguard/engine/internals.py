"""Sampled internals: for a share of requests, a few of their steps run instrumented, per layer.

A sampled request's prefill chunks and its first decode step, then every ``decode_every``-th decode step, run on the
torch path (the one-call C decode step cannot be split per layer) with a :class:`StepProbe` passed to
``LlamaModel.forward``. Per layer the probe takes the step's wall time (attention: norm, projections, RoPE, the K/V
write and attention itself, up to the residual add; MLP: the rest) and, for the sampled request's rows, the hidden
state's L2 norm after the layer and the attention entropy of a sample of heads (``head_share`` of them, at least
one) for the request's last row of the step. At most ``max_steps`` steps of a request are instrumented, so the cost
of a sampled request is bounded whatever its length.

Entropy is recomputed from the request's own keys in the paged cache (they are written before attention runs), in
float32, so the attention kernels stay as they are: H = -sum p log p over the positions the row attends to, which is
within [0, log(context)]. The probe's own work (entropies, norms) is kept out of the times it reports and given as
``probe_ms``.

Records: ``{"heads": [...], "decode_every": N, "steps": [{"kind", "position", "tokens", "batch_tokens",
"batch_seqs", "step_ms", "probe_ms", "layer_ms", "attn_ms", "mlp_ms", "norm", "entropy"}, ...]}`` with one
list entry per layer (``entropy``: one list of per-head values per layer, in the order of ``heads``).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tailguard.engine.blocks import BlockTable
from tailguard.engine.scheduler import ScheduledChunk

if TYPE_CHECKING:
    import torch

    from tailguard.engine.kv_layout import Device

DEFAULT_DECODE_EVERY = 16
DEFAULT_MAX_STEPS = 8
HEAD_SHARE = 0.1  # attention entropy for a tenth of the heads (the 10% sample the requirements name)


def sampled_heads(num_heads: int, share: float = HEAD_SHARE, seed: int = 0) -> list[int]:
    """The heads whose entropy is kept: ``share`` of them (at least one), spread over the range, fixed per engine."""
    if not 0 < share <= 1:
        raise ValueError(f"the head share must be in (0, 1], not {share}")
    k = max(1, round(num_heads * share))
    return sorted(random.Random(seed).sample(range(num_heads), k))


def check_settings(sample_rate: float, decode_every: int, max_steps: int) -> None:
    """ValueError naming the setting that is out of range."""
    if not (isinstance(sample_rate, int | float) and 0.0 <= sample_rate <= 1.0):
        raise ValueError(f"internals_sample_rate must be between 0 and 1, not {sample_rate!r}")
    if decode_every < 1 or max_steps < 1:
        raise ValueError("internals_decode_every and internals_max_steps must be at least 1")


@dataclass
class _Target:
    """One sampled request's rows in a step."""

    request_id: str
    kind: str  # prefill | decode
    row_start: int  # its rows in the step's flat batch
    row_end: int
    position: int  # position of its last row
    key_slots: torch.Tensor  # [position + 1] cache slots of every key its last row attends to
    norm: list[float] = field(default_factory=list)
    entropy: list[list[float]] = field(default_factory=list)


class StepProbe:
    """Instrumentation for one step, called by ``LlamaModel.forward`` around each layer."""

    def __init__(self, targets: list[_Target], heads: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 batch_tokens: int, batch_seqs: int, device: Device | torch.device) -> None:
        self.targets = targets
        self.heads = heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.batch_tokens = batch_tokens
        self.batch_seqs = batch_seqs
        self._sync = device.type == "cuda"  # CUDA runs asynchronously: a wall time needs the queue drained
        self.attn_ms: list[float] = []
        self.mlp_ms: list[float] = []
        self._t = 0.0
        self._step_start = 0.0
        self._own = 0.0  # seconds the probe itself spent (entropy, norms), kept out of every time it reports
        self.step_ms = 0.0

    def _now(self) -> float:
        if self._sync:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def step_begin(self) -> None:
        self._step_start = self._t = self._now()

    def layer_begin(self) -> None:
        self._t = self._now()

    def attention_done(self, q: torch.Tensor, kv_cache: torch.Tensor, layer_idx: int) -> None:
        """After the attention block's residual add: its time, then each target's head entropies (not timed)."""
        import torch  # a probed step runs in torch: it is loaded

        from tailguard.engine.torch_model import _kv_values

        done = self._now()
        self.attn_ms.append((done - self._t) * 1e3)
        k_rows = kv_cache[layer_idx, 0].reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])
        scale = 1.0 / math.sqrt(self.head_dim)
        for t in self.targets:
            keys = _kv_values(k_rows[t.key_slots], torch.float32)  # [L, kv, hd]
            row = q[t.row_end - 1].float()  # [H, hd]
            values = []
            for h in self.heads:
                scores = keys[:, h // self.group] @ row[h] * scale  # [L]
                logp = torch.log_softmax(scores, dim=-1)
                values.append(round(float(-(logp.exp() * logp).sum()), 5))
            t.entropy.append(values)
        self._t = self._now()
        self._own += self._t - done

    def layer_done(self, x: torch.Tensor) -> None:
        """After the MLP's residual add: its time, then each target's hidden-state norm (mean over its rows)."""
        done = self._now()
        self.mlp_ms.append((done - self._t) * 1e3)
        for t in self.targets:
            t.norm.append(round(float(x[t.row_start:t.row_end].float().norm(dim=-1).mean()), 4))
        self._own += self._now() - done

    def step_done(self) -> None:
        self.step_ms = (self._now() - self._step_start - self._own) * 1e3

    def entries(self) -> list[tuple[str, dict[str, Any]]]:
        """(request id, step entry) for every target."""
        layer_ms = [round(a + m, 4) for a, m in zip(self.attn_ms, self.mlp_ms)]
        out = []
        for t in self.targets:
            out.append((t.request_id, {
                "kind": t.kind, "position": t.position, "tokens": t.row_end - t.row_start,
                "batch_tokens": self.batch_tokens, "batch_seqs": self.batch_seqs, "step_ms": round(self.step_ms, 4),
                "probe_ms": round(self._own * 1e3, 4),
                "layer_ms": layer_ms, "attn_ms": [round(v, 4) for v in self.attn_ms],
                "mlp_ms": [round(v, 4) for v in self.mlp_ms], "norm": t.norm, "entropy": t.entropy,
            }))
        return out


def _is_decode(chunk: ScheduledChunk) -> bool:
    """A step of generation (not a prompt's last one-token chunk, which the scheduler also runs as a decode row)."""
    return bool((chunk.is_decode or chunk.draft) and chunk.seq.output_token_ids)


class InternalsSampler:
    """Chooses the sampled requests and the steps of theirs that run instrumented; keeps what the probes found."""

    def __init__(self, sample_rate: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: Device | torch.device, decode_every: int = DEFAULT_DECODE_EVERY,
                 max_steps: int = DEFAULT_MAX_STEPS, head_share: float = HEAD_SHARE,
                 seed: int | None = None) -> None:
        check_settings(sample_rate, decode_every, max_steps)
        self.sample_rate = sample_rate
        self.decode_every = decode_every
        self.max_steps = max_steps
        self.heads = sampled_heads(num_heads, head_share)
        self._shape = (num_heads, num_kv_heads, head_dim)
        self.device = device
        self._rng = random.Random(seed)
        self._records: dict[str, dict[str, Any]] = {}  # sampled request id -> its internals so far

    @property
    def enabled(self) -> bool:
        return self.sample_rate > 0

    def admit(self, request_id: str) -> bool:
        """Decide once, at arrival, whether ``request_id`` is sampled."""
        if self.sample_rate <= 0 or self._rng.random() >= self.sample_rate:
            return False
        self._records[request_id] = {"heads": list(self.heads), "decode_every": self.decode_every, "steps": []}
        return True

    def is_sampled(self, request_id: str) -> bool:
        return request_id in self._records

    def _wants(self, chunk: ScheduledChunk) -> bool:
        rec = self._records.get(chunk.seq.request_id)
        if rec is None or len(rec["steps"]) >= self.max_steps:
            return False
        if not _is_decode(chunk):
            return True  # every prefill chunk (bounded by max_steps)
        decoded = len(chunk.seq.output_token_ids)  # tokens out so far: 1 at the first decode step
        return (decoded - 1) % self.decode_every == 0

    def plan(self, chunks: list[ScheduledChunk], tables: dict[str, BlockTable]) -> StepProbe | None:
        """A probe for this step when a sampled request wants one of its steps instrumented, else None (free)."""
        if not self._records:
            return None
        targets: list[_Target] = []
        start = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if self._wants(chunk):
                table = tables[chunk.seq.request_id]
                last = chunk.end - 1
                import torch  # only once a request is sampled: a probed step runs in torch

                slots = torch.tensor([table.slot(p) for p in range(last + 1)], dtype=torch.long, device=str(self.device))
                kind = "decode" if _is_decode(chunk) else "prefill"
                targets.append(_Target(chunk.seq.request_id, kind, start, start + n, last, slots))
            start += n
        if not targets:
            return None
        num_heads, num_kv, head_dim = self._shape
        return StepProbe(targets, self.heads, num_heads, num_kv, head_dim, start, len(chunks), self.device)

    def collect(self, probe: StepProbe | None) -> None:
        if probe is None:
            return
        for request_id, entry in probe.entries():
            rec = self._records.get(request_id)
            if rec is not None:
                rec["steps"].append(entry)

    def finish(self, request_id: str) -> dict[str, Any] | None:
        """The request's internals (None when it was not sampled), forgotten here."""
        return self._records.pop(request_id, None)
