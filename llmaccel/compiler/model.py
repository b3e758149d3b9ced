"""A compiled model: the IR graph, its config, its tokenizer and how it was made."""
from __future__ import annotations

from functools import cached_property
from typing import Iterator

import torch
import torch.fx
import torch.nn as nn

from llmaccel.compiler import executor
from llmaccel.compiler.families import capture
from llmaccel.compiler.serialize import graph_from_json
from llmaccel.compiler.sources import resolve
from llmaccel.config import ModelConfig
from llmaccel.errors import LlmaccelError
from llmaccel.ir import get_attr, op_counts, set_weight
from llmaccel.ops.kv_int8 import int8_layers
from llmaccel.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise LlmaccelError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str | torch.device) -> str:
    """The device to run on: "auto" is CUDA when present, else the CPU. A device this machine
    lacks, or no device at all, is refused in one line before anything is loaded onto it."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise LlmaccelError(f"device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise LlmaccelError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LlmaccelError(f"device {str(name)!r} needs CUDA, and torch finds no CUDA device "
                                f"here; use cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LlmaccelError(f"device {str(name)!r}: this machine has {torch.cuda.device_count()} "
                                f"CUDA device(s)")
    return str(dev)


def build_graph_module(graph: torch.fx.Graph, weights: dict[str, torch.Tensor], name: str) -> torch.fx.GraphModule:
    root = nn.Module()
    for k, v in weights.items():
        set_weight(root, k, v)
    return torch.fx.GraphModule(root, graph, class_name=name)


class Model:
    def __init__(self, gm: torch.fx.GraphModule, config: ModelConfig, *, source: str,
                 tokenizer_dir: str | None = None, recipe: list[dict] | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.gm, self.config, self.source = gm, config, source
        self.tokenizer_dir, self.recipe = tokenizer_dir, list(recipe or [])
        self.dtype, self.device = dtype, device

    @cached_property
    def tokenizer(self):
        if self.tokenizer_dir is None:
            raise LlmaccelError(f"{self.source} has no tokenizer (presets have none); pass token ids")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise LlmaccelError(f"{self.source}'s tokenizer has no chat template")
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                return_dict=True)["input_ids"])
        return self.tokenizer(text).input_ids

    def logits(self, ids: torch.Tensor, start: int = 0, ctx=None) -> torch.Tensor:
        return executor.forward(self.gm, ids.to(self.device), start, ctx)

    def new_cache(self, batch: int, max_len: int):
        """The attention context this graph needs (quantized if its attention nodes say so)."""
        return executor.make_cache(self.gm, batch, max_len, self.dtype, self.device)

    @property
    def eval_chunk(self) -> int | None:
        """How a quality measurement feeds a window: None, in one forward with no cache; else
        through the cache, this many tokens a forward. A quantized cache changes the model only
        through the cache: KIVI's tokens age into its quantized store as they would while
        decoding (32 a chunk); an int8 cache codes every token it stores, so any chunk gives
        the same values (512 bounds the attention's masks at long contexts)."""
        if executor.kv_quant_specs(self.gm):
            return 32
        return 512 if int8_layers(self.gm) else None

    def generate_ids(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        return executor.generate_ids(self, prompt, params)

    def stream(self, prompt: str | list[int], params: SamplingParams, *, chat: bool = False) -> Iterator[str]:
        """Yield text pieces as tokens are generated (decoded incrementally, whole characters only)."""
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        out: list[int] = []
        shown = ""
        for tok in self.generate_ids(ids, params):
            if tok in self.config.eos_ids and not params.ignore_eos:
                break
            out.append(tok)
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
                continue
            yield text[len(shown):]
            shown = text
            if params.stop and any(s in shown for s in params.stop):
                break

    def op_counts(self) -> dict[str, int]:
        return op_counts(self.gm)

    def save(self, path, report: dict | None = None, *, force: bool = False) -> None:
        """Write an artifact folder, whole or not at all; an existing artifact at `path` is
        replaced only with force=True."""
        from llmaccel.compiler.artifact import write_artifact

        write_artifact(self, path, report, force=force)


def load(src: str, *, dtype: str | torch.dtype = torch.float32, device: str = "cpu") -> Model:
    """Load a model from any source (built-in name, HF dir, .gguf, artifact, preset:NAME)."""
    dt = parse_dtype(dtype)
    s = resolve(src, dtype=dt, device=device)
    if s.manifest is not None:
        graph = graph_from_json(s.manifest["graph"])
        missing = [n.target for n in graph.nodes if n.op == "get_attr" and n.target not in s.weights]
        if missing:
            raise LlmaccelError(f"{src}: the graph reads {len(missing)} weights that "
                                f"model.safetensors lacks ({', '.join(missing[:3])}); the artifact "
                                f"is damaged, recompile it")
        gm = build_graph_module(graph, s.weights, f"{s.config.family}_ir")
        recipe = s.manifest.get("recipe", [])
    else:
        gm = capture(s.config, s.weights)
        recipe = []
    return Model(gm, s.config, source=src, tokenizer_dir=s.tokenizer_dir, recipe=recipe,
                 dtype=dt, device=device)
