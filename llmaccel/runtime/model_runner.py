"""The model runner: every graph one model runs over one cache backend, and sampling.

`gm`: the runtime graph lowered to the project's kernels for eager steps (prefill chunks, mixed
steps, speculative verification; GEMMs for the linears); `steps`: a lone prompt's prefill
replayed as a CUDA graph (step_graphs.py; its time to the first token is otherwise the eager
step's host time); `decode`: the DecodeRunner (decode.py), decode-only sub-steps with sampling
inside, as CUDA graphs where the device has them. The engine core decides what runs; this
object runs it and samples.
"""
from __future__ import annotations

import warnings

import torch

from llmaccel.codegen.lower import lower
from llmaccel.kernels.int_codes import linear_bf16_cpu
from llmaccel.ops import quant as qops
from llmaccel.runtime.cache_backend import CacheBackend
from llmaccel.runtime.decode import DecodeRunner
from llmaccel.runtime.graph import runtime_graph
from llmaccel.runtime.step_graphs import StepGraphs
from llmaccel.sampling import (kernel_check, logprob_pairs, logprobs_wanted, sample_mode, sample_rows,
                               token_logprobs)


def lp_pairs(lp: torch.Tensor, top) -> list[tuple[float, list]]:
    """token_logprobs' tensors as per-row (logprob, [(id, logprob)]) on the host."""
    return logprob_pairs(lp.tolist(), *(() if top is None else (top[0].tolist(), top[1].tolist())))


class ModelRunner:
    def __init__(self, model, backend: CacheBackend, *, capture: bool, compile: bool | None):
        """capture: replay steps as CUDA graphs (CUDA only); compile: Inductor on the decode
        sub-step first (None: decode.default_compile)."""
        self.backend, self.device, self.dtype = backend, model.device, model.dtype
        cfg = model.config
        rt = runtime_graph(model.gm)
        self.gm, _ = lower(rt, max_len=cfg.max_position, select="eager", linear="mm")
        self.gm.selects_rows = getattr(rt, "selects_rows", False)
        self.cpu_bf16_linears = sum(n.target is linear_bf16_cpu for n in self.gm.graph.nodes)
        on_cuda = str(self.device).startswith("cuda")
        # the sampling kernel proven on this device before any graph captures the sampler
        self.sampler_fallback = kernel_check(self.device, cfg.vocab_size, self.dtype) if on_cuda else None
        if self.sampler_fallback:
            warnings.warn(f"sampling runs in sorted torch ops: the sampling kernel failed its "
                          f"check ({self.sampler_fallback})")
        if on_cuda and any(n.target is qops.linear_w8a8 for n in rt.graph.nodes):
            warnings.warn("W8A8 linears (quant.act=int8) have no GPU kernel yet: they run the "
                          "reference, which dequantizes the weights every step (slower than bf16)")
        self.decode = DecodeRunner(
            model.gm, backend.cache, max_seqs=backend.max_num_seqs, max_blocks=backend.max_blocks,
            max_len=cfg.max_position, capture=capture, compile=compile,
            **backend.runner_kwargs()) if backend.decodes_on_runner else None
        self.steps = StepGraphs(self.gm, backend.cache, scratch=backend.cache.num_blocks - 1, capture=True,
                                pool=self.decode.pool) \
            if self.decode is not None and self.decode.capture and self.gm.selects_rows and backend.step_graphs \
            else None

    @property
    def sampler(self) -> str:
        if not str(self.device).startswith("cuda"):
            return "torch"
        return f"sorted ({self.sampler_fallback})" if self.sampler_fallback else "kernel"

    def forward(self, plan) -> torch.Tensor:
        """The logits of the rows the plan ((sequence, tokens fed, rows sampled) each) samples:
        a lone prompt's captured step, or the graph."""
        be = self.backend
        items, want = be.step_items(plan), [nl for _, _, nl in plan]
        logits = self.steps.run(items, want) if self.steps is not None else None
        if logits is None:
            ids, pos, ctx = be.step_inputs(items, want, self.device)
            logits = self.gm(ids, pos, ctx)[0]
            be.after_forward(ctx, plan)
            if not self.gm.selects_rows:
                logits = logits.index_select(0, ctx.logits_indices)
        return logits

    def sample(self, logits, plan, proposals):
        """(logits rows, their sequences, next tokens on the device, per-row (logprob, top
        pairs) or None when no row wants them) for the rows that end a sequence's input without
        speculation, drawn in one batched call (seeded by request and position, as the decode
        steps draw); no host sync unless logprobs are wanted."""
        rows, seqs, r = [], [], 0
        for seq, toks, nl in plan:
            r += nl
            if nl == 1 and not (seq.id in proposals and len(toks) > 1):
                rows.append(r - 1)
                seqs.append(seq)
        if not rows:
            return rows, seqs, None, None
        dev = logits.device

        def h2d(x, dt):  # torch.tensor(x, device=cuda) copies and then syncs the stream, which
            # would wait for the forward just launched (the held step is read meanwhile)
            return torch.tensor(x, dtype=dt).to(dev, non_blocking=True)
        ps = [s.params for s in seqs]
        sel = logits.index_select(0, h2d(rows, torch.int64))
        toks = sample_rows(
            sel,
            h2d([p.temperature for p in ps], torch.float32),
            h2d([p.top_k for p in ps], torch.int64),
            h2d([p.top_p for p in ps], torch.float32),
            h2d([s.seed for s in seqs], torch.int64),
            h2d([len(s.token_ids) for s in seqs], torch.int64),
            sample_mode(ps))
        top = logprobs_wanted(ps)
        return rows, seqs, toks, (lp_pairs(*token_logprobs(sel, toks, top)) if top >= 0 else None)

    def graph_metrics(self) -> dict:
        runners = [r for r in (self.decode, self.steps) if r is not None]
        return dict(
            graph_steps=self.decode.replays if self.decode is not None else 0,
            graphs_captured=sum(g is not None for r in runners for g, _, _ in r.graphs.values()),
            graph_capture_s=sum(r.capture_s for r in runners),
            graph_failures={k: v for r in runners for k, v in r.failures.items()},
            step_graph_replays=self.steps.replays if self.steps is not None else 0,
            sampler=self.sampler, decode_compiled=self.decode_compiled,
            cpu_bf16_linears=self.cpu_bf16_linears,
            threads=torch.get_num_threads() if not str(self.device).startswith("cuda") else None)

    @property
    def decode_compiled(self) -> str:
        """How the decode sub-steps run: "inductor", or "eager" and why."""
        d = self.decode
        if d is None:
            return "eager (the cache backend steps on the engine's graph)"
        if not d.compile:
            return f"eager ({d.eager_why})"
        failed = [k for k, v in d.failures.items() if not v.startswith("captured uncompiled")]
        return f"inductor ({len(failed)} shapes eager: {d.failures[failed[0]]})" if failed else "inductor"


__all__ = ["ModelRunner", "lp_pairs"]
