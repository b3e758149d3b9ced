#!/usr/bin/env bash
# One GPU call's worth of checks and kernel benchmarks, each under its own time limit, with
# the whole run kept under DEADLINE seconds (default 560). Logs and JSON go to $OUT.
#   OUT=/dir STEPS="tests gemv bitlinear sla sparse spec qtests" scripts/gpu_checks.sh
# spec needs the real SmolLM2 GGUF at $GGUF (default /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf).
set -u
OUT=${OUT:-out/gpu_checks}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
DEADLINE=${DEADLINE:-560}
STEPS=${STEPS:-"tests gemv bitlinear sla sparse spec"}
GGUF=${GGUF:-/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf}
PROMPT=${PROMPT:-"Photosynthesis is the process by which green plants turn light into chemical energy. In this essay I will explain how it works, step by step, and why it matters for life on Earth."}

run() {  # run LABEL MAX_SECONDS CMD...
  local label=$1 max=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 30 ]; then echo "== $label: skipped ($left s left)"; return; fi
  local limit=$(( max < left ? max : left ))
  echo "== $label (limit $limit s)"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$label.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
for s in $STEPS; do
  case $s in
    tests) run cuda_tests 200 $PY -m pytest -q -p no:cacheprovider -m cuda tests -x -k "not real" ;;
    gemv) run gemv 150 $PY scripts/gpu_quant_bench.py --batches 1 --budget 90 --ops int4 ;;
    bitlinear) run bitlinear 90 $PY scripts/gpu_bitlinear_bench.py --batch 1 16 ;;
    sla) run sla 90 $PY scripts/gpu_sla_bench.py ;;
    sparse) run sparse 60 $PY scripts/gpu_sparse_bench.py ;;
    spec) for d in none self:8 ngram; do  # LLM with each draft, the same prompt
            run "spec_${d/:/}" 120 $PY -m llmaccel.bench "$GGUF" --prompt "$PROMPT" --gen-len 256 --dtype bfloat16 \
              $([ "$d" = none ] || echo --speculative "$d") --no-profile --json
          done ;;
    qtests) run quant_tests 150 $PY -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_quant_linear.py ;;
    *) echo "unknown step $s" ;;
  esac
done
