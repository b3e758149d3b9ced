"""Plot heal loss curves and per-domain KL curves from compile reports, or measure ReLU
sparsity of healed artifacts.

    python scripts/plot_heal.py out/a/report.json out/b/report.json -o docs/heal.png
    python scripts/plot_heal.py --sparsity out/relu out/drelu --text llmaccel/data/wikitext2/wiki.test.raw
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmaccel.eval.heal_plot import heal_stats, plot_stats


def plot(reports: list[str], out: str) -> None:
    runs = [heal_stats(p) for p in reports]
    plot_stats([(label, st) for label, _, st in runs], out, title=f"heal on {Path(runs[-1][1]).name}")


def sparsity(artifacts: list[str], text: str, device: str, tokens: int = 2048) -> None:
    from llmaccel.compiler.model import load
    from llmaccel.eval.text import load_tokens
    from llmaccel.passes.relu import measure_sparsity

    for a in artifacts:
        m = load(a, device=device)
        ids = load_tokens(m, text, "second-half", tokens).view(-1, 512).to(device)
        s = measure_sparsity(m.gm, ids)
        print(json.dumps({"artifact": a, "sparsity_mean": round(sum(s) / len(s), 4),
                          "sparsity_min": round(min(s), 4), "tokens": ids.numel()}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("-o", "--output", default="docs/heal.png")
    ap.add_argument("--sparsity", action="store_true", help="paths are relu artifacts: measure sparsity")
    ap.add_argument("--text", default="llmaccel/data/wikitext2/wiki.test.raw")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if a.sparsity:
        sparsity(a.paths, a.text, a.device)
    else:
        plot(a.paths, a.output)
