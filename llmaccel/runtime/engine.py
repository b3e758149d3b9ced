"""The LLM API: continuous batching over a paged KV cache, sampling, streaming, speculation."""
from __future__ import annotations

import gc
import warnings
from typing import Iterator

import torch

from llmaccel.codegen.lower import lower
from llmaccel.compiler.model import Model, load, parse_dtype
from llmaccel.errors import LlmaccelError
from llmaccel.ir import attention_layers
from llmaccel.ops.sla import state_bytes
from llmaccel.runtime.block_manager import BlockManager
from llmaccel.runtime.decode import DecodeRunner
from llmaccel.runtime.decode_steps import DecodeSteps
from llmaccel.runtime.detokenize import IncrementalDetokenizer, find_stop
from llmaccel.runtime.eager_steps import EagerSteps
from llmaccel.runtime.graph import runtime_graph
from llmaccel.runtime.kivi_blocks import KiviBlockManager
from llmaccel.runtime.kivi_cache import KiviPagedCache, kivi_metrics, kivi_spec, pool_sizes as kivi_pool_sizes
from llmaccel.runtime.kv_cache import PagedKVCache
from llmaccel.runtime.scheduler import Scheduler
from llmaccel.runtime.sequence import RequestOutput, Sequence
from llmaccel.runtime.sla_states import SlaDecodeContext, SlaStates, sla_specs
from llmaccel.runtime.speculative import ModelDraft, NgramDraft, draft_source
from llmaccel.runtime.step_graphs import StepGraphs
from llmaccel.runtime.warmup import warm_up
from llmaccel.sampling import SamplingParams, kernel_check

CPU_CACHE_BYTES = 512 << 20


def _kind(x) -> str:
    return type(x).__name__ if not isinstance(x, (list, tuple)) or not x else \
        f"{type(x).__name__} of {type(x[0]).__name__}"


