"""Plot decode speed against the fast peer and the goals (figures from docs/performance.md).

    PYTHONPATH=. python scripts/plot_perf.py OUT/suite.jsonl -o docs/perf-h200.png

Reads the GPU suite's JSON lines (`python -m llmaccel.bench.suite`; older files of docs/results/
hold the same figures at the top level of each line): for each goal case, llmc's decode tok/s,
the fast peer's in the same call, the goal and the roofline, each as a fraction of the goal.
"""
from __future__ import annotations

import argparse
import json

from llmaccel.bench.suite_table import GOALS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("-o", "--output", default="docs/perf-h200.png")
    a = ap.parse_args()
    by = {}
    for path in a.jsonl:
        for line in open(path):
            r = json.loads(line)
            by[r["label"]] = {**r, **(r.get("result") or {})}
    rows = []
    for g in GOALS:
        ours, peer = by.get(g.label, {}), by.get(g.peer, {})
        if g.tok_s and "decode_tok_s" in ours:  # the absolute goals (sampled rows are relative)
            rows.append((g.case.replace(" ", "\n", 1), ours["decode_tok_s"], peer.get("decode_tok_s"), g.tok_s,
                         ours.get("roofline_tok_s")))
    from llmaccel.errors import require_extra

    require_extra("matplotlib", "plot", "plot_perf.py").use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] / r[3] for r in rows], 0.4, label="llmc")
    ax.bar([x + 0.2 for x in xs], [(r[2] or 0) / r[3] for r in rows], 0.4, label="fast peer (int4 row: bf16)")
    ax.axhline(1.0, color="k", lw=1, ls="--", label="goal")
    for x, r in zip(xs, rows):
        ax.annotate(f"{r[1]:,.0f}", (x - 0.2, r[1] / r[3]), ha="center", va="bottom", fontsize=8)
        if r[2]:
            ax.annotate(f"{r[2]:,.0f}", (x + 0.2, r[2] / r[3]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r[0] for r in rows])
    ax.set_ylim(0, 1.3 * max(max(r[1], r[2] or 0) / r[3] for r in rows))  # room for the legend
    ax.set_ylabel("decode tok/s / goal")
    ax.set_title("Decode speed on one H200 (bf16, prompt 128, gen 256), tok/s on the bars")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(a.output, dpi=120)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
