"""IR op references against independent formulations (fp32, fresh random inputs)."""
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers import LlamaConfig

from llmaccel import ops
from llmaccel.ops.attention import ContiguousKVCache
from llmaccel.ops.rope import rope_inv_freq


def test_rms_norm_matches_formula():
    x, w = torch.randn(3, 5, 32), torch.randn(32)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ops.rms_norm(x, w, eps=1e-6), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops.rms_norm(x, None, eps=1e-6) * w, ref, rtol=1e-5, atol=1e-6)


def test_add_norm_ops_return_sum_and_norm():
    x, r, w, b = torch.randn(2, 4, 16), torch.randn(2, 4, 16), torch.randn(16), torch.randn(16)
    n, s = ops.add_rms_norm(x, r, w, eps=1e-5)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(n, ops.rms_norm(x + r, w, eps=1e-5))
    n, s = ops.add_layer_norm(x, r, w, b, eps=1e-5)
    torch.testing.assert_close(n, F.layer_norm(x + r, (16,), w, b, 1e-5))


def test_llama3_inv_freq_matches_transformers():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(head_dim=64, hidden_size=2048, num_attention_heads=32,
                      rope_parameters={"rope_theta": 500000.0, **scaling})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, scaling), ref.float(), rtol=1e-6, atol=0)


def test_rope_rotates_pairs_half_apart():
    B, T, H, D = 2, 7, 3, 8
    x = torch.randn(B, T, H * D)
    pos = torch.randint(0, 100, (B, T))
    out = ops.rope(x, pos, head_dim=D, theta=10000.0).view(B, T, H, D)
    h = x.view(B, T, H, D)
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    ang = pos[..., None, None].float() * inv  # (B, T, 1, D/2)
    a, b = h[..., : D // 2], h[..., D // 2:]
    ref = torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _naive_attention(q, k, v, H, Hkv, D):
    B, T, _ = q.shape
    qh = q.view(B, T, H, D).transpose(1, 2)
    kh = k.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    vh = v.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    s = qh @ kh.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2).reshape(B, T, H * D)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1)])
def test_attention_without_cache_is_causal_gqa(H, Hkv):
    B, T, D = 2, 9, 8
    q, k, v = torch.randn(B, T, H * D), torch.randn(B, T, Hkv * D), torch.randn(B, T, Hkv * D)
    out = ops.attention(q, k, v, None, layer=0, n_heads=H, n_kv_heads=Hkv, head_dim=D, scale=D ** -0.5)
    torch.testing.assert_close(out, _naive_attention(q, k, v, H, Hkv, D), rtol=1e-5, atol=1e-5)


def test_cached_attention_prefill_then_decode_equals_full():
    B, T, H, Hkv, D = 2, 10, 4, 2, 8
    q, k, v = torch.randn(B, T, H * D), torch.randn(B, T, Hkv * D), torch.randn(B, T, Hkv * D)
    kw = dict(layer=0, n_heads=H, n_kv_heads=Hkv, head_dim=D, scale=D ** -0.5)
    full = ops.attention(q, k, v, None, **kw)
    cache = ContiguousKVCache(B, T, torch.float32, "cpu")
    parts = [ops.attention(q[:, :6], k[:, :6], v[:, :6], cache, **kw)]
    cache.advance(6)
    for t in range(6, T):
        parts.append(ops.attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, **kw))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_cache_overflow_is_an_error():
    cache = ContiguousKVCache(1, 4, torch.float32, "cpu")
    x = torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        ops.attention(x, x, x, cache, layer=0, n_heads=1, n_kv_heads=1, head_dim=8, scale=1.0)


def test_gated_activations():
    g, u = torch.randn(3, 16), torch.randn(3, 16)
    torch.testing.assert_close(ops.silu_mul(g, u), g * torch.sigmoid(g) * u)
    torch.testing.assert_close(ops.relu_mul(g, u), g.clamp_min(0) * u)
    torch.testing.assert_close(ops.gelu_mul(g, u), F.gelu(g, approximate="tanh") * u)


def test_the_op_table_names_each_kernel_module():
    """Each op's `kernel` is the module of llmaccel.kernels that registers its custom op."""
    import importlib

    from llmaccel.ops.table import OPS
    for name, spec in OPS.items():
        if spec.kernel is None:
            continue
        importlib.import_module(f"llmaccel.kernels.{spec.kernel}")
        assert hasattr(torch.ops.llmaccel, name), (name, spec.kernel)


def test_every_context_declares_the_step_contract_and_a_missing_state_is_one_line():
    """The stateful ops call StepContext's methods directly; each context class subclasses it,
    and a context without the state a layer needs says which in one line."""
    from llmaccel.compiler.executor import forward
    from llmaccel.compiler.model import load
    from llmaccel.compiler.pipeline import compile
    from llmaccel.errors import LlmaccelError
    from llmaccel.ops.attention import ContiguousKVCache
    from llmaccel.ops.context import StepContext
    from llmaccel.ops.kvquant import QuantizedKVCache
    from llmaccel.ops.sla import LinearAttentionCache
    from llmaccel.runtime.decode import DecodeContext
    from llmaccel.runtime.kivi_cache import KiviContext
    from llmaccel.runtime.kv_cache import PagedContext
    from llmaccel.runtime.sla_states import SlaContext, SlaDecodeContext

    for cls in (ContiguousKVCache, QuantizedKVCache, LinearAttentionCache, PagedContext, DecodeContext,
                KiviContext, SlaContext, SlaDecodeContext):
        assert issubclass(cls, StepContext), cls
    ids = torch.tensor([[5, 6, 7]])
    plain = load("preset:tiny-llama")
    sla = compile("preset:tiny-llama", ["sla"], {"sla": {"init": "zeros"}}, eval_tokens=0, progress=False)
    kv4 = compile("preset:tiny-llama", ["kvquant"], {}, eval_tokens=0, progress=False)
    cases = [(plain, LinearAttentionCache(1, 8, torch.float32, "cpu"), "holds no KV cache"),
             (sla, ContiguousKVCache(1, 8, torch.float32, "cpu"), "needs a recurrent-state context"),
             (kv4, ContiguousKVCache(1, 8, torch.float32, "cpu"), "expects a KV cache quantized")]
    for m, ctx, msg in cases:
        with pytest.raises(LlmaccelError, match=msg) as e:
            forward(m.gm, ids, 0, ctx)
        assert "\n" not in str(e.value)
