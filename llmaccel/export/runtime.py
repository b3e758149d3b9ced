"""Run an exported folder through ONNX Runtime with the same interface as a compiled Model.

`llmc eval DIR` and `llmc generate DIR` load an exported folder as an OnnxModel, so the quality
tools that measure a compiled graph measure its export: logits over a window, a cache that
carries the `present.N.*` outputs back in as `past_key_values.N.*`, and sampled generation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from llmaccel.compiler import executor
from llmaccel.compiler.model import Model
from llmaccel.config import ModelConfig
from llmaccel.errors import LlmaccelError, require_extra
from llmaccel.export.folder import MANIFEST, MODEL_FILE
from llmaccel.sampling import SamplingParams


class OrtCache:
    """The KV cache of an ONNX Runtime session: the last `present.*` outputs, by layer."""

    def __init__(self, past: dict[str, np.ndarray]):
        self.past = past
        self.length = 0

    def advance(self, n: int) -> None:
        self.length += n


class OnnxModel(Model):
    """An exported folder run by onnxruntime (CPU): logits, cache, generation, tokenizer."""

    def __init__(self, path: str, *, threads: int | None = None):
        ort = require_extra("onnxruntime", "onnx", "running an exported ONNX folder")

        p = Path(path)
        self.manifest = json.loads((p / MANIFEST).read_text())
        cfg = ModelConfig.from_dict(self.manifest["config"])
        tok = str(p) if (p / "tokenizer.json").exists() or (p / "vocab.json").exists() else None
        dt = getattr(torch, self.manifest["dtype"])
        super().__init__(None, cfg, source=str(path), tokenizer_dir=tok,
                         recipe=self.manifest.get("recipe"), dtype=dt, device="cpu")
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(p / MODEL_FILE), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types for unloadable models
            raise LlmaccelError(f"onnxruntime cannot load {p / MODEL_FILE}: {e}") from e
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.layers = {int(k): v for k, v in self.manifest["layers"].items()}
        self.np_dtype = np.float16 if dt == torch.float16 else np.float32

    @property
    def eval_chunk(self) -> int | None:
        return None  # an exported model's cache is never quantized

    def new_cache(self, batch: int, max_len: int) -> OrtCache:
        past = {}
        for i, kw in self.layers.items():
            for kv in ("key", "value"):
                past[f"past_key_values.{i}.{kv}"] = np.zeros(
                    (batch, kw["n_kv_heads"], 0, kw["head_dim"]), dtype=self.np_dtype)
        return OrtCache(past)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, start: int = 0, ctx: OrtCache | None = None) -> torch.Tensor:
        B, T = ids.shape
        cache = ctx if ctx is not None else self.new_cache(B, start + T)
        if cache.length != start:
            raise LlmaccelError(f"the cache holds {cache.length} tokens; logits asked from {start}")
        feed = dict(cache.past)
        feed["input_ids"] = ids.cpu().numpy().astype(np.int64)
        feed["attention_mask"] = np.ones((B, start + T), dtype=np.int64)
        if "position_ids" in self.input_names:
            feed["position_ids"] = np.broadcast_to(np.arange(start, start + T, dtype=np.int64), (B, T)).copy()
        names = ["logits"] + [n.replace("past_key_values", "present") for n in cache.past]
        outs = self.session.run(names, feed)
        if ctx is not None:
            ctx.past = {k: v for k, v in zip(cache.past, outs[1:])}
            ctx.advance(T)
        return torch.from_numpy(np.ascontiguousarray(outs[0]))

    def generate_ids(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        """One prefill, then one decode step per token, sampled as the reference executor does
        (its loop, on this session)."""
        if not prompt:
            raise LlmaccelError("the prompt is empty")
        return executor.generate_ids(self, prompt, params)


def genai_greedy(folder: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy token ids from ONNX Runtime GenAI's own generate loop on a genai folder
    (it stops at EOS)."""
    og = require_extra("onnxruntime_genai", "onnx", "ONNX Runtime GenAI's generate loop")

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + max_new_tokens)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out
