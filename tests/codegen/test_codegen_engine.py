"""The lowered graph on the static KV cache computes what the reference executor computes.

CPU: eager, and traced whole by Dynamo (fullgraph) with the eager / aot_eager backends, which
check tracing and functionalisation of the in-place cache writes without Inductor's long
CPU compile. Tolerances: fp32, where only the order of a few sums differs (1e-4 relative to
the largest logit).
"""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from llmaccel.codegen.engine import DecodeEngine
from llmaccel.codegen.lower import lower
from llmaccel.compiler import executor
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.runtime.sampler import SamplingParams


def _stepwise(eng, ids, split):
    out = [eng.logits(ids[:, :split], 0)]
    out += [eng.logits(ids[:, t:t + 1], t) for t in range(split, ids.shape[1])]
    return torch.cat(out, 1)


def _close(out, ref):
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("src,passes,attn", [
    ("preset:tiny-llama", [], "sdpa"), ("preset:tiny-llama", ["fuse"], "grouped"),
    ("preset:tiny-gpt2", ["fuse"], "sdpa"), ("preset:tiny-gpt2", [], "grouped"),
    ("preset:tiny-llama", ["fuse"], "fused"), ("preset:tiny-gpt2", [], "fused"),
    ("preset:tiny-llama", ["fuse"], "rows")])
def test_eager_lowered_matches_reference(src, passes, attn):
    ids = torch.randint(0, 512, (2, 11))
    ref = load(src).logits(ids)
    eng = DecodeEngine(compile(src, passes, progress=False), 2, 16, compile=False, attn=attn)
    # fused: q and k reach the attention kernel unrotated (RoPE inside), gpt2 has no rope
    n_rope = eng.model.config.n_layers if attn == "fused" and "llama" in src else 0
    assert eng.rope_fused == n_rope
    _close(_stepwise(eng, ids, 6), ref)


@pytest.mark.parametrize("src,backend,linear,attn", [("preset:tiny-llama", "aot_eager", "rows", "auto"),
                                                     ("preset:tiny-gpt2", "eager", "mm", "auto"),
                                                     ("preset:tiny-llama", "aot_eager", "rows", "fused"),
                                                     ("preset:tiny-llama", "aot_eager", "mm", "rows")])
def test_compiled_fullgraph_matches_reference(src, backend, linear, attn):
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 512, (2, 9))
    ref = load(src).logits(ids)
    # fused: the cache-mutating custom op through functionalization (its CPU form is the reference)
    eng = DecodeEngine(compile(src, ["fuse"], progress=False), 2, 16, compile=True, backend=backend,
                       linear=linear, attn=attn)
    _close(_stepwise(eng, ids, 5), ref)
    # one graph for the logits step, traced once: positions do not cause recompiles
    assert counters["stats"]["unique_graphs"] == 1


def test_rope_tables_and_rows_are_exact_enough():
    m = load("preset:tiny-llama")
    low, rep = lower(m.gm, max_len=64, select="none", linear="rows")
    assert rep.rope == 2 * m.config.n_layers and rep.linear_rows == 7 * m.config.n_layers + 1
    ids = torch.randint(0, 512, (1, 20))
    pos = torch.arange(20)[None]
    _close(low(ids, pos, None), m.gm(ids, pos, None))


def test_greedy_text_identical_to_reference():
    torch._dynamo.reset()
    src = "preset:tiny-llama"
    ref = load(src)
    prompts = torch.randint(0, 512, (2, 7))
    eng = DecodeEngine(compile(src, ["fuse"], progress=False), 2, 32, compile=True, backend="aot_eager")
    _assert_greedy_as_reference(eng, ref.gm, prompts, 12)


def _assert_greedy_as_reference(eng, gm, prompts, n):
    """Two generates of the engine (the second on the cache the first left, not cleared) give
    the reference executor's greedy tokens for every row."""
    got = eng.generate(prompts, n)
    again = eng.generate(prompts, n)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for b in range(prompts.shape[0]):
        want = list(executor.generate_ids(gm, prompts[b].tolist(), params, eos_ids=set(),
                                          max_len=512, dtype=torch.float32))
        assert got[b].tolist() == want
        assert again[b].tolist() == want


