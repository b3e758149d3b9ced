"""sla's attention transfer (passes/sla_fit.py): on tiny-llama, each layer's linear attention
block with W_q, W_k, W_v, the conv and W_o fitted to the softmax block's outputs is closer to it,
on activations no fit saw, than the closed-form start with only W_o refitted
(`fit_qkv_steps=0`); the fitted conv is installed in the graph."""
import torch

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.ir import op_nodes, positions, probe, weight_of
from llmaccel.ops.sla import linear_attention
from llmaccel.passes.fitting import _attention_input, rel_err, subgraph

from tests.passes.test_gqa_fit import run_pass

SRC = "preset:tiny-llama"
# fit_target=local: each layer fitted to the original block on its own inputs, as measured below
FIT = {"fit": "true", "fit_target": "local", "fit_samples": "32", "fit_seq_len": "64",
       "calib_samples": "8", "calib_seq_len": "64", "fit_report_tokens": "0"}


def _sla(**opts):
    return run_pass(load(SRC), "sla", {**FIT, **opts})


def test_attention_transfer_lowers_block_error_on_heldout_activations():
    start = _sla(fit_qkv_steps="0")
    fitted = _sla()
    st = fitted.stats["fit"]["qkv_fit"]
    assert st["layers_fitted"] >= 1 and all(f <= p for p, f in st["heldout_err"])
    convs = [weight_of(g.gm, n.args[4]) for g in (start, fitted) for n in op_nodes(g.gm, linear_attention)]
    half = len(convs) // 2
    assert any(not torch.equal(a, b) for a, b in zip(convs[:half], convs[half:]))  # conv trained
    orig = load(SRC).gm
    atts = op_nodes(orig, ops.attention)
    outs = [next(iter(a.users)) for a in atts]
    ins = [_attention_input(a) for a in atts]
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(99))
    pos = positions(ids)
    pos_name = [n for n in orig.graph.nodes if n.op == "placeholder"][1].name
    vals = probe(orig, ins + outs)(ids, pos, None)
    errs = {label: [rel_err(subgraph(g.gm, [x.name, pos_name], o.name)(xv, pos), y)
                    for x, o, xv, y in zip(ins, outs, vals[:len(atts)], vals[len(atts):])]
            for label, g in (("start", start), ("fitted", fitted))}
    # every layer lower than the closed-form start with W_o refitted, by at least 1% (measured:
    # 4.5% and 2.8% lower; a random tiny model's attention is near uniform, which linear
    # attention already follows; on SmolLM2-135M the fit does far more, docs/quality.md)
    assert all(f <= 0.99 * s for s, f in zip(errs["start"], errs["fitted"])), errs
