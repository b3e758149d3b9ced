"""The LLM API: requests, outputs and streaming over the engine core (core.py: continuous
batching over a cache backend, sampling, speculation)."""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from llmaccel.compiler.model import Model, load, parse_dtype
from llmaccel.errors import LlmaccelError
from llmaccel.runtime.core import EngineCore
from llmaccel.runtime.decode import default_compile
from llmaccel.runtime.detokenize import detok_of
from llmaccel.runtime.sequence import RequestOutput, Sequence
from llmaccel.runtime.warmup import warm_up
from llmaccel.sampling import SamplingParams


def _kind(x) -> str:
    return type(x).__name__ if not isinstance(x, (list, tuple)) or not x else \
        f"{type(x).__name__} of {type(x[0]).__name__}"


class LLM:
    """The engine's front: requests in, outputs and streamed text out, over an EngineCore
    (core.py: the scheduler, the cache backend and the model runner) that it steps."""

    def __init__(self, source, *, block_size: int = 16, kv_cache_tokens: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 speculative: str | None = None, num_speculative_tokens: int = 4, dtype=None,
                 device=None, enable_prefix_caching: bool = True, gpu_memory_utilization: float = 0.9,
                 cuda_graphs: bool = True, compile: bool | None = None, tensor_parallel_size: int = 1,
                 kv_cache_bytes: int | None = None):
        """Decode-only steps run on the lowered graph with sampling inside (runtime/decode.py;
        over linear-attention states too, sla_states.py), except over a KIVI cache.
        cuda_graphs: replay them as CUDA graphs (CUDA only);
        compile: Inductor on the decode sub-step first (None: default_compile, on CUDA and on a
        CPU where Inductor finds a C++ compiler);
        tensor_parallel_size: ranks the graph is cut over (tp_ranks.py: workers spawned from
        here, or the ranks of a torchrun launch); close() ends the workers;
        kv_cache_bytes: the cache's size in bytes instead of a memory fraction (or
        kv_cache_tokens), so that a cache of fewer bytes per token holds more tokens."""
        counts = dict(block_size=block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens,
                      num_speculative_tokens=num_speculative_tokens, tensor_parallel_size=tensor_parallel_size,
                      kv_cache_tokens=1 if kv_cache_tokens is None else kv_cache_tokens,
                      kv_cache_bytes=1 if kv_cache_bytes is None else kv_cache_bytes)
        bad = next((k for k, v in counts.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1), None)
        if bad is not None:
            raise LlmaccelError(f"{bad} must be a positive integer, got {counts[bad]!r}")
        if kv_cache_tokens is not None and kv_cache_bytes is not None:
            raise LlmaccelError("give kv_cache_tokens or kv_cache_bytes, not both")
        engine_kw = dict(block_size=block_size, kv_cache_tokens=kv_cache_tokens, kv_cache_bytes=kv_cache_bytes,
                         max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, speculative=speculative,
                         num_speculative_tokens=num_speculative_tokens,
                         enable_prefix_caching=enable_prefix_caching,
                         gpu_memory_utilization=gpu_memory_utilization, cuda_graphs=cuda_graphs,
                         compile=compile)
        self.ranks = None  # rank 0's workers (tp_ranks.RankGroup)
        world = tensor_parallel_size
        rank, device = _rank_and_device(world, device, speculative)
        self.model = _model_of(source, world, device, dtype)
        try:
            if world > 1:
                from llmaccel.runtime import tp_ranks

                tp_ranks.check_world(self.model.config, world, str(self.model.device))
                if compile is None:  # decided once: every rank must run the same collectives
                    engine_kw["compile"] = default_compile(self.model.device)
                if not tp_ranks.dist.is_initialized():  # spawn the other ranks; this one is rank 0
                    self.ranks = tp_ranks.RankGroup(type(self), source, world,
                                                    dict(engine_kw, dtype=dtype, device=device))
                self.model = tp_ranks.shard_model(self.model, rank, world)
            self.device, self.dtype, self.cfg = self.model.device, self.model.dtype, self.model.config
            self.core = EngineCore(self.model, **engine_kw)
            if self.ranks is not None:
                self.ranks.check_ready()
        except BaseException:
            self.close()
            raise

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
        core = self.core
        seq = Sequence(ids, params, text, self.device,
                       spec_k=core.k_max if core.draft is not None else 0)
        bad = core.sched.reject_reason(seq)
        if bad is not None:
            seq.finish_reason, seq.error = "error", bad
            core.stats["requests_failed"] += 1
        elif params.max_tokens == 0:
            seq.finish_reason = "length"
        else:
            core.stats["prompt_tokens"] += seq.n_prompt
            core.sched.add(seq)
            if self.ranks is not None:  # the same request on every rank, with this rank's seed
                self.ranks.add(seq, ids, dataclasses.replace(params, seed=seq.seed))
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a request now (a client went away): its KV blocks are freed at once and it
        ends with finish_reason 'abort'. A finished request is left as it is."""
        if seq.finished:
            return
        self.core.sched.abort(seq)
        seq.finish_reason = "abort"
        if self.ranks is not None:
            self.ranks.abort(seq)

    def has_unfinished(self) -> bool:
        return self.core.sched.has_work()

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
        detok_of(seq, self.model.tokenizer).update(seq.output_ids)
        text = seq.detok.text
        if seq.params.stop:
            text = text[: max(0, len(text) - max(map(len, seq.params.stop)) + 1)]
        return text

    def _text(self, seq: Sequence) -> str:
        if self.model.tokenizer_dir is None:
            return ""
        text = self.model.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return text if seq.stop_cut is None else text[: seq.stop_cut]

    def _output(self, seq: Sequence) -> RequestOutput:
        seq.text = self._text(seq)
        return seq.to_output()

    def step(self) -> None:
        """One engine step: a decode group resolved or launched, or an eager step."""
        if self.ranks is not None:
            self.ranks.send("step")
        self.core.step()

    def close(self) -> None:
        """End a tensor-parallel engine's workers and leave its process group (nothing to do
        for one rank, or under torchrun, whose launcher owns the group)."""
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "ranks", None) is not None:
            self.close()

    @torch.inference_mode()  # as step() runs: Dynamo's guards on it hold for later shapes too
    def warmup(self, context: int = 2048, progress: bool = False, modes: tuple[str, ...] | None = None) -> dict:
        """Compile and capture the decode steps of every batch bucket for contexts up to
        `context` tokens, and a lone prompt's prefill steps, and compile the kernels of eager
        mixed steps, now (CUDA graphs only; a server does this before it answers, so that no
        request waits for a compile; longer contexts capture their widths on first use):
        {"shapes": steps captured or run, "seconds": how long}. progress: a bar of them on stderr.
        modes: the sampling modes whose decode steps to capture (default all: greedy, sample,
        filter); an engine that will only ever serve one kind of request can name it."""
        if self.ranks is not None:
            self.ranks.send("warmup", context, False, modes)
        return warm_up(self.core, context, progress, modes)

    def metrics(self) -> dict:
        return self.core.metrics()


def _rank_and_device(world: int, device, speculative) -> tuple[int, object]:
    """This process's rank (0 unless a torchrun launch made it another) and its device."""
    if world == 1:
        return 0, device
    from llmaccel.runtime import tp_ranks

    if speculative is not None:
        raise LlmaccelError("speculative decoding does not run tensor-parallel yet; drop speculative=")
    rank = 0
    if tp_ranks.dist.is_initialized():  # a torchrun launch: this process is one rank
        if tp_ranks.dist.get_world_size() != world:
            raise LlmaccelError(f"tensor_parallel_size={world}, but the process group has "
                                f"{tp_ranks.dist.get_world_size()} ranks")
        rank = tp_ranks.dist.get_rank()
    return rank, tp_ranks.rank_device(device, rank)


def _model_of(source, world: int, device, dtype) -> Model:
    """`source` itself when it is a Model (on the ranks' device type), else loaded on `device`
    (CUDA where there is one) in `dtype` (bf16 on CUDA, fp32 on the CPU by default)."""
    if isinstance(source, Model):
        if world > 1 and torch.device(source.device).type != torch.device(device).type:
            raise LlmaccelError(f"tensor_parallel_size={world} runs on {device}, but the model is on "
                                f"{source.device}: load or compile it there, or pass its source")
        return source
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dt = parse_dtype(dtype) if dtype is not None else (
        torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    return load(source, dtype=dt, device=device)
