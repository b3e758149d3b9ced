"""HF checkpoints <-> canonical IR weights and ModelConfig."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from llmaccel.config import MODEL_TYPES, ModelConfig
from llmaccel.errors import LlmaccelError

_LLAMA_LAYER = {"input_layernorm.weight": "attn_norm.weight",
                "post_attention_layernorm.weight": "mlp_norm.weight"}
for _n in "qkvo":
    for _k in ("weight", "bias"):
        _LLAMA_LAYER[f"self_attn.{_n}_proj.{_k}"] = f"{_n}.{_k}"
for _n in ("gate", "up", "down"):
    for _k in ("weight", "bias"):
        _LLAMA_LAYER[f"mlp.{_n}_proj.{_k}"] = f"{_n}.{_k}"
_LLAMA_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "lm_head.weight"}
_GPT2_LAYER = {"ln_1.weight": "attn_norm.weight", "ln_1.bias": "attn_norm.bias",
               "ln_2.weight": "mlp_norm.weight", "ln_2.bias": "mlp_norm.bias",
               "attn.c_proj.weight": "o.weight", "attn.c_proj.bias": "o.bias",
               "mlp.c_fc.weight": "fc.weight", "mlp.c_fc.bias": "fc.bias",
               "mlp.c_proj.weight": "proj.weight", "mlp.c_proj.bias": "proj.bias"}
_GPT2_TOP = {"wte.weight": "embed.weight", "wpe.weight": "pos_embed.weight",
             "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"}


def config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from an HF config.json dict (transformers 4 and 5 spellings)."""
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise LlmaccelError(f"unsupported architecture {mt!r}; supported model types: "
                            f"{', '.join(sorted(MODEL_TYPES))} (families: llama, gpt2)")
    fam = MODEL_TYPES[mt]
    common = dict(family=fam, model_type=mt, vocab_size=hf["vocab_size"],
                  bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"))
    if fam == "gpt2":
        D, H = hf["n_embd"], hf["n_head"]
        return ModelConfig(**common, hidden_size=D, n_layers=hf["n_layer"], n_heads=H, n_kv_heads=H,
                           head_dim=D // H, intermediate_size=hf.get("n_inner") or 4 * D,
                           norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                           max_position=hf["n_positions"], tie_word_embeddings=True,
                           hidden_act=hf.get("activation_function", "gelu_new"))
    H = hf["num_attention_heads"]
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rp.items() if k != "rope_theta"} or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    if hf.get("hidden_act", "silu") != "silu":
        raise LlmaccelError(f"unsupported activation {hf['hidden_act']!r} for {mt}; supported: silu")
    if hf.get("sliding_window") and hf.get("use_sliding_window", mt == "mistral"):
        raise LlmaccelError("sliding-window attention is not supported")
    qkv_bias = bool(hf.get("attention_bias", False)) or mt == "qwen2"
    return ModelConfig(**common, hidden_size=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                       n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                       head_dim=hf.get("head_dim") or hf["hidden_size"] // H,
                       intermediate_size=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-6),
                       max_position=hf.get("max_position_embeddings", 2048),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       rope_theta=float(theta), rope_scaling=scaling, attention_bias=qkv_bias,
                       o_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)))


def config_to_hf(cfg: ModelConfig) -> dict:
    """An HF config.json dict that transformers loads into the same architecture."""
    if cfg.family == "gpt2":
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
                    n_embd=cfg.hidden_size, n_layer=cfg.n_layers, n_head=cfg.n_heads,
                    n_inner=cfg.intermediate_size, n_positions=cfg.max_position,
                    layer_norm_epsilon=cfg.norm_eps, activation_function=cfg.hidden_act,
                    bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, tie_word_embeddings=True)
    rope = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
    arch = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(cfg.model_type, "LlamaForCausalLM")
    return dict(model_type=cfg.model_type, architectures=[arch], vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_position,
                tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=cfg.rope_theta,
                rope_scaling=cfg.rope_scaling, rope_parameters=rope,
                attention_bias=cfg.attention_bias and cfg.o_bias, mlp_bias=cfg.mlp_bias,
                hidden_act="silu", bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)


