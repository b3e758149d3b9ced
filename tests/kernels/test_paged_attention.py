"""Paged attention: references against contiguous attention, Triton kernels against the references.

CPU: the Triton kernels run under TRITON_INTERPRET=1 at small shapes, fp16 and fp32 (the
interpreter mishandles bf16 in tl.dot). GPU (-m cuda): real Llama-1B / Llama-2-7B shapes, bf16 kernels against an fp32 reference.
Tolerances: fp32 2e-5 abs (interpreter, IEEE dots), fp16 2e-3, bf16 2e-2 (outputs are O(1)).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmaccel.kernels import paged_attention as pa  # noqa: E402
from llmaccel.ops.attention import attend_heads  # noqa: E402

needs_triton = pytest.mark.skipif(pa.triton is None, reason="triton not installed")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(q_lens, ctx_lens, H, Hkv, D, bs, dtype, device="cpu", seed=0):
    """Random caches holding each sequence's context in shuffled blocks, and the new tokens."""
    g = torch.Generator().manual_seed(seed)
    S = len(q_lens)
    nb = [-(-L // bs) for L in ctx_lens]
    num_blocks = sum(nb) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(nb)
    bt = torch.zeros(S, width, dtype=torch.int32)
    used = 0
    for s in range(S):
        bt[s, : nb[s]] = torch.tensor(perm[used: used + nb[s]])
        used += nb[s]
    kc = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(dtype)
    N = sum(q_lens)
    q = torch.randn(N, H, D, generator=g).to(dtype)
    k = torch.randn(N, Hkv, D, generator=g).to(dtype)
    v = torch.randn(N, Hkv, D, generator=g).to(dtype)
    slots = []
    for s in range(S):
        for p in range(ctx_lens[s] - q_lens[s], ctx_lens[s]):
            slots.append(int(bt[s, p // bs]) * bs + p % bs)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    t = dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, slot_mapping=torch.tensor(slots),
             block_tables=bt, cu_seqlens_q=cu, context_lens=lens)
    return {n: x.to(device) for n, x in t.items()}


def contiguous_ref(c, scale):
    """Independent oracle: rebuild each sequence's contiguous K/V, attend with a causal offset."""
    bs = c["k_cache"].shape[1]
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    pa.write_kv_ref(c["k"], c["v"], kc, vc, c["slot_mapping"])
    outs = []
    cu = c["cu_seqlens_q"].tolist()
    for s, L in enumerate(c["context_lens"].tolist()):
        pos = torch.arange(L)
        slot = c["block_tables"][s].long()[pos // bs].cpu() * bs + pos % bs
        k = kc.flatten(0, 1)[slot.to(kc.device)].float().transpose(0, 1)[None]
        v = vc.flatten(0, 1)[slot.to(kc.device)].float().transpose(0, 1)[None]
        q = c["q"][cu[s]: cu[s + 1]].float().transpose(0, 1)[None]
        T = q.shape[2]
        mask = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
        outs.append(attend_heads(q, k, v, scale=scale, mask=mask.to(q.device))[0].transpose(0, 1))
    return torch.cat(outs)


def run_op(name, c, scale):
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    if name == "decode":
        out = torch.ops.llmaccel.paged_decode_attention(
            c["q"], c["k"], c["v"], kc, vc, c["slot_mapping"], c["block_tables"], c["context_lens"],
            None, None, scale=scale)
    else:
        max_q = int((c["cu_seqlens_q"][1:] - c["cu_seqlens_q"][:-1]).max())
        out = torch.ops.llmaccel.paged_prefill_attention(
            c["q"], c["k"], c["v"], kc, vc, c["slot_mapping"], c["block_tables"], c["cu_seqlens_q"],
            c["context_lens"], None, None, scale=scale, max_q_len=max_q)
    return out, kc, vc


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_reference_ops_match_contiguous_attention_and_write_the_cache(bs):
    c = make_case([5, 1, 7, 1], [9, 3, 7, 20], H=4, Hkv=2, D=8, bs=bs, dtype=torch.float32)
    want = contiguous_ref(c, 0.3)
    out, kc, vc = run_op("prefill", c, 0.3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    flat = kc.flatten(0, 1)
    torch.testing.assert_close(flat[c["slot_mapping"]], c["k"])
    d = make_case([1, 1, 1], [9, 1, 33], H=6, Hkv=2, D=8, bs=bs, dtype=torch.float32)
    out, _, _ = run_op("decode", d, 0.3)
    torch.testing.assert_close(out, contiguous_ref(d, 0.3), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype,bs,H,Hkv,D", [(torch.float32, 16, 4, 2, 16), (torch.float16, 16, 4, 2, 16),
                                              (torch.float16, 8, 6, 2, 32), (torch.float32, 4, 4, 4, 24)])
def test_triton_prefill_matches_reference(dtype, bs, H, Hkv, D):
    c = make_case([20, 1, 3, 17], [20, 40, 70, 17], H=H, Hkv=Hkv, D=D, bs=bs, dtype=dtype, seed=bs)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    pa.write_kv_ref(c["k"], c["v"], kc, vc, c["slot_mapping"])
    args = (c["q"], kc, vc, c["block_tables"], c["cu_seqlens_q"], c["context_lens"], D ** -0.5)
    got = pa.paged_prefill_triton(*args, max_q_len=20)
    want = pa.paged_attention_ref(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize("dtype,splits", [(torch.float32, 3), (torch.float16, 1), (torch.float16, 3),
                                          (torch.float16, None)])
def test_triton_split_k_decode_matches_reference(dtype, splits):
    c = make_case([1] * 5, [1, 17, 130, 64, 200], H=8, Hkv=2, D=16, bs=16, dtype=dtype, seed=3)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    pa.write_kv_ref(c["k"], c["v"], kc, vc, c["slot_mapping"])
    args = (c["q"], kc, vc, c["block_tables"], c["context_lens"], 0.25)
    got = pa.paged_decode_triton(*args, num_splits=splits)
    want = pa.paged_decode_ref(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_splits_fill_the_gpu_but_stay_long():
    assert pa.decode_splits(1, 8, 4096, 64, 132) == 16  # 16 splits of 256 tokens
    assert pa.decode_splits(64, 8, 4096, 64, 132) == 1
    assert pa.decode_splits(1, 8, 100, 64, 132) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 64), (32, 32, 128)])
def test_cuda_ops_match_reference_at_real_shapes(H, Hkv, D):
    torch.manual_seed(0)
    lens = torch.randint(1, 4096, (64,)).tolist()
    c = make_case([1] * 64, lens, H=H, Hkv=Hkv, D=D, bs=16, dtype=torch.bfloat16, device="cuda")
    out, _, _ = run_op("decode", c, D ** -0.5)
    ref_kc, ref_vc = c["k_cache"].clone(), c["v_cache"].clone()
    pa.write_kv_ref(c["k"], c["v"], ref_kc, ref_vc, c["slot_mapping"])
    want = pa.paged_decode_ref(c["q"].float(), ref_kc.float(), ref_vc.float(), c["block_tables"],
                               c["context_lens"], D ** -0.5)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    q_lens = [512, 1, 300, 37, 1024, 5]
    ctx = [512, 900, 1500, 37, 1024, 2000]
    c = make_case(q_lens, ctx, H=H, Hkv=Hkv, D=D, bs=16, dtype=torch.bfloat16, device="cuda")
    out, kc, vc = run_op("prefill", c, D ** -0.5)
    want = pa.paged_attention_ref(c["q"].float(), kc.float(), vc.float(), c["block_tables"],
                                  c["cu_seqlens_q"], c["context_lens"], D ** -0.5)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)



def _variants(kernel) -> int:
    """Compiled variants of a Triton kernel on this device (its first device cache's size)."""
    caches = getattr(kernel, "device_caches", None)
    if not caches:
        pytest.skip("this Triton keeps no device_caches")
    return sum(len(c[0]) for c in caches.values())


@pytest.mark.cuda
def test_cuda_eager_steps_of_varying_shapes_compile_no_new_variants():
    """Steps of an engine differ in rows, table width, split count and in where the prefill rows
    start (views after the decode rows): after one step of each kind has compiled, none of these
    compiles another variant (one would stall a running load for seconds)."""
    H, Hkv, D = 32, 8, 64
    for i, (n_dec, width_ctx) in enumerate([(1, 40), (3, 100), (5, 257), (16, 1000), (2, 33), (7, 4096)]):
        dec = [int(x) for x in torch.randint(1, width_ctx, (n_dec,))] + [width_ctx]
        pre_q, pre_ctx = [17, 300], [17 + i, 600]
        c = make_case([1] * len(dec) + pre_q, dec + pre_ctx, H=H, Hkv=Hkv, D=D, bs=16,
                      dtype=torch.bfloat16, device="cuda", seed=i)
        nd = len(dec)
        kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
        torch.ops.llmaccel.paged_decode_attention(
            c["q"][:nd], c["k"][:nd], c["v"][:nd], kc, vc, c["slot_mapping"][:nd], c["block_tables"][:nd],
            c["context_lens"][:nd], None, None, scale=D ** -0.5)
        cu = c["cu_seqlens_q"][nd:] - c["cu_seqlens_q"][nd]
        out = torch.ops.llmaccel.paged_prefill_attention(
            c["q"][nd:], c["k"][nd:], c["v"][nd:], kc, vc, c["slot_mapping"][nd:], c["block_tables"][nd:],
            cu, c["context_lens"][nd:], None, None, scale=D ** -0.5, max_q_len=300)
        want = pa.paged_attention_ref(c["q"][nd:].float(), kc.float(), vc.float(), c["block_tables"][nd:],
                                      cu, c["context_lens"][nd:], D ** -0.5)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
        if i == 0:
            first = {k: _variants(k) for k in (pa._paged_prefill_kernel, pa._paged_decode_kernel)}
    assert {k: _variants(k) for k in first} == first
