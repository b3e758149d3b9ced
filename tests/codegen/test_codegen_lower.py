"""Lowering maps IR ops to custom ops registered under a namespace, when their schema fits.

The custom ops here live in a test namespace (the real ones are `llmaccel::*`, registered by
llmaccel/kernels/*); their CPU implementation is the op's reference, so results are exact.
"""
import torch
import torch._dynamo

from llmaccel import ops
from llmaccel.codegen.lower import lower
from llmaccel.compiler import executor
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile

NS = "llmaccel_test"


@torch.library.custom_op(f"{NS}::silu_mul", mutates_args=())
def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return ops.silu_mul(gate, up)


@_silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op(f"{NS}::linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # no bias: must be rejected
    return ops.linear(x, weight)


def _run(gm, ids, batch, cache=None):
    cache = cache or executor.make_cache(gm, batch, 32, torch.float32, "cpu")
    return executor.forward(gm, ids, 0, cache)


def test_custom_ops_replace_matching_nodes():
    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    L = m.config.n_layers
    # silu_mul and the norms are eager_only (ops/table.py): select="all" (compiled steps) leaves
    # them to Inductor; select="eager" maps every op whose custom op the namespace registers
    assert lower(m.gm, max_len=32, select="all", namespace=NS)[1].custom == {}
    low, rep = lower(m.gm, max_len=32, select="eager", namespace=NS)
    assert rep.custom == {"silu_mul": L}
    assert "linear" in rep.rejected  # the IR linear passes a bias argument the schema lacks
    targets = {n.target for n in low.graph.nodes if n.op == "call_function"}
    assert torch.ops.llmaccel_test.silu_mul in targets and ops.silu_mul not in targets
    assert ops.silu_mul in {n.target for n in m.gm.graph.nodes}  # the source graph is untouched
    ids = torch.randint(0, 512, (2, 10))
    torch.testing.assert_close(_run(low, ids, 2), load("preset:tiny-llama").logits(ids),
                               rtol=1e-4, atol=1e-5)


def test_select_limits_lowering_and_traces_whole():
    m = compile("preset:tiny-llama", ["fuse"], progress=False)
    low, rep = lower(m.gm, max_len=32, select={"silu_mul"}, namespace=NS)
    assert rep.custom == {"silu_mul": m.config.n_layers}
    ids = torch.randint(0, 512, (1, 6))
    ref = _run(low, ids, 1)
    torch._dynamo.reset()
    pos = torch.arange(ids.shape[1])[None]
    out = torch.compile(lambda i: low(i, pos, None), backend="aot_eager", fullgraph=True)(ids)
    torch.testing.assert_close(out, ref)
    assert lower(m.gm, max_len=32, select="none", namespace=NS)[1].custom == {}


def test_a_weight_quantized_graph_runs_its_cpu_lm_head_in_int8_and_a_plain_one_in_fp32():
    """On the CPU the int4 linears of a W4 graph take x in bf16 (int_codes.cpu_act_dtype); its int8
    linears and every weight-quantized graph's LM head run int8_mm_cpu (x at 16 bits a row; the
    head in int8 codes with one scale per row, converted once); the logits stay within those
    roundings of the unlowered graph's. An unquantized fp32 graph keeps the reference's head."""
    from llmaccel.ir import weight_of
    from llmaccel.kernels.int_codes import int8_mm_cpu

    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(5))
    for bits in ("4", "8"):
        m = compile("preset:tiny-llama", ["quant"], {"quant": {"method": "rtn", "bits": bits, "group_size": "32"}},
                    eval_tokens=0, progress=False)
        low, rep = lower(m.gm, max_len=64, select="eager")
        heads = [n for n in low.graph.nodes if n.target is int8_mm_cpu
                 and weight_of(low, n.args[1]).shape[1] == m.config.vocab_size]
        assert len(heads) == 1 and not any(n.target is ops.lm_head for n in low.graph.nodes)
        codes, scale = weight_of(low, heads[0].args[1]), weight_of(low, heads[0].args[3])
        assert codes.dtype == torch.int8 and scale.dtype == torch.float32
        want = executor.forward(m.gm, ids)
        got = executor.forward(low, ids)
        assert got.dtype == torch.float32
        # the int4 linears' bf16 x and the head's int8 codes (half a step of absmax / 127 a
        # weight): a few bf16 roundings
        assert (got - want).abs().max() <= 2 ** -5 * want.abs().max(), bits
    plain = load("preset:tiny-llama")
    low, _ = lower(plain.gm, max_len=64, select="eager")
    assert not any(n.target is int8_mm_cpu for n in low.graph.nodes)
    torch.testing.assert_close(executor.forward(low, ids), executor.forward(plain.gm, ids))
