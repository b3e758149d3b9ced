#!/usr/bin/env bash
# W4 g128 weight quantization of SmolLM2-135M on one CUDA device: method and option sweep on the
# full quality protocol (calibrate on the first half of WikiText-2 test, evaluate 16,384 tokens
# of the second half at ctx 512 against the source). Jobs share the GPU, JOBS at a time; each
# job's eval JSON (and the compile report) lands in $OUT; a table is printed last.
# Usage: scripts/gpu_w4_sweep.sh [NAMES...]   (default: every config below; options not listed
# keep the pass defaults, e.g. refit=true gqa_o=true awq_clip=true)
# Env: SRC (default /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf), OUT (default out/w4-sweep),
#      ART (artifact dir, default /tmp/w4-art: artifacts are large, kept out of $OUT),
#      JOBS (parallel jobs, default 6), BUDGET (seconds after which no new job starts, default 300),
#      PY, TEXT, TOKENS (eval tokens, default 16384).
set -uo pipefail
SRC=${SRC:-/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-out/w4-sweep}
ART=${ART:-/tmp/w4-art}
JOBS=${JOBS:-6}
BUDGET=${BUDGET:-300}
PY=${PY:-python}
TEXT=${TEXT:-data/wikitext2/wiki.test.raw}
TOKENS=${TOKENS:-16384}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / JOBS > 0 ? $(nproc) / JOBS : 1 ))}
LLMC="$PY -m llmaccel.cli"
mkdir -p "$OUT" "$ART"

# name -> quant options (besides bits=4, group_size=128); most promising first
opts_of() {
  case $1 in
    default)      echo "" ;;
    ag)           echo "method=awq+gptq n_samples=128" ;;
    ag_ao)        echo "method=awq+gptq n_samples=128 act_order=true" ;;
    ag_norf)      echo "method=awq+gptq n_samples=128 refit=false" ;;
    ag_duo)       echo "method=awq+gptq n_samples=128 awq_duo=true" ;;
    ag_all)       echo "method=awq+gptq n_samples=128 act_order=true refit=true awq_duo=true" ;;
    ag_tok)       echo "method=awq+gptq n_samples=128 awq_tokens=4096" ;;
    ag_ms)        echo "method=awq+gptq n_samples=128 match_source=true" ;;
    ag_ms_all)    echo "method=awq+gptq n_samples=128 match_source=true act_order=true refit=true awq_duo=true" ;;
    awq)          echo "method=awq n_samples=128" ;;
    awq_duo)      echo "method=awq n_samples=128 awq_duo=true" ;;
    gptq)         echo "method=gptq n_samples=128" ;;
    gptq_rs_ao)   echo "method=gptq n_samples=128 range_search=20 act_order=true refit=true" ;;
    ag_noo)       echo "method=awq+gptq n_samples=128 gqa_o=false" ;;
    ag_noclip)    echo "method=awq+gptq n_samples=128 awq_clip=false range_search=20" ;;
    ag16)         echo "method=awq+gptq n_samples=16" ;;
    rtn)          echo "method=rtn" ;;
    *) echo "unknown config $1" >&2; return 1 ;;
  esac
}
ALL="default ag ag_ao ag_norf ag_duo ag_all ag_tok ag_ms ag_ms_all awq awq_duo gptq gptq_rs_ao ag_noo ag_noclip ag16 rtn"
NAMES=${*:-$ALL}

job() {
  local name=$1 spec sets="" o
  spec=$(opts_of "$name") || return 1
  for o in bits=4 group_size=128 $spec; do sets="$sets --set quant.$o"; done
  local t0=$SECONDS
  $LLMC compile "$SRC" --device cuda --passes quant $sets --calib "$TEXT" --calib-split first-half \
    --eval-tokens 0 -o "$ART/$name" > "$OUT/$name.compile.txt" 2>&1 || { echo "$name: compile failed"; return 1; }
  local tc=$((SECONDS - t0))
  cp "$ART/$name/report.json" "$OUT/$name.report.json" 2>/dev/null
  $LLMC eval "$ART/$name" --device cuda --text "$TEXT" --split second-half --max-tokens "$TOKENS" \
    --ctx 512 --baseline "$SRC" --json > "$OUT/$name.eval.txt" 2>&1 || { echo "$name: eval failed"; return 1; }
  tail -n 1 "$OUT/$name.eval.txt" | $PY -c "import json,sys; d=json.load(sys.stdin); d.update(name='$name', options='$spec', compile_s=$tc); print(json.dumps(d))" > "$OUT/$name.json"
  rm -rf "${ART:?}/$name"
  echo "$name done (compile ${tc}s)"
}

start=$SECONDS
for n in $NAMES; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  if [ $((SECONDS - start)) -gt "$BUDGET" ]; then echo "budget spent: not starting $n"; continue; fi
  job "$n" &
done
wait
echo "total ${SECONDS}s"
$PY - "$OUT" <<'EOF'
import json, pathlib, sys
rows = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))
        if not p.name.endswith(".report.json")]
rows.sort(key=lambda d: d["ppl"])
print(f"{'config':<12} {'ppl':>8} {'dPPL%':>7} {'KL':>7} {'top1%':>6} {'comp_s':>6}  options")
for d in rows:
    print(f"{d['name']:<12} {d['ppl']:8.4f} {100 * (d['ppl'] / d['baseline_ppl'] - 1):7.2f} "
          f"{d['kl']:7.4f} {100 * d['top1']:6.2f} {d['compile_s']:6d}  {d['options']}")
EOF
