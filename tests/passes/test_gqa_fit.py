"""gqa's W_q/W_k/W_v fit (passes/gqa_fit.py) on tiny-llama with alike (not redundant) KV heads:
on activations no fit saw, each layer's merged attention block, fitted to the original block's
outputs, is closer to the original than the PCA merge with only W_o refitted
(`fit_qkv_steps=0`), by a stated margin."""
import torch

from llmaccel import ops
from llmaccel.compiler.model import load
from llmaccel.ir import is_op, op_nodes, positions, probe, weight_of
from llmaccel.compiler.registry import get_pass
from llmaccel.passes.base import PassContext, Progress, make_config
from llmaccel.passes.fitting import _attention_input, rel_err, subgraph

# fit_target=local: each layer is fitted to the original block on its own inputs, which is what
# the held-out check below measures (source would also fold the drift of earlier layers in)
FIT = {"kv_heads": "1", "fit": "true", "fit_target": "local", "fit_samples": "32",
       "fit_seq_len": "64", "calib_samples": "8", "calib_seq_len": "64", "fit_report_tokens": "0"}


def _correlated_heads(model, noise: float) -> None:
    """Make KV head j > 0 a transform of head 0 plus independent noise (a model's heads are alike
    but not redundant): the PCA merge is then close but not exact, and a fit has room to help.
    Query weights are scaled up so that attention is peaked and the keys matter."""
    g = torch.Generator().manual_seed(1)
    hd = model.config.head_dim
    for att in op_nodes(model.gm, ops.attention):
        q_lin = att.args[0].args[0] if is_op(att.args[0], ops.rope) else att.args[0]
        weight_of(model.gm, q_lin.args[1]).mul_(3.0)
        for lin in (att.args[1].args[0] if is_op(att.args[1], ops.rope) else att.args[1], att.args[2]):
            w = weight_of(model.gm, lin.args[1])
            for j in range(1, w.shape[0] // hd):
                A = torch.eye(hd) + 0.3 * torch.randn(hd, hd, generator=g)
                w[j * hd:(j + 1) * hd] = A @ w[:hd] + noise * w[:hd].std() * torch.randn(w[:hd].shape, generator=g)


def _model(src: str):
    model = load(src)
    _correlated_heads(model, 0.5)
    return model


def run_pass(model, name: str, opts: dict):
    """The pass over model, calibrated on seeded random ids (the same for every run)."""
    ctx = PassContext(model.config, progress=Progress(False), calib_source=lambda n, s: torch.randint(
        0, model.config.vocab_size, (n, s), generator=torch.Generator().manual_seed(0)))
    cls = get_pass(name)
    res = cls(make_config(cls, opts)).run(model.gm, ctx)
    res.gm.recompile()
    return res


def _merged(src: str, **opts):
    return run_pass(_model(src), "gqa", {**FIT, **opts})


def _block_errors(src: str, graphs: dict, ids: torch.Tensor) -> dict[str, list[float]]:
    """Per layer: relative error of each graph's attention block (q/k/v linears to W_o) against
    the original block, both on the original model's attention inputs for ids."""
    orig = _model(src).gm
    atts = op_nodes(orig, ops.attention)
    outs = [next(iter(a.users)) for a in atts]
    ins = [_attention_input(a) for a in atts]   # the normed hidden state the q/k/v linears read
    pos = positions(ids)
    pos_name = [n for n in orig.graph.nodes if n.op == "placeholder"][1].name
    vals = probe(orig, ins + outs)(ids, pos, None)
    xs, ys = vals[:len(atts)], vals[len(atts):]
    errs = {}
    for label, gm in graphs.items():
        errs[label] = []
        for x_node, o_node, x, y in zip(ins, outs, xs, ys):
            block = subgraph(gm, [x_node.name, pos_name], o_node.name)
            errs[label].append(rel_err(block(x, pos), y))
    return errs


def test_fitted_qkv_lowers_attention_error_on_heldout_activations():
    src = "preset:tiny-llama"
    wo_only = _merged(src, fit_qkv_steps="0")
    fitted = _merged(src)
    st = fitted.stats["fit"]["qkv_fit"]
    assert st["layers_fitted"] >= 1
    # on the calibration's held-out windows the fitted merge won wherever it was kept
    assert all(f <= p for p, f in st["heldout_err"])
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(99))
    errs = _block_errors(src, {"pca": wo_only.gm, "fitted": fitted.gm}, ids)
    # every layer at least 10% lower error than the PCA merge with W_o refitted (measured: 19%
    # and 23% lower)
    assert all(f <= 0.9 * p for p, f in zip(errs["pca"], errs["fitted"])), errs
