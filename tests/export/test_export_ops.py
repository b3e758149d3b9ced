"""Every IR op's ONNX translation on the tiny presets, run by onnxruntime against the reference.

Tolerance: fp32 logits within 5e-5 (the tiny models' logits are O(10); what differs is the
order of fp32 sums inside ONNX Runtime's kernels).
"""
import collections

import numpy as np
import onnx
import pytest
import torch

from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.export.exporter import export
from llmaccel.export.runtime import OnnxModel, genai_greedy

TOL = 5e-5


def _model(src, passes, opts=None):
    if not passes:
        return load(src)
    return compile(src, passes, opts or {}, eval_tokens=0, progress=False)


def _op_types(folder):
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return collections.Counter((n.domain, n.op_type) for n in m.graph.node)


def _check_logits(m, om):
    ids = torch.randint(0, m.config.vocab_size, (2, 12))
    assert (m.logits(ids) - om.logits(ids)).abs().max().item() <= TOL
    c1, c2 = m.new_cache(2, 12), om.new_cache(2, 12)
    a, b = m.logits(ids[:, :7], 0, c1), om.logits(ids[:, :7], 0, c2)
    assert (a - b).abs().max().item() <= TOL
    for t in range(7, 12):  # cached decode, one token at a time
        a, b = m.logits(ids[:, t:t + 1], t, c1), om.logits(ids[:, t:t + 1], t, c2)
        assert (a - b).abs().max().item() <= TOL, t


CASES = [  # (source, passes, options, format, ops the export must contain)
    ("preset:tiny-llama", "", None, "onnx", {"Gather", "MatMul", "Softmax", "Cos"}),
    ("preset:tiny-llama", "fuse,quant", {"quant": {"method": "rtn"}}, "onnx", {"DequantizeLinear", "Split"}),
    ("preset:tiny-llama", "quant", {"quant": {"bits": "8", "method": "rtn"}}, "onnx", {"Cast", "Mul"}),
    ("preset:tiny-llama", "fuse,quant", {"quant": {"bits": "8", "act": "int8", "method": "rtn",
                                                   "n_samples": "2", "seq_len": "16"}},
     "onnx", {"Round", "ReduceMax"}),
    ("preset:tiny-llama", "fuse,relu", {"relu": {"calib_samples": "2", "calib_seq_len": "16"}}, "onnx",
     {"Relu"}),
    ("preset:tiny-llama", "bitlinear", None, "onnx", {"Round", "Clip"}),
    ("preset:tiny-llama", "repbn", {"repbn": {"samples": "2", "seq_len": "16"}}, "onnx", {"Max", "Min"}),
    ("preset:tiny-llama", "fuse,quant", {"quant": {"method": "rtn"}}, "genai",
     {"GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization"}),
    ("preset:tiny-gpt2", "fuse", None, "genai",
     {"GroupQueryAttention", "LayerNormalization", "Gelu", "Gemm"}),
]


@pytest.mark.parametrize("src,passes,opts,fmt,want", CASES,
                         ids=[f"{c[0][7:]}-{c[1] or 'ir'}-{c[3]}" for c in CASES])
def test_export_matches_the_reference(tmp_path, src, passes, opts, fmt, want):
    m = _model(src, passes, opts)
    export(m, tmp_path, fmt=fmt)
    ops = _op_types(tmp_path)
    assert want <= {op for _, op in ops}, ops
    if fmt == "onnx":
        assert {d for d, _ in ops} == {""}  # the standard opset only
    _check_logits(m, OnnxModel(str(tmp_path)))


def test_matmulnbits_reads_the_int4_codes_bit_for_bit(tmp_path):
    m = _model("preset:tiny-llama", "fuse,quant", {"quant": {"method": "rtn"}})
    export(m, tmp_path, fmt="genai")
    proto = onnx.load(str(tmp_path / "model.onnx"))
    init = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    for name in ("layers.0.qkv", "layers.1.down"):
        for part in ("qweight", "zeros"):
            want = getattr(m.gm.get_submodule(name), part).numpy()
            assert np.array_equal(init[f"{name}.{part}"], want), (name, part)
    node = next(n for n in proto.graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == 128 and attrs["K"] == 64


def test_weights_are_external_data(tmp_path):
    export(load("preset:tiny-llama"), tmp_path, fmt="onnx")
    proto = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    big = [t for t in proto.graph.initializer if np.prod(t.dims) >= 1024]
    assert big and all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)
    assert (tmp_path / "model.onnx").stat().st_size < 64 * 1024 < (tmp_path / "model.onnx.data").stat().st_size


def test_genai_folder_generates_through_onnxruntime_genai(tmp_path):
    pytest.importorskip("onnxruntime_genai")
    from llmaccel.sampling import SamplingParams

    m = _model("preset:tiny-llama", "fuse,quant", {"quant": {"method": "rtn"}})
    export(m, tmp_path, fmt="genai")
    prompt = [1, 17, 250, 33, 90]
    want = list(m.generate_ids(prompt, SamplingParams(temperature=0, max_tokens=16)))
    got = genai_greedy(str(tmp_path), prompt, 16)
    assert got == want


@pytest.mark.parametrize("passes,opts,op", [
    ("kvquant", None, "kv_quant_attention"), ("sla", {"sla": {"init": "zeros"}}, "linear_attention")])
def test_ops_without_an_onnx_form_are_refused_by_name(tmp_path, passes, opts, op):
    m = _model("preset:tiny-llama", passes, opts)
    with pytest.raises(LlmaccelError, match=f"'{op}' has no ONNX translation") as e:
        export(m, tmp_path / "out", fmt="onnx")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_every_op_of_the_table_is_translated_or_refused_with_a_reason():
    from llmaccel.export.exporter import translations
    from llmaccel.export.refusals import REFUSED
    from llmaccel.ops.table import OPS

    for fmt in ("onnx", "genai"):
        table = translations(fmt)
        missing = [name for name, spec in OPS.items() if spec.ref not in table and spec.ref not in REFUSED]
        assert not missing, (fmt, missing)
    # where each translation lives, as ops/table.py says: t_<name> (std_ops), g_<name> (genai_ops)
    from llmaccel.export.genai_ops import GENAI_TRANSLATIONS
    from llmaccel.export.std_ops import TRANSLATIONS
    for name, spec in OPS.items():
        if spec.ref in TRANSLATIONS:
            assert TRANSLATIONS[spec.ref].__name__ == f"t_{name}", name
        if spec.ref in GENAI_TRANSLATIONS:
            assert GENAI_TRANSLATIONS[spec.ref].__name__ == f"g_{name}", name


def test_bfloat16_export_is_refused(tmp_path):
    with pytest.raises(LlmaccelError, match="float32 or float16"):
        export(load("preset:tiny-llama"), tmp_path, fmt="onnx", dtype="bfloat16")


def test_float16_export_runs_close_to_fp32(tmp_path):
    m = load("preset:tiny-llama")
    export(m, tmp_path, fmt="onnx", dtype="float16")
    ids = torch.randint(0, 512, (1, 10))
    got = OnnxModel(str(tmp_path)).logits(ids).float()
    assert (got - m.logits(ids)).abs().max().item() < 0.05
