"""Paged decode attention with RoPE and the KV write inside: the reference against RoPE, the
write and paged attention done apart; the Triton kernel against the reference (interpreter on
the CPU at small shapes, fp32 and fp16; tolerances as test_paged_attention.py)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmaccel.codegen.lower import rope_table, rope_tables  # noqa: E402
from llmaccel.kernels import paged_rope as pr  # noqa: E402
from llmaccel.kernels.paged_attention import paged_decode_ref, write_kv_ref  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(pos, H, Hkv, D, bs, width, dtype, device="cpu", fused=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(pos)
    nblocks = B * width + 2
    perm = torch.randperm(nblocks, generator=g)[: B * width].view(B, width).to(torch.int32)
    kc = torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype)
    qkv = torch.randn(B, H + 2 * Hkv, D, generator=g).to(dtype)
    cos, sin = rope_tables(D, 10000.0, None, width * bs, "cpu")
    t = dict(kc=kc, vc=vc, qkv=qkv, pos=torch.tensor(pos), bt=perm, cos=cos, sin=sin)
    return {n: x.to(device) for n, x in t.items()}


def run(fn, c, fused):
    kc, vc = c["kc"].clone(), c["vc"].clone()
    H = c["qkv"].shape[1] - 2 * kc.shape[2]
    if fused:
        q, k, v = c["qkv"], None, None
    else:
        q, k, v = (x.contiguous() for x in c["qkv"].split([H, kc.shape[2], kc.shape[2]], 1))
    out = fn(q, k, v, kc, vc, c["pos"], c["bt"], c["cos"], c["sin"], 0.3)
    return out, kc, vc


def test_reference_is_rope_then_write_then_paged_attention():
    c = make_case([0, 5, 13], H=4, Hkv=2, D=16, bs=4, width=4, dtype=torch.float32)
    out, kc, vc = run(pr.paged_rope_decode_ref, c, fused=True)
    q, k, v = c["qkv"].split([4, 2, 2], 1)
    B = q.shape[0]
    pos = c["pos"]
    qr = torch.cat([rope_table(q[b:b + 1].reshape(1, 1, -1), c["cos"], c["sin"], pos[b:b + 1][None],
                               head_dim=16) for b in range(B)]).view(B, 4, 16)
    kr = torch.cat([rope_table(k[b:b + 1].reshape(1, 1, -1), c["cos"], c["sin"], pos[b:b + 1][None],
                               head_dim=16) for b in range(B)]).view(B, 2, 16)
    kc2, vc2 = c["kc"].clone(), c["vc"].clone()
    slots = torch.tensor([int(c["bt"][b, p // 4]) * 4 + p % 4 for b, p in enumerate(pos.tolist())])
    write_kv_ref(kr, v, kc2, vc2, slots)
    want = paged_decode_ref(qr, kc2, vc2, c["bt"], (pos + 1).int(), 0.3)
    torch.testing.assert_close(out, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.skipif(pr.triton is None, reason="triton not installed")
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, pr.CPU_ROWS + 1])
@pytest.mark.parametrize("tables", ["shuffled", "in-order"])
@pytest.mark.parametrize("form", ["cpu", "masked"])
def test_cpu_form_matches_reference(rows, dtype, fused, tables, form):
    """The eager CPU form (row by row over each row's own context, a view of the cache where a
    row's blocks are in order, else gathered; the reference past CPU_ROWS) and the compiled
    step's masked form (every row over its whole table) against the reference, fresh random
    positions, the same cache writes."""
    pos = torch.randint(0, 23, (rows,)).tolist()
    c = make_case(pos, H=6, Hkv=2, D=16, bs=4, width=6, dtype=dtype, fused=fused,
                  seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    if tables == "in-order":  # row b's blocks b*6 .. b*6 + 5, as a lone request's are
        c["bt"] = torch.arange(rows * 6, dtype=torch.int32).view(rows, 6)
    want, kc_w, vc_w = run(pr.paged_rope_decode_ref, c, fused)
    out, kc, vc = run(pr.paged_rope_decode_cpu if form == "cpu" else pr.paged_rope_decode_masked, c, fused)
    torch.testing.assert_close(out, want, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(kc, kc_w) and torch.equal(vc, vc_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "q-k-v"])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_matches_reference(dtype, fused, splits):
    c = make_case([0, 7, 30, 17], H=6, Hkv=2, D=32, bs=4, width=8, dtype=dtype, fused=fused)
    want, kc_w, vc_w = run(pr.paged_rope_decode_ref, c, fused)
    got, kc, vc = run(lambda *a: pr.paged_rope_decode_triton(*a, num_splits=splits), c, fused)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(kc.float(), kc_w.float(), atol=TOL[dtype], rtol=0)
    assert torch.equal(vc, vc_w)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(32, 8, 64), (9, 3, 64), (32, 32, 128)], ids=["llama-1b", "smollm2", "llama2-7b"])
def test_triton_real_shapes_bf16(shape):
    H, Hkv, D = shape
    pos = [0, 15, 16, 700, 1023, 333]
    c = make_case(pos, H=H, Hkv=Hkv, D=D, bs=16, width=64, dtype=torch.bfloat16, device="cuda")
    want, kc_w, _ = run(pr.paged_rope_decode_ref, c, True)
    got, kc, _ = run(pr.paged_rope_decode_triton, c, True)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[torch.bfloat16], rtol=0)
    torch.testing.assert_close(kc.float(), kc_w.float(), atol=TOL[torch.bfloat16], rtol=0)
    for r in range(len(pos)):  # one row: programmatic dependent launch, first tile peeled
        one = {**c, "qkv": c["qkv"][r:r + 1], "pos": c["pos"][r:r + 1], "bt": c["bt"][r:r + 1]}
        got, kc, _ = run(lambda *a: pr.paged_rope_decode_triton(*a, pdl=True), one, True)
        torch.testing.assert_close(got.float(), want[r:r + 1].float(), atol=TOL[torch.bfloat16], rtol=0)


@pytest.mark.skipif(pr.triton is None, reason="triton not installed")
@pytest.mark.parametrize("peel", [False, True], ids=["loop", "first-tile-peeled"])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_several_tiles_and_empty_splits(splits, peel):
    """Tiles of 16 keys over contexts up to 31: the peeled first tile, the tiles after it, and
    (3 splits of 16) splits past a row's position, which see no key."""
    c = make_case([0, 3, 16, 17, 30, 31], H=4, Hkv=2, D=16, bs=4, width=12, dtype=torch.float32)
    want, kc_w, vc_w = run(pr.paged_rope_decode_ref, c, True)
    got, kc, vc = run(lambda *a: pr.paged_rope_decode_triton(*a, num_splits=splits, block_n=16,
                                                             peel=peel), c, True)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=0)
    assert torch.equal(vc, vc_w)


@pytest.mark.skipif(pr.triton is None, reason="triton not installed")
@pytest.mark.parametrize("splits", [2, 5])
def test_triton_splits_share_each_rows_context(splits):
    """The kernel sizes the splits to each row's position (whole tiles of 16): rows of 1-95
    keys over 2 or 5 splits, several tiles a split on the long rows, none on the short ones'
    last splits; the split that owns the position writes the new key."""
    c = make_case([0, 9, 47, 48, 94, 95], H=4, Hkv=2, D=16, bs=4, width=24, dtype=torch.float32, seed=3)
    want, kc_w, vc_w = run(pr.paged_rope_decode_ref, c, True)
    got, kc, vc = run(lambda *a: pr.paged_rope_decode_triton(*a, num_splits=splits, block_n=16), c, True)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=0)
    torch.testing.assert_close(kc, kc_w, atol=TOL[torch.float32], rtol=0)
    assert torch.equal(vc, vc_w)
