"""Time to first token of one 128-token request, greedy against sampled, with a profile."""
import time

import torch
from torch.profiler import ProfilerActivity, profile

from llmaccel import LLM, SamplingParams

llm = LLM("preset:llama-1b", dtype="bfloat16", device="cuda", max_num_seqs=1)
ids = [list(range(1, 129))]
for name, kw in (("greedy", {}), ("sampled", dict(temperature=0.8, top_p=0.95))):
    sp = [SamplingParams(max_tokens=1, ignore_eos=True, seed=1, **kw)]
    for _ in range(3):
        llm.generate(ids, sp)
    ts = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(ids, sp)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    print(name, "ttft ms", [round(x, 2) for x in ts], flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(ids, sp)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
