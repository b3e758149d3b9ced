#!/usr/bin/env bash
# Issue 5 speed comparison on one GPU: `llmc bench` next to the peers, same shapes, same run.
#
#   cp -r ../shared/bench .bench          # the peers, in a git-ignored folder of the checkout
#   OUT=/some/dir scripts/gpu_bench.sh    # from the repository root; nothing pip-installed
#
# Every result is one JSON line in $OUT/bench.jsonl (failures too, with "error"); each command's
# full output is in $OUT/<label>.log; a table with ratios is printed last. The whole script
# stays under DEADLINE seconds (default 530): each command gets the time that is left, and a
# command that would start with less than a minute left is skipped.
# CASES="shape:batch ..." and VARIANTS="int4 mm gemv nocustom tune" pick what runs (either may be
# empty), e.g. a second call: CASES= VARIANTS="int4 mm tune" scripts/gpu_bench.sh; HF=0 skips
# the HF eager peer.
set -u
OUT=${OUT:-out/gpu_bench}
mkdir -p "$OUT"
J="$OUT/bench.jsonl"
: > "$J"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
P=128
G=256
DEADLINE=${DEADLINE:-530}
PEERS=${PEERS:-.bench}
CASES=${CASES-"llama-1b:1 smollm2-135m:1 llama-1b:64 llama2-7b:1"}
VARIANTS=${VARIANTS-"int4 mm nocustom"}

record() {  # record LABEL WALL_S LOGFILE RC: append the log's last JSON line, or an error line
  $PY - "$@" >> "$J" <<'EOF'
import json, sys
label, wall, log, rc = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
lines = open(log, errors="replace").read().splitlines()
js = [l for l in lines if l.startswith("{")]
if rc == 0 and js:
    d = json.loads(js[-1])
else:
    d = {"error": f"exit code {rc}" + (" (time limit)" if rc in (124, 137) else ""),
         "tail": "\n".join(lines[-4:])[-600:]}
d.update(label=label, wall_s=wall)
print(json.dumps(d))
EOF
}

run() {  # run LABEL MAX_SECONDS CMD...
  local label=$1 max=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 60 ]; then
    echo "== $label: skipped ($left s left)"
    $PY -c 'import json,sys; print(json.dumps({"label": sys.argv[1], "error": "skipped: out of time"}))' "$label" >> "$J"
    return
  fi
  local limit=$(( max < left ? max : left ))
  echo "== $label (limit $limit s): $*"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  record "$label" $((SECONDS - t0)) "$OUT/$label.log" $rc
  [ $rc -ne 0 ] && tail -n 3 "$OUT/$label.log"
  echo "   exit $rc after $((SECONDS - t0)) s (elapsed $SECONDS s)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'

# Goal-table cases in priority order: the later ones are skipped first when time runs out.
for case in $CASES; do
  shape=${case%%:*} b=${case##*:}
  run "llmc_${shape}_bs$b" 200 $PY -m llmaccel.bench "preset:$shape" --batch "$b" --prompt-len $P \
      --gen-len $G --dtype bfloat16 --json
  run "fast_${shape}_bs$b" 150 $PY $PEERS/peer_fast.py --shape "$shape" --batch "$b" --prompt $P --gen $G
  if [ "$shape" = llama-1b ] && [ "$b" = 1 ] && [ "${HF:-1}" = 1 ]; then
    run "hf_${shape}_bs$b" 90 $PY $PEERS/peer_hf.py --shape "$shape" --batch "$b" --prompt $P --gen $G
  fi
done

# Variants of llama-1b bs1 while time is left: int4 weights (the quant_linear kernels), cuBLAS
# linears instead of Inductor GEMVs, the reference ops everywhere (no custom ops); and
# smollm2-135m with the matmul decode attention instead of the fused kernel (grouped).
L1="preset:llama-1b --batch 1 --prompt-len $P --gen-len $G --dtype bfloat16 --json --no-bw"
for v in $VARIANTS; do
  case $v in
    int4) run "llmc_llama-1b-int4_bs1" 200 $PY -m llmaccel.bench $L1 --passes fuse,quant \
            --set quant.bits=4 --set quant.group_size=128 --set quant.method=rtn ;;
    int4head) run "llmc_llama-1b-int4head_bs1" 200 $PY -m llmaccel.bench $L1 --passes fuse,quant \
            --set quant.bits=4 --set quant.group_size=128 --set quant.method=rtn --set quant.lm_head=true ;;
    int4mm) run "llmc_llama-1b-int4_bs1_mm" 200 $PY -m llmaccel.bench $L1 --passes fuse,quant \
            --set quant.bits=4 --set quant.group_size=128 --set quant.method=rtn --linear mm ;;
    mm) run "llmc_llama-1b_bs1_mm" 150 $PY -m llmaccel.bench $L1 --linear mm ;;
    rows) run "llmc_llama-1b_bs1_rows" 150 $PY -m llmaccel.bench $L1 --linear rows ;;
    nocustom) run "llmc_llama-1b_bs1_nocustom" 150 $PY -m llmaccel.bench $L1 --lower none ;;
    tune) run "llmc_llama-1b_bs1_tune" 200 $PY -m llmaccel.bench $L1 --tune ;;
    gemv) run "llmc_llama-1b_bs1_gemv" 150 $PY -m llmaccel.bench $L1 --linear gemv ;;
    gemvnopdl) LLMACCEL_PDL=0 run "llmc_llama-1b_bs1_gemvnopdl" 150 $PY -m llmaccel.bench $L1 --linear gemv ;;
    gemv7b) run "llmc_llama2-7b_bs1_gemv" 200 $PY -m llmaccel.bench preset:llama2-7b --batch 1 \
            --prompt-len $P --gen-len $G --dtype bfloat16 --json --no-bw --linear gemv ;;
    gemvsmol) run "llmc_smollm2-135m_bs1_gemv" 150 $PY -m llmaccel.bench preset:smollm2-135m \
            --batch 1 --prompt-len $P --gen-len $G --dtype bfloat16 --json --no-bw --linear gemv ;;
    smolrows) run "llmc_smollm2-135m_bs1_rows" 150 $PY -m llmaccel.bench preset:smollm2-135m \
            --batch 1 --prompt-len $P --gen-len $G --dtype bfloat16 --json --no-bw --linear rows ;;
    grouped) run "llmc_smollm2-135m_bs1_grouped" 150 $PY -m llmaccel.bench preset:smollm2-135m \
            --batch 1 --prompt-len $P --gen-len $G --dtype bfloat16 --json --no-bw --attn grouped ;;
    kv16) run "llmc_llama-1b_bs64_p4096" 300 $PY -m llmaccel.bench preset:llama-1b --batch 64 \
            --prompt-len 4096 --gen-len $G --dtype bfloat16 --json --no-bw ;;
    kv2) run "llmc_llama-1b-kv2_bs64_p4096" 300 $PY -m llmaccel.bench preset:llama-1b --batch 64 \
            --prompt-len 4096 --gen-len $G --dtype bfloat16 --json --no-bw --passes fuse,kvquant \
            --set kvquant.bits=2 ;;
    *) echo "unknown variant $v (known: int4 int4head int4mm mm rows gemv gemvnopdl gemv7b gemvsmol smolrows nocustom tune grouped kv16 kv2)" ;;
  esac
