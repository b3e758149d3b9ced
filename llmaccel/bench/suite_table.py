"""The suite's closing table: each goal row's figures from its record, with ratios to the fast
peer measured in the same call and to the engine's goals (one H200, bf16, prompt 128, 256 new
tokens, wall time including prefill)."""
from __future__ import annotations

from dataclasses import dataclass

SAMPLED_GOAL = 0.95   # a sampled row's goal: this share of the same shape's greedy tok/s
LOAD_GOAL = 40_000    # serving load, output tok/s
SERVE_LOAD_RATIO = 0.9
SERVE_OVERHEAD = 0.05
W4_COMPILE_S = 20  # llmc compile smollm2-135m --passes quant on one H200


@dataclass(frozen=True)
class Goal:
    case: str
    label: str                 # the llmc bench record
    peer: str                  # the fast peer's record of the same shape and batch
    tok_s: float | None        # absolute goal
    greedy: str | None = None  # sampled rows: the greedy record the goal is relative to


GOALS = [
    Goal("llama-1b bs1", "llmc_llama-1b_bs1", "fast_llama-1b_bs1", 1150),
    Goal("llama-1b bs1 sampled", "llmc_llama-1b_bs1_sampled", "fast_llama-1b_bs1", None, "llmc_llama-1b_bs1"),
    Goal("smollm2-135m bs1", "llmc_smollm2-135m_bs1", "fast_smollm2-135m_bs1", 2200),
    Goal("smollm2-135m bs1 sampled", "llmc_smollm2-135m_bs1_sampled", "fast_smollm2-135m_bs1", None,
         "llmc_smollm2-135m_bs1"),
    Goal("llama-1b bs64", "llmc_llama-1b_bs64", "fast_llama-1b_bs64", 40_000),
    Goal("llama-1b bs64 sampled", "llmc_llama-1b_bs64_sampled", "fast_llama-1b_bs64", None, "llmc_llama-1b_bs64"),
    Goal("llama-1b W4 int4-head bs1", "llmc_llama-1b-int4_bs1", "fast_llama-1b_bs1", 1289),
    Goal("llama-1b W8 int8-head bs1", "llmc_llama-1b-int8_bs1", "fast_llama-1b_bs1", None),
    Goal("llama2-7b bs1", "llmc_llama2-7b_bs1", "fast_llama2-7b_bs1", 270),
]


def _fmt(v, p: int = 0) -> str:
    return "-" if v is None else f"{v:,.{p}f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _tok_s(by: dict, label: str) -> float | None:
    r = by.get(label)
    return r["result"].get("decode_tok_s") if r and r.get("status") == "ok" else None


def goal_of(g: Goal, by: dict) -> float | None:
    if g.greedy is None:
        return g.tok_s
    greedy = _tok_s(by, g.greedy)
    return greedy and SAMPLED_GOAL * greedy


def goal_lines(by: dict) -> list[str]:
    head = (f"{'case':<26}{'LLM tok/s':>11}{'fast peer':>11}{'x peer':>8}{'goal':>9}{'x goal':>8}"
            f"{'step ms':>9}{'kern/step':>10}{'GPU ms':>8}{'TTFT ms':>9}")
    lines = [head]
    for g in GOALS:
        if g.label not in by:
            continue
        r = by[g.label]
        o = r["result"] if r.get("status") == "ok" else {}
        a, peer, goal = o.get("decode_tok_s"), _tok_s(by, g.peer), goal_of(g, by)
        ttft = o.get("ttft_s")
        lines.append(f"{g.case:<26}{_fmt(a):>11}{_fmt(peer):>11}{_ratio(a, peer):>8}"
                     f"{_fmt(goal) + ('*' if g.greedy else ''):>9}{_ratio(a, goal):>8}"
                     f"{_fmt(o.get('step_ms'), 3):>9}{_fmt(o.get('kernels_per_step'), 1):>10}"
                     f"{_fmt(o.get('gpu_ms_per_step'), 3):>8}{_fmt(ttft and 1e3 * ttft, 1):>9}")
    if len(lines) > 1 and any(g.greedy and g.label in by for g in GOALS):
        lines.append(f"* {SAMPLED_GOAL}x the greedy row's tok/s in this run")
    return lines if len(lines) > 1 else []


