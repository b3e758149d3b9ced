"""Compile report rendering (report.json holds the same facts)."""
from __future__ import annotations


def _fmt(v) -> str:
    if isinstance(v, (list, tuple)):
        return f"[{len(v)} values, in report.json]"
    if isinstance(v, dict):
        return f"{{{len(v)} entries, in report.json}}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_markdown(r: dict) -> str:
    lines = [f"# Compile report: {r['source']}", "",
             f"dtype {r['dtype']}; calibration: {r['calib']}"
             + ("" if r["calib"] in ("self", "mixed") else f" ({r['calib_split']})")  # split: files only
             + (f"; compared with {r['baseline']}" if r.get("baseline") else ""), ""]
    if r["passes"]:
        lines += ["| pass | exact | changed | stats | verify max abs | seconds |",
                  "|---|---|---|---|---|---|"]
        for p in r["passes"]:
            stats = ", ".join(f"{k}={_fmt(v)}" for k, v in p["stats"].items())
            ver = _fmt(p["verify"]["max_abs"]) if "verify" in p else "-"
            lines.append(f"| {p['name']} | {'yes' if p['exact'] else 'no'} | {p['changed']} | "
                         f"{stats} | {ver} | {p['seconds']} |")
    else:
        lines.append("No passes: the captured graph as is.")
    low = r.get("lowering")
    if low:
        ops = ", ".join(f"{k}={v}" for k, v in {**low["custom"], **low["cpu_traced"]}.items()) or "none"
        lines += ["", f"Lowering (kernels: {ops}; rope on tables: {low['rope']}): verify max abs "
                      f"{_fmt(low['max_abs'])} against the graph."]
        if "rows" in low:
            g = low["gemv"]
            lines.append(f"Linears as row products ({low['rows']['linears']}, {low['rows']['norms']} "
                         f"norms inside): max abs {_fmt(low['rows']['max_abs'])}; as fused GEMVs "
                         f"({g['gemv']}, {g['glu']} SiLU-mul, {g['residual']} residual adds, {g['norm']} "
                         f"norms inside): max abs {_fmt(g['max_abs'])}.")
    lines += ["", "| op | before | after |", "|---|---|---|"]
    for op in sorted(set(r["ops_before"]) | set(r["ops_after"])):
        lines.append(f"| {op} | {r['ops_before'].get(op, 0)} | {r['ops_after'].get(op, 0)} |")
    q = r.get("quality")
    if q:
        lines.append("")
        if "skipped" in q:
            lines.append(f"Quality: skipped ({q['skipped']}).")
        else:
            lines.append(f"Quality on {q['text']}, {q['tokens']} tokens, ctx {q['ctx']}: "
                         f"ppl {q['ppl']:.4f} ({'baseline' if r.get('baseline') else 'source'} "
                         f"{q['baseline_ppl']:.4f}, "
                         f"{q['delta_ppl_pct']:+.2f}%), KL {q['kl']:.5f}, top-1 {100 * q['top1']:.2f}%")
    return "\n".join(lines) + "\n"
