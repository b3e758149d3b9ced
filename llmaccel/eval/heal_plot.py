"""The heal's plot: training loss per step and each evaluation domain's KL during the heal.

An artifact compiled with `heal` carries it as heal.png (when matplotlib, the `plot` extra, is
installed); scripts/plot_heal.py draws several runs' reports side by side.
"""
from __future__ import annotations

import json
from pathlib import Path


def heal_stats(path: str) -> tuple[str, str, dict]:
    """(label of the passes before heal, source, the heal pass's stats) of a compile report."""
    rep = json.loads(Path(path).read_text())
    label, stats = heal_runs(rep)[-1]  # relu's kind (relu or drelu) names a relu run
    return label, rep["source"], stats


def plot_stats(runs: list[tuple[str, dict]], out: str, title: str = "heal", quiet: bool = False) -> None:
    """Draw (label, heal stats) runs: the training loss per step (left) and, where the stats
    have a `domain_curve`, KL(source ‖ student) on each evaluation domain at each measurement
    (right: one colour per run, one line style per domain). Writes a PNG to `out`."""
    from llmaccel.errors import require_extra

    require_extra("matplotlib", "plot", "the heal plot").use("Agg")
    import matplotlib.pyplot as plt

    curves = any("domain_curve" in st for _, st in runs)
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(13 if curves else 7, 4), squeeze=False)
    ax = axes[0][0]
    styles = ["-", "--", ":", "-."]
    for i, (label, st) in enumerate(runs):
        colour = f"C{i}"
        xs = [(j + 0.5) * st["loss_curve_every"] for j in range(len(st["loss_curve"]))]
        data = f", {st['sampled_windows']} sampled windows" if st.get("sampled_windows") else ""
        if st.get("refresh_windows"):   # named apart from the same pass healed without them
            data += f" + {st['refresh_windows']} while training"
            label = f"{label} +refresh"
        if str(st.get("compiled", "")).endswith("by layer"):   # heal.regional: more steps, same data
            label = f"{label} by layer"
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
    if not quiet:
        print(f"wrote {out}")


def heal_runs(report: dict) -> list[tuple[str, dict]]:
    """(label, heal stats) for each heal pass of a compile report that trained."""
    names = [p["stats"].get("kind", p["name"]) if p["name"] == "relu" else p["name"]
             for p in report.get("passes", [])]
    runs = []
    for i, p in enumerate(report.get("passes", [])):
        if p["name"] == "heal" and p.get("stats", {}).get("loss_curve"):
            runs.append(("+".join(n for n in names[:i] if n != "heal") or "heal", p["stats"]))
    return runs


def write_heal_plot(report: dict, out: Path) -> bool:
    """Draw a compile report's heal to `out`; False where it had none or matplotlib is missing."""
    runs = heal_runs(report)
    if not runs:
        return False
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    plot_stats(runs, str(out), title=f"heal on {Path(str(report.get('source', ''))).name}", quiet=True)
    return True
