"""The llmaccel torch.compile backend lifts HF Llama's torch-level patterns to IR ops, exactly."""
import pytest
import torch
import torch._dynamo

from helpers import hf_for_source
from llmaccel.codegen.backend import make_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_lifts_hf_llama_and_matches_eager(dtype):
    m = hf_for_source("preset:tiny-llama").to(dtype)
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        ref = m(ids).logits
        torch._dynamo.reset()
        be = make_backend("aot_eager" if dtype == torch.float32 else "eager")
        out = torch.compile(m, backend=be)(ids).logits
    L = 2
    # q, k, v, o, gate, up, down per layer and the LM head; two norms per layer and the final one
    assert be.last_stats["lifted"] == {"linear": 7 * L + 1, "rms_norm": 2 * L + 1, "silu_mul": L}
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_backend_leaves_unrecognised_graphs_alone():
    def f(x, w):
        return torch.relu(x @ w) * torch.sigmoid(x).sum()
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    be = make_backend("eager")
    torch.testing.assert_close(torch.compile(f, backend=be)(x, w), f(x, w))
    assert be.last_stats["lifted"] == {"linear": 0, "rms_norm": 0, "silu_mul": 0}


def test_a_compile_says_what_it_compiles_once(capsys):
    """The first call compiles (tens of seconds for an LLM on a CPU): one line on stderr names
    the model; a later call that reuses the graph prints nothing."""
    m = hf_for_source("preset:tiny-llama")
    ids = torch.randint(0, 512, (1, 5))
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=make_backend("eager"))
    with torch.no_grad():
        compiled(ids)
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("llmaccel: compiling LlamaForCausalLM (") and "lifted 15 linear" in line
        compiled(ids)
    assert capsys.readouterr().err == ""