class LLM(DecodeSteps, EagerSteps):
    def __init__(self, source, *, block_size: int = 16, kv_cache_tokens: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 speculative: str | None = None, num_speculative_tokens: int = 4, dtype=None,
                 device=None, enable_prefix_caching: bool = True, draft_layers: int | None = None,
                 gpu_memory_utilization: float = 0.9, cuda_graphs: bool = True,
                 compile: bool | None = None):
        """Decode-only steps run on the lowered graph with sampling inside (runtime/decode.py;
        over linear-attention states too, sla_states.py), except over a KIVI cache.
        cuda_graphs: replay them as CUDA graphs (CUDA only);
        compile: Inductor on the decode sub-step first (None: on CUDA)."""
        counts = dict(block_size=block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens,
                      num_speculative_tokens=num_speculative_tokens,
                      kv_cache_tokens=1 if kv_cache_tokens is None else kv_cache_tokens)
        bad = next((k for k, v in counts.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1), None)
        if bad is not None:
            raise LlmaccelError(f"{bad} must be a positive integer, got {counts[bad]!r}")
        if isinstance(source, Model):
            self.model = source
        else:
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            dt = parse_dtype(dtype) if dtype is not None else (
                torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
            self.model = load(source, dtype=dt, device=device)
        self.device, self.dtype = self.model.device, self.model.dtype
        self.cfg = self.model.config
        self.eos = self.cfg.eos_ids
        # prefill, mixed and verification steps: the runtime graph lowered to the project's
        # kernels (int4 / int8 linears, ...), as the decode steps are; GEMMs for the linears
        rt = runtime_graph(self.model.gm)
        self.gm, _ = lower(rt, max_len=self.cfg.max_position, select="eager", linear="mm")
        self.gm.selects_rows = getattr(rt, "selects_rows", False)
        layers = attention_layers(self.model.gm)
        if not layers:
            raise LlmaccelError("the graph has no attention nodes; the paged runtime cannot bind a cache")
        self.kivi = kivi_spec(self.model.gm)  # kvquant graph: the cache holds packed KIVI blocks
        # linear attention (sla): a recurrent state per sequence in a slot of its own (sla_states.py)
        sla_layers = sla_specs(self.model.gm)
        self.sla = bool(sla_layers)
        if self.sla and speculative is not None:
            raise LlmaccelError("speculative decoding does not run on linear attention (sla) yet: its "
                                "recurrent state cannot roll back rejected tokens; drop speculative=")
        self.k_max = max(1, num_speculative_tokens)
        draft_model, draft_layers_map, self.self_kind = draft_source(
            self.model, speculative, draft_layers, dtype=self.dtype, device=self.device)
        bpt = PagedKVCache.bytes_per_token(layers, self.dtype)
        if draft_layers_map:
            bpt += PagedKVCache.bytes_per_token(draft_layers_map, self.dtype)
        tokens = kv_cache_tokens if kv_cache_tokens is not None else self._default_tokens(
            bpt, max_num_batched_tokens, gpu_memory_utilization)
        on_cuda = str(self.device).startswith("cuda")
        # the sampling kernel proven on this device before any graph captures the sampler
        self.sampler_fallback = kernel_check(self.device, self.cfg.vocab_size, self.dtype) if on_cuda else None
        if self.sampler_fallback:
            warnings.warn(f"sampling runs in sorted torch ops: the sampling kernel failed its "
                          f"check ({self.sampler_fallback})")
        capture = on_cuda and cuda_graphs
        if self.sla:  # one slot per sequence, one block of the longest sequence per slot; with CUDA
            # graphs every slot's state is allocated at once (the graphs keep the tensors' addresses)
            if capture:
                max_num_seqs = self._sla_slots(sla_layers, max_num_seqs, max_num_batched_tokens,
                                               gpu_memory_utilization)
            self.cache = SlaStates(sla_layers, slots=max_num_seqs, max_len=self.cfg.max_position,
                                   dtype=self.dtype, device=self.device, fixed=capture)
            self.bm = BlockManager(max_num_seqs, self.cfg.max_position, prefix_caching=False)
        elif self.kivi is not None:
            self.cache, self.bm = self._kivi_cache(layers, speculative, kv_cache_tokens, max_num_seqs,
                                                   max_num_batched_tokens, gpu_memory_utilization)
        else:
            num_blocks = tokens // block_size
            if num_blocks < 1:
                raise LlmaccelError(f"kv_cache_tokens={tokens} holds no block of {block_size} tokens")
            # one block more: the decode runner's padding rows write there; never handed out
            self.cache = PagedKVCache(layers, num_blocks + 1, block_size, self.dtype, self.device)
            self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        sla_kw = dict(context=SlaDecodeContext, scratch=0) if self.sla else {}
        self.runner = DecodeRunner(
            self.model.gm, self.cache, max_seqs=max_num_seqs,
            max_blocks=1 if self.sla else -(-self.cfg.max_position // block_size),
            max_len=self.cfg.max_position, capture=capture, compile=compile,
            **sla_kw) if self.kivi is None else None
        # a lone request's prefill step replayed as a CUDA graph (step_graphs.py): its time to the
        # first token is otherwise the eager step's host time
        self.steps = StepGraphs(self.gm, self.cache, scratch=self.cache.num_blocks - 1, capture=True,
                                pool=self.runner.pool) \
            if self.runner is not None and self.runner.capture and self.gm.selects_rows and not self.sla else None
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=self.cfg.max_position)
        self.draft = None
        if speculative == "ngram":
            self.draft = NgramDraft()
        elif draft_model is not None and draft_layers_map is None:  # LayerSkip: shares the cache
            self.draft = ModelDraft(runtime_graph(draft_model), self.cache, shared=True,
                                    device=self.device, name=f"self:{self.self_kind}")
        elif draft_model is not None:
            dcache = PagedKVCache(draft_layers_map, num_blocks, block_size, self.dtype, self.device)
            name = f"self:{self.self_kind}" if speculative.startswith("self") else speculative
            self.draft = ModelDraft(runtime_graph(draft_model.gm), dcache, shared=False,
                                    device=self.device, name=name)
        self._eager_pending = None  # an eager step whose tokens the next step reads (HeldStep)
        self._pending = None  # (rows, the decode group launched for them): the next step's
        self.stats = dict(steps=0, prompt_tokens=0, generated_tokens=0, spec_proposed=0,
                          spec_accepted=0, spec_verifies=0, spec_emitted=0, kv_blocks_peak=0,
                          requests_failed=0, decode_steps=0, decode_row_steps=0, eager_steps=0,
                          eager_tokens=0)

    def _kivi_cache(self, layers, speculative, tokens, max_seqs, max_batched, fraction):
        """The packed KIVI cache (kivi_cache.py): blocks of one key group, no prefix caching.

        kv_cache_tokens is the token capacity; without it the byte budget is split between
        the full-precision pool (residual windows) and the packed pool."""
        g, r = self.kivi["group"], self.kivi["residual"]
        if speculative is not None:
            raise LlmaccelError("speculative decoding does not run on a KIVI-quantized cache yet; "
                                "drop speculative= or compile without kvquant")
        if max_batched < g:
            raise LlmaccelError(f"max_num_batched_tokens must be at least the KIVI group ({g})")
        budget = None if tokens is not None else self._default_tokens(1, max_batched, fraction)
        nf, nq = kivi_pool_sizes(layers, self.kivi, self.dtype, max_num_seqs=max_seqs,
                                 tokens=tokens, budget_bytes=budget)
        cache = KiviPagedCache(layers, self.kivi, nf, nq, self.dtype, self.device)
        return cache, KiviBlockManager(nf, nq, g, r)

    def _sla_slots(self, specs: dict, slots: int, max_batched: int, fraction: float) -> int:
        """How many sequences' states (two buffers each, and the scratch pair) the GPU memory
        budget holds, at most `slots`; fewer with a warning, none with an error."""
        per = 2 * sum(state_bytes(sp["n_kv_heads"], sp["head_dim"], sp["kernel_size"], self.dtype.itemsize,
                                  sp.get("window", 0), sp.get("sinks", 0)) for sp in specs.values())
        fit = self._default_tokens(1, max_batched, fraction) // per - 1
        if fit < 1:
            raise LlmaccelError(f"no GPU memory left for one sequence's linear-attention states "
                                f"({per / 2**20:.1f} MiB); lower max_num_batched_tokens or raise the fraction")
        if fit < slots:
            warnings.warn(f"max_num_seqs lowered from {slots} to {fit}: the linear-attention states of "
                          f"{slots} sequences ({per / 2**20:.1f} MiB each) exceed the GPU memory budget")
        return min(slots, fit)

    def _default_tokens(self, bpt: int, max_batched: int, fraction: float) -> int:
        if str(self.device).startswith("cuda"):
            # an engine its caller dropped holds its cache until the cycle collector runs (its
            # runners and graphs refer to each other): without this, a second LLM in a process
            # would count the first one's cache against its own budget
            gc.collect()
            total = torch.cuda.get_device_properties(self.device).total_memory
            headroom = (2 << 30) + max_batched * self.cfg.intermediate_size * 16
            # allocated, not reserved: memory a previous engine freed is still reserved by the
            # caching allocator but is reusable by this cache
            budget = int(total * fraction) - torch.cuda.memory_allocated(self.device) - headroom
            if budget < bpt:
                raise LlmaccelError(f"no GPU memory left for the KV cache ({budget / 2**30:.1f} GiB "
                                    f"budget); lower max_num_batched_tokens or raise the fraction")
            return budget // bpt
        return max(1, CPU_CACHE_BYTES // bpt)

    # ------------------------------------------------------------------ requests
    def _encode(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.model.tokenizer_dir is None:
                raise LlmaccelError(f"{self.model.source} has no tokenizer; give prompts as lists of token ids")
            return self.model.encode(prompt), prompt
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise LlmaccelError(f"a prompt is a string or a list of token ids, got {_kind(prompt)}")
        V = self.cfg.vocab_size
        bad = next((t for t in prompt if not 0 <= t < V), None)
        if bad is not None:
            raise LlmaccelError(f"token id {bad} is outside the vocabulary (0..{V - 1})")
        return list(prompt), None

    def add_request(self, prompt, params: SamplingParams | None = None) -> Sequence:
        ids, text = self._encode(prompt)
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise LlmaccelError(f"sampling params must be a SamplingParams, got {_kind(params)}")
        seq = Sequence(ids, params, text, self.device,
                       spec_k=self.k_max if self.draft is not None else 0)
        bad = self.sched.reject_reason(seq)
        if bad is not None:
            seq.finish_reason, seq.error = "error", bad
            self.stats["requests_failed"] += 1
        elif params.max_tokens == 0:
            seq.finish_reason = "length"
        else:
            self.stats["prompt_tokens"] += seq.n_prompt
            self.sched.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request now (a client went away): its KV blocks are freed at once and it
        ends with finish_reason 'abort'. A finished request is left as it is."""
        if seq.finished:
            return
        self.sched.abort(seq)
        seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return self.sched.has_work()

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's RequestOutput as it stands (text decoded, stop string cut)."""
        return self._output(seq)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs in prompt order.

        A request that cannot run (prompt too long for the model or the cache) comes back with
        finish_reason 'error' and its message in .error; the others are unaffected.
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                         and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise LlmaccelError(f"prompts must be a string, a list of token ids or a list of "
                                f"those, got {_kind(prompts)}")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise LlmaccelError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while any(not s.finished for s in seqs):
            self.step()
        return [self._output(s) for s in seqs]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it grows (visible_text: whole characters only, and
        never text that a stop string would cut)."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], int):
            raise LlmaccelError("stream takes one prompt (a string or a list of token ids); "
                                "use generate for several")
        seq = self.add_request(prompt, params)
        if seq.error:
            raise LlmaccelError(seq.error)
        shown = 0
        while True:
            done = seq.finished
            text = self.visible_text(seq)
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)
            if done:
                return
            self.step()

    def visible_text(self, seq: Sequence) -> str:
        """The request's text that may be shown now ("" without a tokenizer): once finished,
        all of it as generate returns it; before, its whole characters so far less the last
        len(longest stop) - 1, which could still begin a stop string."""
        if self.model.tokenizer_dir is None:
            return ""
        if seq.finished:
            return self._text(seq)
        self._detok(seq).update(seq.output_ids)
        text = seq.detok.text
        if seq.params.stop:
            text = text[: max(0, len(text) - max(map(len, seq.params.stop)) + 1)]
        return text

    def _detok(self, seq: Sequence) -> IncrementalDetokenizer:
        if seq.detok is None:
            seq.detok = IncrementalDetokenizer(self.model.tokenizer)
        return seq.detok

    def _text(self, seq: Sequence) -> str:
        if self.model.tokenizer_dir is None:
            return ""
        text = self.model.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return text if seq.stop_cut is None else text[: seq.stop_cut]

    def _output(self, seq: Sequence) -> RequestOutput:
        seq.text = self._text(seq)
        return seq.to_output()

    # ------------------------------------------------------------------ the engine step
    def _append(self, seq: Sequence, toks: list[int], lps: list | None = None) -> None:
        """Append tokens until one ends the request; lps: per token (logprob, top pairs)."""
        p = seq.params
        if seq.logprobs is None and not (p.stop and self.model.tokenizer_dir is not None):
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
            if p.stop and self.model.tokenizer_dir is not None:
                # the new text only: the tail where a stop string could end
                delta = self._detok(seq).update(seq.output_ids)
                cut = find_stop(seq.detok.text, p.stop, len(delta)) if delta else -1
                if cut >= 0:
                    seq.stop_cut, seq.finish_reason = cut, "stop"
                    return
            if seq.n_output >= p.max_tokens or len(seq.token_ids) >= self.cfg.max_position:
                seq.finish_reason = "length"
                return

    @torch.inference_mode()
    def step(self) -> None:
        if self._pending is not None:  # a decode group launched by the last step
            (seqs, grp), self._pending = self._pending, None
            self._resolve(seqs, grp)
            if self._pending is not None:  # and the next one launched: that was this step
                self.stats["steps"] += 1
                return
            # the pipeline ended (rows ended, a request to admit): this step schedules too
        # an eager step whose tokens are not read yet (eager_steps.py): this step is scheduled
        # without the sequences waiting for them and launched before they are read
        held, self._eager_pending = self._eager_pending, None
        try:
            batch, too_long = self._schedule(held)
            for seq in too_long:  # alone it would not fit in the whole cache
                seq.finish_reason = "length"
            if self.bm.copies:
                self.cache.copy_blocks(self.bm.copies)
                if isinstance(self.draft, ModelDraft) and not self.draft.shared:
                    self.draft.cache.copy_blocks(self.bm.copies)
                self.bm.copies.clear()
            if batch:
                spec = [(s, q - 1) for s, q in batch if q > 1 and len(s.token_ids) - s.num_computed == 1]
                proposals = self.draft.propose(spec) if spec else {}
        except BaseException:
            if held is not None:  # a failure before anything launched: the tokens are not lost
                self._apply(held)
            raise
        if not batch:
            if held is not None:  # nothing runs beside them: read the tokens now
                self._apply(held)
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
            else:
                toks = seq.token_ids[nc: nc + q]
                nl = 1 if nc + q == len(seq.token_ids) else 0
            plan.append((seq, toks, nl))
        plan.sort(key=lambda p: len(p[1]) != 1)
        self.stats["steps"] += 1
        if self.runner is not None and not proposals and all(len(t) == 1 and nl == 1 for _, t, nl in plan):
            if held is not None:  # the decode rows' group reads its tokens at once anyway
                self._apply(held)
                held = None
            if self._decode([seq for seq, _, _ in plan]):
                return
        self._eager_step(plan, proposals, held)

    @torch.inference_mode()  # as step() runs: Dynamo's guards on it hold for later shapes too
    def warmup(self, context: int = 2048, progress: bool = False, modes: tuple[str, ...] | None = None) -> dict:
        """Compile and capture the decode steps of every batch bucket for contexts up to
        `context` tokens, and a lone prompt's prefill steps, and compile the kernels of eager
        mixed steps, now (CUDA graphs only; a server does this before it answers, so that no
        request waits for a compile; longer contexts capture their widths on first use):
        {"shapes": steps captured or run, "seconds": how long}. progress: a bar of them on stderr.
        modes: the sampling modes whose decode steps to capture (default all: greedy, sample,
        filter); an engine that will only ever serve one kind of request can name it."""
        return warm_up(self, context, progress, modes)

    def metrics(self) -> dict:
        s = dict(self.stats)
        s.update(preemptions=self.sched.preemptions, kv_blocks_used=self.bm.num_used,
                 kv_blocks_total=self.bm.num_blocks, block_size=self.bm.block_size,
                 prefix_cache_hit_tokens=self.bm.hit_tokens, prefix_caching=self.bm.prefix_caching,
                 speculative=None if self.draft is None else self.draft.name,
                 spec_accept_rate=s["spec_accepted"] / s["spec_proposed"] if s["spec_proposed"] else 0.0,
                 spec_tokens_per_step=s["spec_emitted"] / s["spec_verifies"] if s["spec_verifies"] else 0.0,
                 graph_steps=self.runner.replays if self.runner is not None else 0,
                 graphs_captured=sum(g is not None for runner in (self.runner, self.steps)
                                     if runner is not None for g, _, _ in runner.graphs.values()),
                 graph_capture_s=sum(r.capture_s for r in (self.runner, self.steps) if r is not None),
                 graph_failures={**(self.runner.failures if self.runner is not None else {}),
                                 **(self.steps.failures if self.steps is not None else {})},
                 step_graph_replays=self.steps.replays if self.steps is not None else 0,
                 sampler="torch" if not str(self.device).startswith("cuda") else
                 f"sorted ({self.sampler_fallback})" if self.sampler_fallback else "kernel")
        if self.kivi:
            s.update(kivi_metrics(self.cache, self.bm))
        if self.sla:  # the slots' recurrent states (at most two per slot and layer: before and after a step)
            s.update(sla_state_bytes=self.cache.nbytes())
        return s