done

$PY - "$J" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
goals = {("llama-1b", 1): 1300, ("smollm2-135m", 1): 1500, ("llama-1b", 64): 40000, ("llama2-7b", 1): 285,
         ("llama-1b-int4", 1): 2500}
by = {r["label"]: r for r in rows}
def tok(label):
    r = by.get(label, {})
    return r.get("decode_tok_s")
fmt = lambda v, p=0: "-" if v is None else f"{v:,.{p}f}"
print()
print(f"{'case':<20}{'llmc':>10}{'fast peer':>11}{'HF eager':>10}{'llmc/fast':>10}{'goal':>8}"
      f"{'roofline':>10}{'% roof':>8}{'kern/step':>10}{'GPU ms':>8}{'step ms':>8}{'prefill ms':>11}")
for (shape, b), goal in goals.items():
    ours = by.get(f"llmc_{shape}_bs{b}", {})
    peer = shape.removesuffix("-int4")  # int4 is compared with the bf16 peer
    o, f, h = ours.get("decode_tok_s"), tok(f"fast_{peer}_bs{b}"), tok(f"hf_{peer}_bs{b}")
    ratio = f"{o / f:.2f}x" if o and f else "-"
    frac = ours.get("roofline_frac")
    print(f"{shape + ' bs' + str(b):<20}{fmt(o):>10}{fmt(f):>11}{fmt(h):>10}{ratio:>10}{goal:>8,}"
          f"{fmt(ours.get('roofline_tok_s')):>10}{fmt(frac and 100 * frac, 1):>8}"
          f"{fmt(ours.get('kernels_per_step'), 1):>10}{fmt(ours.get('gpu_ms_per_step'), 3):>8}"
          f"{fmt(ours.get('step_ms'), 3):>8}"
          f"{fmt(ours.get('prefill_tok_s') and b * ours['prompt'] / ours['prefill_tok_s'] * 1e3, 2):>11}")
for label in ("llmc_llama-1b-int4head_bs1", "llmc_llama-1b-int4_bs1_mm", "llmc_llama-1b_bs1_mm", "llmc_llama-1b_bs1_rows", "llmc_llama-1b_bs1_gemv",
              "llmc_llama-1b_bs1_gemvnopdl", "llmc_llama2-7b_bs1_gemv", "llmc_smollm2-135m_bs1_gemv", "llmc_smollm2-135m_bs1_rows",
              "llmc_llama-1b_bs1_nocustom",
              "llmc_llama-1b_bs1_tune", "llmc_smollm2-135m_bs1_grouped"):
    r = by.get(label)
    if r is None or "error" in r:
        continue
    print(f"{label:<28} {fmt(r.get('decode_tok_s'))} tok/s, step {fmt(r.get('step_ms'), 3)} ms, "
          f"{fmt(r.get('kernels_per_step'), 1)} kernels/step")
kv16, kv2 = by.get("llmc_llama-1b_bs64_p4096", {}), by.get("llmc_llama-1b-kv2_bs64_p4096", {})
for name, r in (("bf16 KV", kv16), ("KV2", kv2)):
    if r.get("decode_tok_s"):
        print(f"llama-1b bs64 prompt 4096, {name:<8} decode phase {fmt(r.get('decode_step_tok_s'))} tok/s "
              f"(step {fmt(r.get('step_ms'), 3)} ms, {fmt(r.get('kernels_per_step'), 1)} kernels), whole generate "
              f"{fmt(r.get('decode_tok_s'))} tok/s, prefill {fmt(r.get('prefill_tok_s'))} tok/s")
if kv16.get("decode_step_tok_s") and kv2.get("decode_step_tok_s"):
    print(f"KV2 / bf16 KV: decode phase {kv2['decode_step_tok_s'] / kv16['decode_step_tok_s']:.2f}x (goal 1.6x), "
          f"whole generate {kv2['decode_tok_s'] / kv16['decode_tok_s']:.2f}x")
errs = [r for r in rows if "error" in r]
for r in errs:
    print(f"FAILED {r['label']}: {r['error']}: {r.get('tail', '')[-200:]!r}")
print(f"\n{len(rows)} records in {sys.argv[1]}")
EOF
