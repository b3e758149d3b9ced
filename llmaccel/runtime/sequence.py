"""A request in flight (Sequence) and what generate returns for it (RequestOutput)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from llmaccel.sampling import SamplingParams, request_seed

_ids = itertools.count()


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    text: str = ""
    finish_reason: str | None = None  # "length" | "stop" | "error" | "abort"
    error: str | None = None
    # with SamplingParams.logprobs: per generated token {"token", "logprob", "top": [(id, lp)]}
    logprobs: list[dict] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    """Token ids (prompt + generated), how many have KV in the cache, and the block table.

    Every step feeds token_ids[num_computed : num_computed + q]; when that reaches the end, the
    last logits row gives the next token. Plain decode is the case of one token left to feed;
    recompute after preemption and chunked prefill are the same loop with more.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None,
                 device, spec_k: int = 0):
        self.id = next(_ids)
        self.prompt = prompt
        self.params = params
        self.token_ids = list(prompt_ids)
        self.n_prompt = len(prompt_ids)
        self.num_computed = 0
        self.draft_computed = 0  # tokens in the draft model's own cache (separate draft only)
        self.block_table: list[int] = []
        self.hashed_blocks = 0
        # KIVI cache only (kivi_blocks.py): leading packed blocks of the table now and before
        # this step, and the fp blocks whose tokens this step quantizes (logical index -> id).
        self.kivi_nq = self.kivi_q0 = 0
        self.kivi_fp_old: dict[int, int] = {}
        self.spec_k = spec_k
        # speculative back-off: plain steps left before proposing again, and the misses in a row
        # (verifications of one token that accepted none) that set its length
        self.spec_pause = self.spec_misses = 0
        self.draft_state = None   # a draft's own per-sequence state (NgramDraft's index)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.text = ""
        self.stop_cut: int | None = None  # text length where a stop string begins
        self.detok = None  # IncrementalDetokenizer, made by the engine when text is needed
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # sampled tokens are drawn by (seed, position) (sampler.row_uniforms); the generator
        # serves speculative drafting and verification only (a CUDA generator per request of a
        # 256-request burst cost the admission time for nothing)
        self.seed = request_seed(params)
        self.generator = None
        if params.temperature > 0 and spec_k > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.n_prompt:]

    @property
    def n_output(self) -> int:
        return len(self.token_ids) - self.n_prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_output(self) -> RequestOutput:
        return RequestOutput(self.id, self.prompt, self.token_ids[: self.n_prompt],
                             self.output_ids, self.text, self.finish_reason, self.error,
                             self.logprobs)
