"""The engine core: one step of continuous batching over a cache backend.

Each step resolves the decode group the last step launched (decode_steps.py), or asks the
scheduler for a batch, lets a draft propose, and runs the batch either as a decode-only group
on the model runner's DecodeRunner or as an eager step (eager_steps.py: prefill chunks, mixed
steps, speculative verification). Sampled tokens are applied by `append`: EOS, stop strings,
the length limit. Requests, text and streaming are the front's (engine.py: `LLM`).
"""
from __future__ import annotations

import torch

from llmaccel.errors import LlmaccelError
from llmaccel.ir import attention_layers
from llmaccel.ops.kv_int8 import int8_layers
from llmaccel.runtime.cache_backend import check_speculative, make_backend
from llmaccel.runtime.decode_steps import DecodeSteps
from llmaccel.runtime.detokenize import detok_of, find_stop
from llmaccel.runtime.eager_steps import EagerSteps
from llmaccel.runtime.graph import runtime_graph
from llmaccel.runtime.kv_cache import PagedKVCache
from llmaccel.runtime.model_runner import ModelRunner
from llmaccel.runtime.scheduler import Scheduler
from llmaccel.runtime.sequence import Sequence
from llmaccel.runtime.speculative import ModelDraft, NgramDraft, draft_source

STAT_KEYS = ("steps", "prompt_tokens", "generated_tokens", "spec_proposed", "spec_accepted",
             "spec_verifies", "spec_emitted", "kv_blocks_peak", "requests_failed", "decode_steps",
             "decode_row_steps", "eager_steps", "eager_tokens")


