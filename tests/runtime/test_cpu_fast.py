"""The CPU decode step compiled by Inductor (LLM's default where a C++ compiler is found): the
same greedy tokens as the reference executor, a W4 graph's through its CPU forms, and every
fallback named in metrics()."""
import pytest
import torch

from llmaccel import LLM, SamplingParams, compile, ops
from llmaccel.runtime import decode

pytestmark = pytest.mark.cpu_fast
needs_compiler = pytest.mark.skipif(decode._no_cpp_compiler() is not None,
                                    reason="no C++ compiler for Inductor")


@needs_compiler
def test_the_cpu_decode_step_is_compiled_and_greedy_matches_the_reference(tiny, prompts, reference, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CPU_BF16", "0")  # the exact fp32 linears
    llm = LLM(tiny, max_num_seqs=4)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    m = llm.metrics()
    assert m["decode_compiled"] == "inductor" and m["graph_failures"] == {}
    assert m["threads"] == torch.get_num_threads() and m["cpu_bf16_linears"] == 0
    assert got == [r[:12] for r in reference]


@needs_compiler
def test_a_w4_graph_compiled_on_the_cpu_decodes_as_uncompiled():
    """W4's CPU forms (int4 GEMMs with x in bf16, the int8 head) traced into the compiled step:
    the same greedy tokens as the same graph's uncompiled step."""
    m = compile("preset:tiny-llama", ["fuse", "quant"], {"quant": {"method": "rtn", "group_size": "32"}},
                eval_tokens=0, progress=False)
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 30)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = {}
    for c in (True, False):
        llm = LLM(m, max_num_seqs=2, compile=c)
        outs[c] = [o.token_ids for o in llm.generate(ps, sp)]
        assert llm.metrics()["decode_compiled"] == ("inductor" if c else "eager (compile off)")
    assert outs[True] == outs[False]


def test_fp32_linears_run_in_bf16_where_the_cpu_has_bf16_dot_products(monkeypatch):
    """Every linear and the head of an fp32 graph take bf16 weights and x (int_codes.linear_bf16_cpu,
    the weight converted once), sums and output in fp32: logits within bf16 rounding of the
    reference's; with LLMACCEL_CPU_BF16=0, or on a CPU without them, the fp32 linears."""
    from llmaccel import load
    from llmaccel.codegen.lower import lower
    from llmaccel.compiler import executor
    from llmaccel.kernels import int_codes

    m = load("preset:tiny-llama")
    ids = torch.randint(0, 512, (2, 9))
    monkeypatch.setattr(int_codes, "cpu_bf16_dots", lambda: True)  # the form, whatever this CPU
    low, _ = lower(m.gm, max_len=64, select="eager")
    n = sum(x.target is int_codes.linear_bf16_cpu for x in low.graph.nodes)
    assert n == sum(x.target in (ops.linear, ops.lm_head) for x in m.gm.graph.nodes) > 0
    want, got = executor.forward(m.gm, ids), executor.forward(low, ids)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 2 ** -5 * want.abs().max()  # bf16 x and weights, every layer
    monkeypatch.setattr(int_codes, "cpu_bf16_dots", lambda: False)
    low, _ = lower(m.gm, max_len=64, select="eager")
    assert not any(x.target is int_codes.linear_bf16_cpu for x in low.graph.nodes)
    torch.testing.assert_close(executor.forward(low, ids), want)


def test_without_a_compiler_the_step_runs_eagerly_and_says_why(tiny, monkeypatch):
    monkeypatch.setattr(decode, "cpu_compiler", lambda: "no C++ compiler for Inductor (test)")
    llm = LLM(tiny, max_num_seqs=2)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert llm.metrics()["decode_compiled"] == "eager (no C++ compiler for Inductor (test))"


def test_a_step_that_fails_to_compile_runs_eagerly_and_is_reported(tiny, prompts, reference, monkeypatch):
    def broken(compiled, **_):
        def call(buf):
            raise RuntimeError("inductor broke")
        return call
    monkeypatch.setattr(decode, "cpu_compiler", lambda: None)
    monkeypatch.setattr(decode, "_recompiles_allowed", broken)
    monkeypatch.setenv("LLMACCEL_CPU_BF16", "0")  # the exact fp32 linears
    llm = LLM(tiny, max_num_seqs=2)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with pytest.warns(UserWarning, match="inductor broke"):
        got = [o.token_ids for o in llm.generate(prompts[:2], sp)]
    assert got == [r[:12] for r in reference[:2]]
    m = llm.metrics()
    assert m["decode_compiled"].startswith("inductor (") and "inductor broke" in m["decode_compiled"]