def test_engine_rejects_bad_shapes():
    from llmaccel.errors import LlmaccelError

    eng = DecodeEngine(load("preset:tiny-llama"), 2, 16, compile=False)
    with pytest.raises(LlmaccelError, match="shape"):
        eng.generate(torch.zeros(3, 4, dtype=torch.long), 2)
    with pytest.raises(LlmaccelError, match="exceed"):
        eng.generate(torch.zeros(2, 10, dtype=torch.long), 7)
    with pytest.raises(LlmaccelError, match="linear"):
        DecodeEngine(load("preset:tiny-llama"), 1, 16, linear="gemm")


def test_int4_lowers():
    m = compile("preset:tiny-llama", ["fuse", "quant"],
                {"quant": {"bits": "4", "group_size": "32", "method": "rtn"}}, progress=False,
                eval_tokens=0)
    eng = DecodeEngine(m, 2, 16, compile=False)
    if eng.report.kernel_modules.get("quant_linear") == "ok":
        # on the CPU: aten's int4 GEMM on weights packed at lowering (CUDA: the Triton custom op)
        assert eng.report.cpu_traced == {"linear_int4": 4 * m.config.n_layers}  # qkv, o, gate_up, down
    ids = torch.randint(0, 512, (2, 9))
    _close(_stepwise(eng, ids, 5), m.logits(ids))


def _kivi_tiny(bits="2"):
    # groups of 8 tokens past a residual of 8: a 20-token sequence ages a group at several steps
    return compile("preset:tiny-llama", ["fuse", "kvquant"],
                   {"kvquant": {"bits": bits, "group": "8", "residual": "8"}}, progress=False, eval_tokens=0)


