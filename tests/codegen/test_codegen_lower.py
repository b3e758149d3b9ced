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