def load_lines(res: dict) -> list[str]:
    return [f"serving load: {r['requests']} requests, {_fmt(r['output_tok_s'])} output tok/s "
            f"({_ratio(r['output_tok_s'], LOAD_GOAL)} of the {LOAD_GOAL:,} goal), mean TPOT {r['mean_tpot_ms']} ms, "
            f"lengths ok {r['lengths_ok']}" + (f", intact {r['intact']}" if r.get("checked") else "")
            for r in res.get("load", [])]


def serve_lines(res: dict) -> list[str]:
    s, o = res["server"], res["offline"]
    return [f"serve: {_fmt(s['load']['output_tok_s'])} output tok/s through llmc serve, "
            f"{_fmt(o['load']['output_tok_s'])} through LLM offline: {res['load_ratio']:.3f} "
            f"(goal >= {SERVE_LOAD_RATIO}); one request {s['one_request']['tok_s']} vs "
            f"{o['one_request']['tok_s']} tok/s, overhead {res['one_request_overhead']:.3f} "
            f"(goal <= {SERVE_OVERHEAD}); load checks ok {s['load']['ok']}, with disconnects "
            f"{s['load_10pct_disconnects']['ok']}; the load admitted in {s['load'].get('accept_span_s', '?')} s "
            f"(first request sent to last headers), engine busy {s['load'].get('engine', {}).get('busy_s', '?')} of "
            f"{s['load']['wall_s']} s, graphs captured during it "
            f"{s['load'].get('engine', {}).get('graphs_captured', '?')} "
            f"({s['load'].get('engine', {}).get('graph_capture_s', '?')} s), kernels compiled during it "
            f"{s['load'].get('kernels_built', '?')}; server start {s.get('startup', {}).get('seconds', '?')} s, "
            f"first load {_fmt(s['first_load']['output_tok_s']) if 'first_load' in s else '?'} tok/s"]


def spec_lines(by: dict) -> list[str]:
    base = _tok_s(by, "spec_none")
    out = []
    for label in ("spec_none", "spec_self", "spec_ngram"):
        r = by.get(label)
        if r and r.get("status") == "ok":
            d = r["result"]
            acc = d.get("spec_accept_rate")
            out.append(f"{label}: {_fmt(d['decode_tok_s'])} tok/s ({_ratio(d['decode_tok_s'], base)} of no draft)"
                       + (f", accept rate {acc:.2f}" if acc is not None else ""))
    return out


def table(records: list[dict]) -> str:
    """The goal table, then one line per other row, then every failure and skip."""
    by = {r["label"]: r for r in records}
    lines = goal_lines(by)
    for r in records:
        res = r.get("result") or {}
        if r["row"] == "load" and res:
            lines += load_lines(res)
        elif r["row"] == "serve" and res:
            lines += serve_lines(res)
        elif r["row"] == "w4compile" and res:
            q = res["passes"][0]
            lines.append(f"W4 compile ({q['options']['method']}, {q['options']['n_samples']} windows) of "
                         f"{res['source']}: quant pass {q['seconds']:.1f} s, the whole command {r['wall_s']} s "
                         f"(goal <= {W4_COMPILE_S} s on the H200)")
        elif r.get("status") == "ok" and "summary" in r:
            lines.append(f"{r['label']}: {r['summary']}")
        for k, why in (res.get("graph_failures") or {}).items():
            lines.append(f"{r['label']}: decode shape {k} uncaptured: {why}")
    lines += spec_lines(by)
    sla, src = _tok_s(by, "llmc_smollm2-135m-sla-w64_bs8"), _tok_s(by, "llmc_smollm2-135m_bs8")
    if sla is not None:
        lines.append(f"smollm2-135m sla window 64 + 4 sinks bs8 through LLM: {_fmt(sla)} tok/s, the source "
                     f"{_fmt(src)} ({_ratio(sla, src)})")
    for r in records:
        if r.get("status") == "failed":
            lines.append(f"FAILED {r['label']}: {r['error']}: {r.get('tail', '')[-300:]!r}")
        elif r.get("status") == "skipped":
            lines.append(f"skipped {r['label']}: {r['reason']}")
    return "\n".join(lines)
