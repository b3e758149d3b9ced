"""Plot ΔPPL against storage for weight and KV-cache quantization (figures from docs/quality.md).

    python scripts/plot_quant.py -o docs/quant-ppl-vs-bytes.png

The points are the full-protocol measurements on SmolLM2-135M (16,383 second-half tokens);
bytes per weight include scales and zero points, bytes per KV token are all 30 layers at the
cache dtype (bf16 = 23,040).
"""
from __future__ import annotations

import argparse

WEIGHTS = [  # label, bytes per weight, ΔPPL %
    ("source (bf16 storage)", 2.0, 0.0), ("W8 per channel", 1.006, 0.17), ("W4 g128 RTN", 0.580, 32.73),
    ("W4 g128 GPTQ (16 samples)", 0.580, 38.61), ("W4 g128 AWQ (16 samples)", 0.580, 28.19),
    ("W4 g128 AWQ+GPTQ, default", 0.580, 11.21),
]
KV = [  # label, bytes per token, ΔPPL %
    ("source (bf16 cache)", 23040, 0.0), ("KV4 G32", 7200, 0.19), ("KV2 G16", 5760, 6.35), ("KV2 G32", 4320, 14.34),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", default="docs/quant-ppl-vs-bytes.png")
    out = ap.parse_args().output
    from llmaccel.errors import require_extra

    require_extra("matplotlib", "plot", "plot_quant.py").use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, pts, xlabel, title in ((a, WEIGHTS, "bytes per weight", "weights (quant)"),
                                   (b, KV, "KV-cache bytes per token", "KV cache (kvquant)")):
        ax.scatter([p[1] for p in pts], [p[2] for p in pts])
        for label, x, y in pts:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ΔPPL vs fp32 source (%)")
        ax.set_title(f"SmolLM2-135M, {title}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