class EngineCore:
    def __init__(self, model, *, block_size: int, kv_cache_tokens: int | None, kv_cache_bytes: int | None,
                 max_num_seqs: int,
                 max_num_batched_tokens: int, speculative: str | None, num_speculative_tokens: int,
                 enable_prefix_caching: bool, gpu_memory_utilization: float,
                 cuda_graphs: bool, compile: bool | None):
        self.model, self.cfg, self.device, self.dtype = model, model.config, model.device, model.dtype
        self.eos = self.cfg.eos_ids
        self.has_tokenizer = model.tokenizer_dir is not None  # loaded on first use
        layers = attention_layers(model.gm)
        if not layers:
            raise LlmaccelError("the graph has no attention nodes; the paged runtime cannot bind a cache")
        if speculative is not None:
            check_speculative(model.gm)
        self.k_max = max(1, num_speculative_tokens)
        draft_model, draft_name = draft_source(model, speculative, dtype=self.dtype, device=self.device)
        draft_layers = attention_layers(draft_model.gm) if draft_model is not None else None
        draft_int8 = frozenset(int8_layers(draft_model.gm)) if draft_model is not None else frozenset()
        capture = str(self.device).startswith("cuda") and cuda_graphs
        self.backend = make_backend(
            model.gm, self.cfg, layers, dtype=self.dtype, device=self.device, block_size=block_size,
            kv_cache_tokens=kv_cache_tokens, kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs,
            max_batched=max_num_batched_tokens,
            fraction=gpu_memory_utilization, capture=capture, prefix_caching=enable_prefix_caching,
            extra_bytes_per_token=PagedKVCache.bytes_per_token(draft_layers, self.dtype, draft_int8)
            if draft_layers else 0)
        self.cache, self.bm = self.backend.cache, self.backend.bm
        self.runner = ModelRunner(model, self.backend, capture=capture, compile=compile)
        self.sched = Scheduler(self.bm, max_num_seqs=self.backend.max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=self.cfg.max_position)
        self.draft = None
        if speculative == "ngram":
            self.draft = NgramDraft()
        elif draft_model is not None:
            dcache = PagedKVCache(draft_layers, self.bm.num_blocks, block_size, self.dtype, self.device,
                                  draft_int8)
            self.draft = ModelDraft(runtime_graph(draft_model.gm), dcache, device=self.device, name=draft_name)
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self.decode = DecodeSteps(self) if self.runner.decode is not None else None
        self.eager = EagerSteps(self)

    def append(self, seq: Sequence, toks: list[int], lps: list | None = None) -> None:
        """Append tokens until one ends the request; lps: per token (logprob, top pairs)."""
        p = seq.params
        if seq.logprobs is None and not (p.stop and self.has_tokenizer):
            # no per-token work: the tokens up to the first EOS or the length limit at once
            # (a decode group hands 256 rows x 8 tokens to this loop)
            limit = max(1, min(p.max_tokens - seq.n_output, self.cfg.max_position - len(seq.token_ids)))
            take = toks[:limit]
            if not p.ignore_eos and not self.eos.isdisjoint(take):
                take = take[:next(j for j, t in enumerate(take) if t in self.eos)]
                seq.finish_reason = "stop"
            elif len(toks) >= limit:
                seq.finish_reason = "length"
            seq.token_ids += take
            self.stats["generated_tokens"] += len(take)
            return
        for j, t in enumerate(toks):
            if t in self.eos and not p.ignore_eos:
                seq.finish_reason = "stop"
                return
            seq.token_ids.append(t)
            if seq.logprobs is not None and lps is not None:
                v, top = lps[j]
                seq.logprobs.append({"token": t, "logprob": v, "top": list(top[:p.logprobs])})
            self.stats["generated_tokens"] += 1
            if p.stop and self.has_tokenizer:
                # the new text only: the tail where a stop string could end
                delta = detok_of(seq, self.model.tokenizer).update(seq.output_ids)
                cut = find_stop(seq.detok.text, p.stop, len(delta)) if delta else -1
                if cut >= 0:
                    seq.stop_cut, seq.finish_reason = cut, "stop"
                    return
            if seq.n_output >= p.max_tokens or len(seq.token_ids) >= self.cfg.max_position:
                seq.finish_reason = "length"
                return

    @torch.inference_mode()
    def step(self) -> None:
        dec, eager = self.decode, self.eager
        if dec is not None and dec.pending is not None:  # a decode group launched by the last step
            (seqs, grp), dec.pending = dec.pending, None
            dec.resolve(seqs, grp)
            if dec.pending is not None:  # and the next one launched: that was this step
                self.stats["steps"] += 1
                return
            # the pipeline ended (rows ended, a request to admit): this step schedules too
        # an eager step whose tokens are not read yet (eager_steps.py): this step is scheduled
        # without the sequences waiting for them and launched before they are read
        held, eager.held = eager.held, None
        try:
            batch, too_long = eager.schedule(held)
            for seq in too_long:  # alone it would not fit in the whole cache
                seq.finish_reason = "length"
            if self.bm.copies:
                self.backend.copy_blocks(self.bm.copies)
                if isinstance(self.draft, ModelDraft):
                    self.draft.cache.copy_blocks(self.bm.copies)
                self.bm.copies.clear()
            if batch:
                spec = [(s, q - 1) for s, q in batch if q > 1 and len(s.token_ids) - s.num_computed == 1]
                proposals = self.draft.propose(spec) if spec else {}
                # rows without a proposal are plain decode rows: a step of those alone runs
                # the decode runner's, not a verification
                proposals = {i: p for i, p in proposals.items() if len(p[0])}
        except BaseException:
            if held is not None:  # a failure before anything launched: the tokens are not lost
                eager.apply(held)
            raise
        if not batch:
            if held is not None:  # nothing runs beside them: read the tokens now
                eager.apply(held)
                return
            if self.sched.has_work() and not too_long:
                raise RuntimeError("scheduler made no progress")  # a bug, never a user error
            return
        plan = []
        for seq, q in batch:
            nc = seq.num_computed
            if seq.id in proposals:
                toks = [seq.token_ids[-1]] + proposals[seq.id][0]
                nl = len(toks)
            else:  # a prefill chunk, or a decode row with room for proposals but none made
                toks = seq.token_ids[nc: nc + q]
                nl = 1 if nc + len(toks) == len(seq.token_ids) else 0
            plan.append((seq, toks, nl))
        plan.sort(key=lambda p: len(p[1]) != 1)
        self.stats["steps"] += 1
        if dec is not None and not proposals and all(len(t) == 1 and nl == 1 for _, t, nl in plan):
            if held is not None:  # the decode rows' group reads its tokens at once anyway
                eager.apply(held)
                held = None
            if dec.run([seq for seq, _, _ in plan]):
                return
        eager.run(plan, proposals, held)

    def metrics(self) -> dict:
        s = dict(self.stats)
        bm = self.bm
        s.update(preemptions=self.sched.preemptions, running_peak=self.sched.running_peak,
                 kv_blocks_used=bm.num_used,
                 kv_blocks_total=bm.num_blocks, block_size=bm.block_size,
                 prefix_cache_hit_tokens=bm.hit_tokens, prefix_caching=bm.prefix_caching,
                 speculative=None if self.draft is None else self.draft.name,
                 spec_accept_rate=s["spec_accepted"] / s["spec_proposed"] if s["spec_proposed"] else 0.0,
                 spec_tokens_per_step=s["spec_emitted"] / s["spec_verifies"] if s["spec_verifies"] else 0.0,
                 **self.runner.graph_metrics(), **self.backend.metrics())
        return s


__all__ = ["EngineCore"]
