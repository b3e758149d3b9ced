"""Paged KIVI decode attention against the contiguous KIVI reference (llmaccel.ops.kvquant).

CPU: the paged reference and the Triton kernel under TRITON_INTERPRET=1 at small shapes (fp32,
fp16). GPU (@cuda): SmolLM2 and Llama-1B decode shapes, bf16, through the custom op.
Tolerances: 2e-3 (fp32) / 1e-2 (fp16, bf16) absolute on outputs of unit scale; the kernel
keeps dequantized values rounded to the cache dtype, as the reference does.
"""
import functools

import pytest
import torch

from llmaccel.kernels import paged_kivi as pk
from llmaccel.ops import kvquant as ref

INTERPRETED = pk.HAS_TRITON and type(pk._paged_kivi_decode_kernel).__name__ == "InterpretedFunction"


def _cache(lens, Hkv, D, G, R, bits, dtype, device="cpu", seed=0):
    """A paged cache holding, for each sequence, qlen(L) packed tokens and the rest in fp blocks
    at shuffled block ids; plus each sequence's contiguous form for ops.kvquant's reference."""
    g = torch.Generator().manual_seed(seed)
    vg = min(G, D)
    nq = [ref.quantized_len(L, {"group": G, "residual": R}) // G for L in lens]
    nb = [-(-L // G) for L in lens]
    NQ, NF = sum(nq) + 1, sum(b - q for b, q in zip(nb, nq)) + 1
    pq, pf = torch.randperm(NQ, generator=g).tolist(), torch.randperm(NF, generator=g).tolist()
    kp = torch.zeros(NQ, Hkv, G, D * bits // 8, dtype=torch.uint8)
    vp = torch.zeros_like(kp)
    ks, km = torch.zeros(NQ, Hkv, D, dtype=dtype), torch.zeros(NQ, Hkv, D, dtype=dtype)
    vs, vm = torch.zeros(NQ, Hkv, G, D // vg, dtype=dtype), torch.zeros(NQ, Hkv, G, D // vg, dtype=dtype)
    fk = torch.randn(NF, G, Hkv, D, generator=g).to(dtype)
    fv = torch.randn(NF, G, Hkv, D, generator=g).to(dtype)
    W = max(nb)
    bt = torch.zeros(len(lens), W, dtype=torch.int32)
    contiguous = []
    for s, L in enumerate(lens):
        k = (torch.randn(Hkv, nq[s] * G, D, generator=g) + torch.randn(Hkv, 1, D, generator=g)).to(dtype)
        v = torch.randn(Hkv, nq[s] * G, D, generator=g).to(dtype)
        kq, kss, kmm = ref.quantize_keys(k, bits, G)
        vq, vss, vmm = ref.quantize_values(v, bits, vg)
        ids_q = [pq.pop() for _ in range(nq[s])]
        ids_f = [pf.pop() for _ in range(nb[s] - nq[s])]
        bt[s, : nb[s]] = torch.tensor(ids_q + ids_f, dtype=torch.int32)
        for i, b in enumerate(ids_q):
            sl = slice(i * G, (i + 1) * G)
            kp[b], vp[b], vs[b], vm[b] = kq[:, sl], vq[:, sl], vss[:, sl], vmm[:, sl]
            ks[b], km[b] = kss[:, i], kmm[:, i]
        nres = L - nq[s] * G
        kr = fk[ids_f].flatten(0, 1)[:nres].transpose(0, 1) if ids_f else fk[:0, 0].transpose(0, 1)
        vr = fv[ids_f].flatten(0, 1)[:nres].transpose(0, 1) if ids_f else fv[:0, 0].transpose(0, 1)
        contiguous.append((kq, kss, kmm, vq, vss, vmm, kr, vr, nq[s] * G, nres))
    paged = [t.to(device) for t in (kp, ks, km, vp, vs, vm, fk, fv, bt)]
    paged += [torch.tensor(x, dtype=torch.int32, device=device) for x in (nq, lens)]
    return paged, contiguous


def _contiguous_ref(q, contiguous, *, scale, bits, G, vg):
    outs = []
    for s, (kq, kss, kmm, vq, vss, vmm, kr, vr, n_q, n_r) in enumerate(contiguous):
        outs.append(ref.decode_attention_ref(
            q[s: s + 1], kq[None], kss[None], kmm[None], vq[None], vss[None], vmm[None], kr[None],
            vr[None], torch.tensor([n_q]), torch.tensor([n_r]), scale=scale, bits=bits, group=G,
            value_group=vg))
    return torch.cat(outs)


SMALL = [((1, 40, 75, 130), 2, 4, 16, 16, 32, 4),   # GQA 2, some sequences all full precision
         ((64, 100), 1, 3, 16, 32, 0, 2),            # residual 0, three query heads per KV head
         ((17, 150), 2, 2, 32, 16, 16, 4)]


@pytest.mark.parametrize("lens,Hkv,gq,D,G,R,bits", SMALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_reference_matches_contiguous_reference(lens, Hkv, gq, D, G, R, bits, dtype):
    paged, contiguous = _cache(lens, Hkv, D, G, R, bits, dtype)
    q = torch.randn(len(lens), Hkv * gq, D).to(dtype)
    kw = dict(scale=D ** -0.5, bits=bits, group=G, value_group=min(G, D))
    out = pk.paged_kivi_decode_ref(q, *paged, **kw)
    want = _contiguous_ref(q, contiguous, scale=kw["scale"], bits=bits, G=G, vg=kw["value_group"])
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=0)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton imported under TRITON_INTERPRET=1")
@pytest.mark.parametrize("lens,Hkv,gq,D,G,R,bits", SMALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_reference(lens, Hkv, gq, D, G, R, bits, dtype):
    paged, _ = _cache(lens, Hkv, D, G, R, bits, dtype)
    q = torch.randn(len(lens), Hkv * gq, D).to(dtype)
    kw = dict(scale=D ** -0.5, bits=bits, group=G, value_group=min(G, D))
    want = pk.paged_kivi_decode_ref(q, *paged, **kw)
    out = pk.paged_kivi_decode_triton(q, *paged, **kw, target_programs=64)  # several splits
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("Hkv,gq,D", [(3, 3, 64), (8, 4, 64)], ids=["smollm2", "llama-1b"])
@pytest.mark.parametrize("bits,G", [(4, 32), (2, 16)])
def test_cuda_kernel_at_real_shapes(Hkv, gq, D, bits, G):
    lens = [1, 130, 1000, 4097, 257, 2048, 33, 3000]
    paged, _ = _cache(lens, Hkv, D, G, 128, bits, torch.bfloat16, device="cuda")
    q = torch.randn(len(lens), Hkv * gq, D, device="cuda", dtype=torch.bfloat16)
    kw = dict(scale=D ** -0.5, bits=bits, group=G, value_group=min(G, D))
    fp32 = [t.float() if t.is_floating_point() else t for t in paged]
    want = pk.paged_kivi_decode_ref(q.float(), *fp32, **kw)
    out = torch.ops.llmaccel.paged_kivi_decode(q, *paged, **kw)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=0)


@pytest.mark.skipif(not INTERPRETED, reason="needs triton imported under TRITON_INTERPRET=1")
def test_runtime_decode_through_the_triton_kernel(monkeypatch):
    """The paged runtime's decode steps routed through the (interpreted) Triton kernel: the
    metadata it builds (tables, packed counts, lengths) drive the kernel as the reference."""
    from llmaccel import LLM, SamplingParams
    from llmaccel.compiler.pipeline import compile

    m = compile("preset:tiny-llama", ["kvquant"], {"kvquant": {"bits": 2, "residual": 16}},
                eval_tokens=0, progress=False)
    prompts = [list(range(3, 3 + n)) for n in (7, 40)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)  # 40 + 12 crosses two groups
    ref = [list(m.generate_ids(p, params)) for p in prompts]
    monkeypatch.setattr(pk, "paged_kivi_decode_ref",
                        functools.partial(pk.paged_kivi_decode_triton, target_programs=1))
    outs = LLM(m, kv_cache_tokens=1024).generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
