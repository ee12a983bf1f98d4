"""Model architecture hyper-parameters, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (h + 2 * self.kv_dim) + h * h + 3 * h * i + 2 * h
        head = 0 if self.tie_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head
