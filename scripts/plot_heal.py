"""Plot heal loss curves and per-domain KL curves from compile reports, or measure ReLU
sparsity of healed artifacts.

    python scripts/plot_heal.py out/a/report.json out/b/report.json -o docs/heal.png
    python scripts/plot_heal.py --sparsity out/relu out/drelu --text data/wikitext2/wiki.test.raw
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def heal_stats(path: str) -> tuple[str, str, dict]:
    """(label of the passes before heal, source, the heal pass's stats) of a compile report."""
    rep = json.loads(Path(path).read_text())
    heal = [p for p in rep["passes"] if p["name"] == "heal"][-1]
    # relu's kind (relu or drelu) names the run: both are the relu pass
    before = "+".join(p["stats"].get("kind", p["name"]) if p["name"] == "relu" else p["name"]
                      for p in rep["passes"] if p["name"] != "heal") or "heal"
    return before, rep["source"], heal["stats"]


def plot_stats(runs: list[tuple[str, dict]], out: str, title: str = "heal") -> None:
    """Draw (label, heal stats) runs: the training loss per step (left) and, where the stats
    have a `domain_curve`, KL(source ‖ student) on each evaluation domain at each measurement
    (right: one colour per run, one line style per domain). Writes a PNG to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = any("domain_curve" in st for _, st in runs)
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(13 if curves else 7, 4), squeeze=False)
    ax = axes[0][0]
    styles = ["-", "--", ":", "-."]
    for i, (label, st) in enumerate(runs):
        colour = f"C{i}"
        xs = [(j + 0.5) * st["loss_curve_every"] for j in range(len(st["loss_curve"]))]
        data = f", {st['sampled_windows']} sampled windows" if st.get("sampled_windows") else ""
        ax.plot(xs, st["loss_curve"], color=colour, label=f"{label} ({st['steps']} steps{data}): held-out "
                f"ΔPPL {st['delta_ppl_pct_before']:+.0f}% → {st['delta_ppl_pct_after']:+.0f}%")
        dc = st.get("domain_curve")
        if dc:
            for k, (dom, kls) in enumerate(dc["kl"].items()):
                after = st["domains"][dom]["after"]["delta_ppl_pct"]
                axes[0][1].plot(dc["steps"], kls, styles[k % len(styles)], color=colour, marker="o",
                                ms=3, label=f"{label}: {dom} (ΔPPL after {after:+.0f}%)")
    ax.set_xlabel("heal step")
    ax.set_ylabel("training KL(source || student) per token")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7)
    if curves:
        ax2 = axes[0][1]
        ax2.set_xlabel("heal step")
        ax2.set_ylabel("KL(source || student) per token")
        ax2.set_yscale("log")
        ax2.set_title("evaluation domains (never trained on)")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


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
    ap.add_argument("--text", default="data/wikitext2/wiki.test.raw")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if a.sparsity:
        sparsity(a.paths, a.text, a.device)
    else:
        plot(a.paths, a.output)
