"""Plot heal loss curves from compile reports, or measure ReLU sparsity of healed artifacts.

    python scripts/plot_heal.py out/a/report.json out/b/report.json -o docs/heal.png
    python scripts/plot_heal.py --sparsity out/relu out/drelu --text data/wikitext2/wiki.test.raw
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(reports: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in reports:
        rep = json.loads(Path(path).read_text())
        heal = [p for p in rep["passes"] if p["name"] == "heal"][-1]
        st = heal["stats"]
        before = "+".join(p["name"] for p in rep["passes"] if p["name"] != "heal")
        xs = [(i + 0.5) * st["loss_curve_every"] for i in range(len(st["loss_curve"]))]
        data = f", {st['sampled_windows']} sampled windows" if st.get("sampled_windows") else ""
        ax.plot(xs, st["loss_curve"], label=f"{before} ({st['steps']} steps{data}): held-out ΔPPL "
                f"{st['delta_ppl_pct_before']:+.0f}% → {st['delta_ppl_pct_after']:+.0f}%")
    ax.set_xlabel("heal step")
    ax.set_ylabel("KL(source || student) per token")
    ax.set_yscale("log")
    ax.set_title(f"heal on {rep['source']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


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
    ap.add_argument("--text", default="data/wikitext2/wiki.test.raw")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if a.sparsity:
        sparsity(a.paths, a.text, a.device)
    else:
        plot(a.paths, a.output)
