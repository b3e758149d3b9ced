#!/usr/bin/env bash
# Longer heals of gqa (kv_heads=1) and relu (relu and drelu) on a CUDA device, then the
# quality protocol on held-out text (second half of WikiText-2 test, 8192 tokens, ctx 512).
# Usage: scripts/gpu_heal.sh [STEPS] [OUTDIR]   (default 2000 steps of 4 x 512 tokens, out/heal-gpu)
# Healing runs in float32 (AdamW updates vanish in bf16 weights). The loss curves are in each
# artifact's report.json (passes[-1].stats.loss_curve); scripts/plot_heal.py draws them.
set -euo pipefail
STEPS=${1:-2000}
OUT=${2:-out/heal-gpu}
LLMC=${LLMC:-.venv/bin/llmc}
PY=${PY:-.venv/bin/python}
TEXT=${TEXT:-data/wikitext2/wiki.test.raw}
mkdir -p "$OUT"
HEAL="--set heal.steps=$STEPS --set heal.seq_len=512 --set heal.batch=4 --set heal.lr=2e-4 --set heal.warmup=50 --set heal.eval_windows=16"
run() {  # name, passes, extra --set options
  local name=$1 passes=$2; shift 2
  "$LLMC" compile smollm2-135m --device cuda --passes "$passes" "$@" $HEAL \
    --calib "$TEXT" --calib-split first-half --eval-tokens 8192 -o "$OUT/$name" | tee "$OUT/$name.compile.txt"
  "$LLMC" eval "$OUT/$name" --device cuda --text "$TEXT" --split second-half --max-tokens 8192 \
    --ctx 512 --baseline smollm2-135m --json | tee "$OUT/$name.eval.txt"
}
run gqa1 gqa,heal --set gqa.kv_heads=1
run relu relu,heal --set relu.kind=relu
run drelu relu,heal --set relu.kind=drelu
# unhealed references for the before/after table
for p in "gqa1-noheal gqa --set gqa.kv_heads=1" "relu-noheal relu --set relu.kind=relu" "drelu-noheal relu --set relu.kind=drelu"; do
  set -- $p
  name=$1 passes=$2; shift 2
  "$LLMC" compile smollm2-135m --device cuda --passes "$passes" "$@" --calib "$TEXT" \
    --calib-split first-half --eval-tokens 8192 -o "$OUT/$name" | tee "$OUT/$name.compile.txt"
done
# sparsity after heal (heal changes the weights, so the relu pass's own figure is pre-heal)
"$PY" scripts/plot_heal.py --sparsity "$OUT/relu" "$OUT/drelu" --text "$TEXT" --device cuda | tee "$OUT/sparsity.txt"
"$PY" scripts/plot_heal.py "$OUT"/gqa1/report.json "$OUT"/relu/report.json "$OUT"/drelu/report.json -o docs/heal_gpu.png
