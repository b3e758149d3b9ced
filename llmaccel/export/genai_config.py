"""genai_config.json: what ONNX Runtime GenAI's loader reads, in the model builder's layout."""
from __future__ import annotations

import json
from pathlib import Path

# GenAI picks its model class by this type; every llama-family model runs as "llama".
_TYPES = {"llama": "llama", "gpt2": "gpt2"}


def genai_config(model, manifest: dict) -> dict:
    c = model.config
    eos = sorted(c.eos_ids) if c.eos_ids else [0]
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
              "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if "position_ids" in manifest["inputs"]:
        inputs["position_ids"] = "position_ids"
    return {
        "model": {
            "bos_token_id": c.bos_token_id if c.bos_token_id is not None else 1,
            "context_length": c.max_position,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": c.head_dim,
                "hidden_size": c.hidden_size,
                "inputs": inputs,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": c.n_heads,
                "num_hidden_layers": len(manifest["layers"]),
                "num_key_value_heads": c.n_kv_heads,
            },
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": eos[0],
            "type": _TYPES[c.family],
            "vocab_size": c.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
            "length_penalty": 1.0, "max_length": c.max_position, "min_length": 0,
            "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
            # GroupQueryAttention writes the new keys into the past buffer in place
            "past_present_share_buffer": manifest.get("gqa", False),
            "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def write_genai_config(out: Path, model, manifest: dict) -> None:
    (Path(out) / "genai_config.json").write_text(json.dumps(genai_config(model, manifest), indent=4))
