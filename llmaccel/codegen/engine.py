"""Static-batch decode engine: prefill, then greedy decode with one compiled step per token.

The decode step (lowered graph + static KV cache + argmax) is compiled once for the batch size
with Inductor; on CUDA with mode="reduce-overhead" a CUDA graph replays the whole step, so the
host launches one graph per token. On CUDA the prefill is compiled the same way, one graph per
prompt length (eager, a 30-layer model spends ~28 ms launching a 128-token prefill that the GPU
runs in about 1 ms); on the CPU it runs eagerly (an Inductor compile per prompt length costs
more there than it saves).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from llmaccel import ops
from llmaccel.codegen.lower import ROWS_MAX_WEIGHTS, LowerReport, largest_linear, load_kernel_modules, lower
from llmaccel.codegen.static_cache import ATTN_IMPLS, StaticKVCache, fuse_rope
from llmaccel.compiler.model import Model
from llmaccel.errors import LlmaccelError
from llmaccel.ops.kvquant import kv_quant_attention

LINEAR_IMPLS = ("auto", "mm", "rows", "gemv")
# Up to this many rows per step the decode linears run as GEMVs (llmaccel::gemv, or Inductor
# reductions); with more rows such a kernel reads each weight once per row and a GEMM is better.
ROWS_MAX_BATCH = 1
# ... and only for models whose largest linear has at most ROWS_MAX_WEIGHTS weights (lower.py).
_RECOMPILE_LIMIT = tuple(getattr(torch._dynamo.exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
                         if hasattr(torch._dynamo.exc, n))
# Prompt lengths whose prefill an engine compiles (each is an Inductor compile and a CUDA graph).
PREFILL_GRAPHS = 4


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax(logits, -1, keepdim=True) for logits (B, V), in two reductions over chunks of V
    where V has a divisor near its square root: the first index of the maximum, as argmax.

    Inductor compiles a one-row argmax into a single program looping over the vocabulary
    (llama-1b: 28 us per decode step for 128,256 logits, ~4% of the step); two reductions over
    (B, C, V / C) use the whole GPU."""
    B, V = logits.shape
    c = next((c for c in range(int(V ** 0.5), 15, -1) if V % c == 0), None)
    if c is None or V < 4096:
        return logits.argmax(-1, keepdim=True)
    part = logits.view(B, c, V // c)
    best, idx = part.max(-1)                 # (B, c): each chunk's maximum, its first index
    j = best.argmax(-1, keepdim=True)        # the first chunk holding the maximum
    return j * (V // c) + idx.gather(-1, j)


def _step_fn(gm, cache: StaticKVCache, attn: str):
    """Logits (B, T, V) for ids at positions pos."""
    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return gm(ids, pos.expand(ids.shape[0], -1), cache.bind(pos, attn))
    return step


def _prefill_fn(gm, cache: StaticKVCache):
    """The prefill: next tokens (B, 1) after ids at positions pos. A function of its own (not
    `_step_fn`), so its compiled variants, one per prompt length, do not count against the
    decode logits step's recompile limit."""
    def prefill(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        logits = gm(ids, pos.expand(ids.shape[0], -1), cache.bind(pos, "prefill"))
        return logits[:, -1].argmax(-1, keepdim=True)
    return prefill


def _static_step_fn(gm, cache: StaticKVCache, state: "StepState", attn: str):
    """A decode step without arguments: it reads the token and position from static buffers and
    writes the next ones back, so a replay needs no input copies, only the graph launch."""
    def step() -> None:
        pos = state.pos
        logits = gm(state.tok, pos.expand(state.tok.shape[0], -1), cache.bind(pos, attn))
        nxt = greedy(logits[:, -1])
        state.tok.copy_(nxt)
        state.out.index_copy_(1, pos + 1, nxt)
        state.pos.add_(1)
    return step


class StepState(nn.Module):
    """The decode loop's state on the device: last tokens (B, 1), their position (1,), and every
    token by position (B, max_len)."""

    def __init__(self, batch: int, max_len: int, device):
        super().__init__()
        for name, shape in (("tok", (batch, 1)), ("pos", (1,)), ("out", (batch, max_len))):
            buf = torch.zeros(shape, dtype=torch.long, device=device)
            self.register_buffer(name, buf, persistent=False)
            torch._dynamo.mark_static_address(buf)


class DecodeEngine:
    def __init__(self, model: Model, batch: int, max_len: int, *, compile: bool | None = None,
                 mode: str | None = "auto", backend: str = "inductor", lower_ops="all",
                 linear: str = "auto", attn: str = "auto", fullgraph: bool = True, tune: bool = False,
                 cache: StaticKVCache | None = None, compile_prefill: bool | None = None):
        if linear not in LINEAR_IMPLS:
            raise LlmaccelError(f"unknown linear implementation {linear!r}; known: {', '.join(LINEAR_IMPLS)}")
        if attn not in ("auto", *ATTN_IMPLS):
            raise LlmaccelError(f"unknown attention implementation {attn!r}; known: auto, {', '.join(ATTN_IMPLS)}")
        if max_len > model.config.max_position:
            raise LlmaccelError(f"max length {max_len} exceeds the model's {model.config.max_position} positions")
        other = {n.target.__name__ for n in model.gm.graph.nodes if n.op == "call_function"
                 and n.target not in (ops.attention, kv_quant_attention)
                 and "attention" in getattr(n.target, "__name__", "")}
        if other:
            raise LlmaccelError(f"the static decode path supports softmax attention only (its KV cache "
                                f"in full precision or KIVI-quantized); the graph has {', '.join(sorted(other))}")
        self.model, self.batch, self.max_len = model, batch, max_len
        dev = torch.device(model.device)
        cuda = dev.type == "cuda"
        self.compiled = cuda if compile is None else compile
        if mode == "auto":
            mode = "reduce-overhead" if cuda else None
        if linear == "auto":
            # At one row per step on CUDA, the fused Triton GEMVs (their norms, SiLU-mul and
            # residual adds inside, PDL between them); without the kernel module, Inductor's
            # reductions, which only pay off for small matrices; GEMMs at more rows.
            gemv = cuda and load_kernel_modules().get("gemv") == "ok"
            small = largest_linear(model.gm) <= ROWS_MAX_WEIGHTS
            few = self.compiled and cuda and batch <= ROWS_MAX_BATCH
            linear = ("gemv" if gemv else "rows" if small else "mm") if few else "mm"
        self.linear = linear
        # CUDA: one launch per layer for the decode attention and its KV write (Triton); CPU:
        # products and sums that Inductor fuses into C++ loops (SDPA and the grouped matmuls
        # cost more per call than the work at one query: W4 SmolLM2 steps 14-35% longer)
        self.attn = ("fused" if cuda else "rows") if attn == "auto" else attn
        # A draft that is the target's first layers passes the target's cache: it reads and
        # writes the same K/V for those layers.
        self.cache = cache if cache is not None else StaticKVCache.for_graph(model.gm, batch, max_len,
                                                                               model.dtype, dev)
        shared: dict = {}  # weights converted for CPU forms: one copy for all three lowerings
        self.prefill_gm, self.report = lower(model.gm, max_len=max_len, select=lower_ops,
                                             last_only=True, prepared=shared)
        self.full_gm, _ = lower(model.gm, max_len=max_len, select=lower_ops, prepared=shared)
        self.decode_gm, self.decode_report = self.full_gm, self.report
        self.compile_opts = {}
        if linear in ("rows", "gemv"):
            self.decode_gm, self.decode_report = lower(model.gm, max_len=max_len, select=lower_ops,
                                                       linear=linear, prepared=shared)
        # fused: RoPE runs inside the decode attention kernel (T > 1 forwards rotate first)
        self.rope_fused = fuse_rope(self.decode_gm) if self.attn == "fused" else 0
        # One position tensor per step, made once: no host-to-device copy inside the loop.
        self._pos = [p.clone() for p in torch.arange(max_len, device=dev).split(1)]
        self._prefill = _prefill_fn(self.prefill_gm, self.cache)
        self._prefill_compiled = None
        self._prefill_lengths: set[int] = set()
        self.state = StepState(batch, max_len, dev)
        step = _static_step_fn(self.decode_gm, self.cache, self.state, self.attn)
        self._logits_step = _step_fn(self.decode_gm, self.cache, self.attn)
        if self.compiled:
            if tune and backend == "inductor":
                import torch._inductor.config as inductor_config

                # Per-kernel block sizes searched at compile time (as gpt-fast does): slower
                # compiles, faster GEMV-shaped reductions.
                inductor_config.coordinate_descent_tuning = True
            opts = dict(backend=backend, fullgraph=fullgraph)
            if mode is not None and backend == "inductor":
                opts["mode"] = mode
            self.compile_opts = opts
            step = torch.compile(step, **opts)
            self._logits_step = torch.compile(self._logits_step, **opts)
            if cuda if compile_prefill is None else compile_prefill:
                # one specialized graph per prompt length (up to PREFILL_GRAPHS), no shape-generic recompile
                self._prefill_compiled = torch.compile(self._prefill, dynamic=False, **opts)
        self._decode = step

    @property
    def lower_report(self) -> LowerReport:
        return self.report

    def _check(self, ids: torch.Tensor, n: int) -> None:
        if ids.dim() != 2 or ids.shape[0] != self.batch:
            raise LlmaccelError(f"expected ids of shape ({self.batch}, T), got {tuple(ids.shape)}")
        if ids.shape[1] + n > self.max_len:
            raise LlmaccelError(f"prompt {ids.shape[1]} + {n} tokens exceed the cache's {self.max_len}")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Fill the cache with ids (B, P) at positions 0..P-1; returns the next tokens (B, 1).

        Compiled (CUDA) for the first PREFILL_GRAPHS prompt lengths an engine sees, eagerly for
        the others, and eagerly too where Dynamo's recompile limit, which counts the prefill's
        variants of every engine in the process, is reached."""
        P = ids.shape[1]
        pos = torch.arange(P, device=ids.device)
        lengths = self._prefill_lengths
        if self._prefill_compiled is not None and (P in lengths or len(lengths) < PREFILL_GRAPHS):
            try:
                out = self._prefill_compiled(ids, pos)
            except _RECOMPILE_LIMIT:
                self._prefill_compiled = None
            else:
                lengths.add(P)
                return out.clone()  # a CUDA graph's output: the next replay overwrites it
        return self._prefill(ids, pos)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """Greedy: n new tokens per row (B, n); the first comes from the prefill."""
        ids = ids.to(self.model.device)
        self._check(ids, n)
        if n <= 0:
            return ids.new_zeros(ids.shape[0], 0)
        P = ids.shape[1]
        self.start(ids)
        if n > 1:
            self._decode()  # compiles on first use, and checks its guards
        with self._steady():
            for _ in range(n - 2):
                self._decode()
        return self.state.out[:, P:P + n].clone()

    def _steady(self):
        """Inside the decode loop nothing a guard checks can change (the step takes no arguments
        and reads fixed buffers and weights), so the compiled step's guards are skipped: on a
        2-core CPU their evaluation costs ~2 ms per step (the whole step of SmolLM2 is ~29 ms).
        On CUDA the replayed graph hides them (no gain measured on the H200): left as it is."""
        if not self.compiled or torch.device(self.model.device).type != "cpu":
            return contextlib.nullcontext()
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)

    @torch.no_grad()
    def start(self, ids: torch.Tensor) -> None:
        """Prefill and set the decode state: the next step decodes from the prefill's token."""
        tok = self.prefill(ids)
        P = ids.shape[1]
        st = self.state
        st.tok.copy_(tok)
        st.pos.fill_(P)
        st.out[:, P:P + 1].copy_(tok)

    @torch.no_grad()
    def step(self) -> None:
        """One decode step from the state set by `start` (the profile and tests use it)."""
        self._decode()

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits (B, T, V) for ids at positions start.., through the decode graph (tests)."""
        self._check(ids, start)
        T = ids.shape[1]
        if T > 1 and start and self.cache.specs:
            raise LlmaccelError("a KIVI-quantized static cache takes several tokens only as the "
                                "prefill, at position 0")
        if T == 1:
            return self._logits_step(ids, self._pos[start]).clone()
        pos = torch.arange(start, start + T, device=ids.device)
        return _step_fn(self.full_gm, self.cache, "sdpa")(ids, pos)