def _layer_split(name: str, prefix: str):
    """'model.layers.3.mlp.up_proj.weight' -> (3, 'mlp.up_proj.weight') under prefix."""
    rest = name[len(prefix):]
    i, _, tail = rest.partition(".")
    return int(i), tail


def weights_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if cfg.family == "llama":
        for k, v in sd.items():
            if k.startswith("model.layers."):
                i, tail = _layer_split(k, "model.layers.")
                if tail in _LLAMA_LAYER:
                    out[f"layers.{i}.{_LLAMA_LAYER[tail]}"] = v
            elif k in _LLAMA_TOP:
                out[_LLAMA_TOP[k]] = v
        if cfg.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
    D = cfg.hidden_size
    for k, v in sd.items():
        k = k.removeprefix("transformer.")
        if k.startswith("h."):
            i, tail = _layer_split(k, "h.")
            p = f"layers.{i}."
            if tail == "attn.c_attn.weight":  # Conv1D stores (in, out): transpose to (out, in)
                for n, part in zip("qkv", v.t().split(D, dim=0)):
                    out[p + n + ".weight"] = part.contiguous()
            elif tail == "attn.c_attn.bias":
                for n, part in zip("qkv", v.split(D)):
                    out[p + n + ".bias"] = part.contiguous()
            elif tail in _GPT2_LAYER:
                w = v.t().contiguous() if tail.endswith("weight") and v.dim() == 2 else v
                out[p + _GPT2_LAYER[tail]] = w
        elif k in _GPT2_TOP:
            out[_GPT2_TOP[k]] = v
    return out


def weights_to_hf(w: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of weights_from_hf, for handing canonical weights to transformers."""
    out: dict[str, torch.Tensor] = {}
    if cfg.family == "llama":
        inv_layer = {v: k for k, v in _LLAMA_LAYER.items()}
        inv_top = {v: k for k, v in _LLAMA_TOP.items()}
        for k, v in w.items():
            if k.startswith("layers."):
                i, tail = _layer_split(k, "layers.")
                out[f"model.layers.{i}.{inv_layer[tail]}"] = v
            else:
                out[inv_top[k]] = v
        if cfg.tie_word_embeddings:
            out["lm_head.weight"] = w["embed.weight"]
        return out
    inv_layer = {v: k for k, v in _GPT2_LAYER.items()}
    inv_top = {v: k for k, v in _GPT2_TOP.items()}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([w[p + n + ".weight"] for n in "qkv"]).t().contiguous()
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([w[p + n + ".bias"] for n in "qkv"])
    for k, v in w.items():
        if k.startswith("layers."):
            i, tail = _layer_split(k, "layers.")
            if tail in inv_layer:
                hk = inv_layer[tail]
                out[f"transformer.h.{i}.{hk}"] = v.t().contiguous() if v.dim() == 2 else v
        else:
            out["transformer." + inv_top[k]] = v
    out["lm_head.weight"] = w["embed.weight"]
    return out


def read_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and canonical weights from an HF directory of safetensors files."""
    from llmaccel.compiler.filecheck import load_safetensors

    path = Path(path)
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LlmaccelError(f"cannot read {path}/config.json: {e}") from None
    if not isinstance(hf, dict):
        raise LlmaccelError(f"{path}/config.json is not a JSON object")
    try:
        cfg = config_from_hf(hf)
    except LlmaccelError:
        raise
    except (KeyError, TypeError, ValueError) as e:  # a field missing or of the wrong type
        raise LlmaccelError(f"{path}/config.json: missing or bad field ({type(e).__name__}: {e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LlmaccelError(f"{path}: no .safetensors weights (pickled .bin weights are not read)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_safetensors(f))
    try:
        return cfg, weights_from_hf(sd, cfg)
    except (ValueError, IndexError, RuntimeError) as e:  # a layer index that is no number
        raise LlmaccelError(f"{path}: unexpected tensor names or shapes ({e})") from None