def _reference_stepwise(m, ids, split):
    ctx = executor.make_cache(m.gm, ids.shape[0], ids.shape[1], torch.float32)
    out = [executor.forward(m.gm, ids[:, :split], 0, ctx)]
    out += [executor.forward(m.gm, ids[:, t:t + 1], t, ctx) for t in range(split, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("bits,attn,backend", [("2", "rows", None), ("4", "fused", None),
                                               ("2", "auto", "aot_eager")])
def test_kivi_static_cache_matches_the_quantized_reference(bits, attn, backend):
    """A `kvquant` graph decodes on the static path with a KIVI cache that reads and writes as
    the reference QuantizedKVCache: same logits at every step (fp32), the prefill included."""
    torch._dynamo.reset()
    m = _kivi_tiny(bits)
    ids = torch.randint(0, 512, (2, 23))
    eng = DecodeEngine(m, 2, 32, compile=backend is not None, backend=backend or "inductor", attn=attn)
    assert set(eng.cache.specs) == set(range(m.config.n_layers))
    assert not hasattr(eng.cache, "k0")  # no full-precision buffers for quantized layers
    _close(_stepwise(eng, ids, 5), _reference_stepwise(m, ids, 5))


def test_kivi_static_greedy_text_identical_to_reference():
    torch._dynamo.reset()
    m = _kivi_tiny()
    prompts = torch.randint(0, 512, (2, 11))
    eng = DecodeEngine(m, 2, 48, compile=True, backend="aot_eager")
    _assert_greedy_as_reference(eng, m.gm, prompts, 30)


def test_kivi_static_cache_refuses_what_it_cannot_do():
    from llmaccel.codegen.speculative import SpeculativeDecoder
    from llmaccel.errors import LlmaccelError

    m = _kivi_tiny()
    eng = DecodeEngine(m, 1, 32, compile=False)
    with pytest.raises(LlmaccelError, match="position 0"):
        eng.logits(torch.zeros(1, 3, dtype=torch.long), 4)
    with pytest.raises(LlmaccelError, match="full-precision KV"):
        SpeculativeDecoder(eng, "ngram")
    from llmaccel.codegen.static_cache import StaticKVCache
    from llmaccel.ops.kvquant import make_spec

    with pytest.raises(LlmaccelError, match="power-of-two head_dim"):  # refused before any allocation
        StaticKVCache({0: (2, 48)}, 1, 64, torch.bfloat16, "cuda", {0: make_spec(2, 16, 32, 48)})
    sla = compile("preset:tiny-llama", ["sla"], progress=False, eval_tokens=0)
    with pytest.raises(LlmaccelError, match="softmax attention only"):
        DecodeEngine(sla, 1, 16, compile=False)


def test_norm_folds_into_the_rows_gemv():
    """After `fuse` (norm scales in the weights), every RMSNorm before a linear is computed by
    that linear's GEMV (linear_rows_rms): same logits in fp32."""
    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    low, rep = lower(m.gm, max_len=64, select="none", linear="rows")
    assert rep.norm_into_rows == 2 * m.config.n_layers  # qkv and gate/up of every layer
    ids = torch.randint(0, 512, (2, 20))
    pos = torch.arange(20)[None].expand(2, -1)
    _close(low(ids, pos, None), m.gm(ids, pos, None))


@pytest.mark.parametrize("passes", [["fuse"], []])
def test_gemv_lowering_fuses_the_neighbours(passes):
    """linear="gemv": every linear a llmaccel::gemv; after `fuse`, the SiLU-mul, the residual adds
    and the RMSNorms before linears inside them; without `fuse` (norm scales not folded, q, k, v
    apart) only the linears. Same logits in fp32 (the op's CPU form is its reference)."""
    m = compile("preset:tiny-llama", passes, progress=False)
    L = m.config.n_layers
    low, rep = lower(m.gm, max_len=64, select="none", linear="gemv")
    if passes:
        assert rep.gemv == {"gemv": 4 * L, "int4": 0, "glu": L, "residual": 2 * L, "norm": 2 * L}
        names = [getattr(n.target, "__name__", str(n.target)) for n in low.graph.nodes if n.op == "call_function"]
        assert not {"silu_mul", "add_rms_norm"} & set(names) and names.count("rms_norm") == 1  # before the LM head
    else:
        assert rep.gemv == {"gemv": 7 * L, "int4": 0, "glu": 0, "residual": 0, "norm": 0}
    ids = torch.randint(0, 512, (2, 20))
    pos = torch.arange(20)[None].expand(2, -1)
    _close(low(ids, pos, None), m.gm(ids, pos, None))


def _w4_tiny_llama(lm_head: bool):
    """tiny-llama after fuse and RTN W4 g32 (the LM head in int4 too, or not)."""
    return compile("preset:tiny-llama", ["fuse", "quant"],
                   {"quant": {"method": "rtn", "bits": 4, "group_size": 32, "lm_head": lm_head}},
                   progress=False, eval_tokens=0)


@pytest.mark.parametrize("lm_head", [True, False])
def test_gemv_lowering_of_int4_linears(lm_head):
    """W4 (fuse, then quant): every linear_int4 a llmaccel::gemv_int4 with the same neighbours
    inside as the bf16 GEMVs; an int4 LM head takes the final RMSNorm too (its scale folded
    into the head's own copy), so the graph is embedding, GEMVs, RoPE and attention. Same
    logits in fp32 (the op's CPU form is its reference)."""
    m = _w4_tiny_llama(lm_head)
    L = m.config.n_layers
    low, rep = lower(m.gm, max_len=64, linear="gemv")
    n = 4 * L + lm_head
    assert rep.gemv == {"gemv": n, "int4": n, "glu": L, "residual": 2 * L, "norm": 2 * L + lm_head}
    names = {getattr(n.target, "__name__", str(n.target)) for n in low.graph.nodes if n.op == "call_function"}
    assert not {"linear_int4", "linear_int4_cpu", "silu_mul", "add_rms_norm"} & names
    assert ("rms_norm" in names) != lm_head
    ids = torch.randint(0, 512, (2, 20))
    pos = torch.arange(20)[None].expand(2, -1)
    _close(low(ids, pos, None), m.gm(ids, pos, None))


def test_gemv_int4_engine_matches_reference_compiled():
    torch._dynamo.reset()
    ids = torch.randint(0, 512, (2, 9))
    m = _w4_tiny_llama(lm_head=True)
    eng = DecodeEngine(m, 2, 16, compile=True, backend="aot_eager", linear="gemv", attn="fused")
    assert eng.decode_report.gemv["int4"] == 4 * m.config.n_layers + 1
    _close(_stepwise(eng, ids, 5), m.logits(ids))


def test_gemv_lowering_of_a_gpt2_graph():
    """GPT-2 (LayerNorm, GELU MLP, biases): the linears become GEMVs with their biases, nothing
    else moves inside them."""
    m = compile("preset:tiny-gpt2", ["fuse"], progress=False)
    low, rep = lower(m.gm, max_len=64, select="none", linear="gemv")
    assert rep.gemv == {"gemv": 4 * m.config.n_layers, "int4": 0, "glu": 0, "residual": 0, "norm": 0}
    ids = torch.randint(0, 512, (2, 20))
    pos = torch.arange(20)[None].expand(2, -1)
    _close(low(ids, pos, None), m.gm(ids, pos, None))


def test_gemv_engine_matches_reference_compiled():
    torch._dynamo.reset()
    ids = torch.randint(0, 512, (2, 9))
    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    eng = DecodeEngine(m, 2, 16, compile=True, backend="aot_eager", linear="gemv", attn="fused")
    assert eng.decode_report.gemv["gemv"] == 4 * m.config.n_layers and eng.rope_fused == m.config.n_layers
    _close(_stepwise(eng, ids, 5), load("preset:tiny-llama").logits(ids))


def test_compiled_prefill_over_many_prompt_lengths():
    """The prefill compiles one variant per prompt length for its first few lengths and runs
    the others eagerly; Dynamo's recompile limit (shared by every engine's prefill) never
    surfaces, and the tokens are the eager prefill's."""
    torch._dynamo.reset()
    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    engines = [DecodeEngine(m, 1, 32, compile=True, backend="eager", compile_prefill=True) for _ in range(3)]
    plain = DecodeEngine(m, 1, 32, compile=False)
    g = torch.Generator().manual_seed(0)
    for P in range(3, 14):
        ids = torch.randint(0, 512, (1, P), generator=g)
        want = plain.prefill(ids)
        for eng in engines:
            assert torch.equal(eng.prefill(ids), want)
    assert all(len(e._prefill_lengths) <= 4 for e in engines)


def test_rope_fused_graph_runs_without_a_cache():
    """A decode graph rewritten by fuse_rope still computes a plain causal forward (ctx None):
    q and k are rotated outside the kernel then."""
    from llmaccel.codegen.static_cache import fuse_rope

    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    low, _ = lower(m.gm, max_len=32, select="none")
    assert fuse_rope(low) == m.config.n_layers
    assert "wrap(" not in "".join(l for l in low.code.splitlines() if "attention_rope" in l)
    ids = torch.randint(0, 512, (2, 9))
    pos = torch.arange(9)[None].expand(2, -1)
    _close(low(ids, pos, None), m.gm(ids, pos, None))


@pytest.mark.parametrize("V", [128256, 49152, 32000, 50257, 512])
def test_greedy_is_argmax_with_ties(V):
    """The two-stage argmax of the decode step: the first index of the maximum, ties included."""
    from llmaccel.codegen.engine import greedy

    g = torch.Generator().manual_seed(V)
    for t in range(6):
        x = torch.randn(3, V, generator=g).bfloat16()
        if t % 2:
            x = (2 * x).round()  # many equal values
        if t == 5:
            x[:, ::7] = x.max()  # the maximum in many chunks
        assert torch.equal(greedy(x), x.argmax(-1, keepdim=True))


def test_gemv_rewrites_leave_other_splits_alone():
    """SiLU-mul moves into a GEMV only after a split of its output in two halves along dim -1
    read as parts 0 and 1; a split along another dim keeps its own ops (same values)."""
    import operator

    from llmaccel import ops
    from llmaccel.codegen.lower import gemv_rewrites

    for dim, fused in ((-1, 1), (0, 0)):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        lin = g.call_function(ops.linear, (x, g.get_attr("w"), None))
        sp = g.call_method("split", (lin, [4, 4] if dim == -1 else [1, 1]), {"dim": dim})
        g.output(g.call_function(ops.silu_mul, (g.call_function(operator.getitem, (sp, 0)),
                                                g.call_function(operator.getitem, (sp, 1)))))
        root = torch.nn.Module()
        root.register_buffer("w", torch.randn(8, 8))
        gm = torch.fx.GraphModule(root, g)
        xs = torch.randn(2, 8)
        want = gm(xs)
        assert gemv_rewrites(gm)["glu"] == fused
        gm.recompile()
        torch.testing.assert_close(gm(xs), want)
