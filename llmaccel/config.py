"""Configuration dataclasses shared by the compiler, the passes and the runtime."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from llmaccel.errors import LlmaccelError

FAMILIES = ("llama", "gpt2")
# HF model_type -> canonical family.
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "smollm": "llama",
               "gpt2": "gpt2"}


@dataclass
class ModelConfig:
    """Architecture facts of a decoder-only model, independent of where it came from."""
    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # q, k, v projections carry a bias (Qwen2, some Llamas)
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise LlmaccelError(f"unsupported family {self.family!r}; supported: {', '.join(FAMILIES)}")
        for k in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "intermediate_size", "max_position"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LlmaccelError(f"model config {k} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise LlmaccelError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def eos_ids(self) -> set[int]:
        e = self.eos_token_id
        return set() if e is None else ({e} if isinstance(e, int) else set(e))


@dataclass
class CompileConfig:
    """What `llmc compile` was asked to do."""
    passes: list[str] = field(default_factory=list)
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # pass name -> {key: value}
    calib: str = "mixed"
    calib_split: str = "first-half"
    verify: bool = False
