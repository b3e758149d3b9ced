"""The server over an sla graph (linear attention with a window): completions with logprobs
come back as the reference executor computes them, and their state slots are free afterwards."""
import httpx
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.compiler.pipeline import compile
from tests.serve.conftest import serve_thread
from tests.serve.test_faults import idle


def test_completions_over_an_sla_graph_match_the_reference_executor():
    opts = {"calib_samples": "2", "calib_seq_len": "32", "window": "8", "sinks": "2"}
    m = compile("preset:tiny-llama", ["sla"], {"sla": opts}, eval_tokens=0, progress=False)
    prompts = [[5, 9, 13], list(range(20, 60))]
    with serve_thread(LLM(m, max_num_seqs=2)) as (url, srv):
        for p in prompts:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "m", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logprobs": 1})
            assert r.status_code == 200, r.text
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            ref = list(m.generate_ids(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
            want = torch.log_softmax(m.logits(torch.tensor([p + ref]))[0].float(), -1)
            got = [float(want[len(p) - 1 + j, t]) for j, t in enumerate(ref)]
            assert len(lps) == 12 and max(abs(a - b) for a, b in zip(lps, got)) < 1e-4
        assert idle(srv)["kv_blocks_used"] == 0
