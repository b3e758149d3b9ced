#!/usr/bin/env bash
# The GPU suite: `llmc bench` (LLM, the path users run) next to the gpt-fast-style peer, every row
# of the speed goals, in one call.
#
#   cp -r ../shared/bench .bench          # the peers, in a git-ignored folder of the checkout
#   OUT=/some/dir scripts/gpu_bench.sh    # from the repository root; nothing pip-installed
#
# Every result is one JSON line in $OUT/bench.jsonl (failures too, with "error"); each command's
# full output is in $OUT/<label>.log; a table with ratios is printed last. The whole script
# stays under DEADLINE seconds (default 560): each command gets the time that is left, and a
# command that would start with less than a minute left is skipped.
# ROWS="..." picks the rows (default: all, in this order): b1 b1s smol smols b64 b64s w4 7b load
# PEER=0 skips the peers.
set -u
OUT=${OUT:-out/gpu_bench}
mkdir -p "$OUT"
J="$OUT/bench.jsonl"
: > "$J"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
P=128
G=256
DEADLINE=${DEADLINE:-560}
PEERS=${PEERS:-.bench}
ROWS=${ROWS-"b1 b1s smol b64 b64s w4 7b smols load"}
SAMPLED="--temperature 0.8 --top-p 0.95"

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

bench() {  # bench LABEL MAX_S SHAPE BATCH ARGS...
  local label=$1 max=$2 shape=$3 b=$4
  shift 4
  run "$label" "$max" $PY -m llmaccel.bench "preset:$shape" --batch "$b" --prompt-len $P --gen-len $G \
      --dtype bfloat16 --json --no-bw "$@"
}
peer() {  # peer SHAPE BATCH
  [ "${PEER:-1}" = 1 ] && run "fast_$1_bs$2" 150 $PY $PEERS/peer_fast.py --shape "$1" --batch "$2" --prompt $P --gen $G
}
for row in $ROWS; do
  case $row in
    b1) peer llama-1b 1; bench llmc_llama-1b_bs1 240 llama-1b 1 ;;
    b1s) bench llmc_llama-1b_bs1_sampled 200 llama-1b 1 $SAMPLED ;;
    smol) peer smollm2-135m 1; bench llmc_smollm2-135m_bs1 200 smollm2-135m 1 ;;
    smols) bench llmc_smollm2-135m_bs1_sampled 200 smollm2-135m 1 $SAMPLED ;;
    b64) peer llama-1b 64; bench llmc_llama-1b_bs64 240 llama-1b 64 ;;
    b64s) bench llmc_llama-1b_bs64_sampled 200 llama-1b 64 $SAMPLED ;;
    w4) bench llmc_llama-1b-int4_bs1 240 llama-1b 1 --passes fuse,quant --set quant.bits=4 \
          --set quant.group_size=128 --set quant.method=rtn ;;
    7b) peer llama2-7b 1; bench llmc_llama2-7b_bs1 240 llama2-7b 1 ;;
    load) run load_llama-1b_256 300 $PY scripts/gpu_runtime_check.py --load-only --graphs on ;;
    *) echo "unknown row $row (known: b1 b1s smol smols b64 b64s w4 7b load)" ;;
  esac
done

$PY - "$J" "$OUT" <<'EOF2'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {r["label"]: r for r in rows}
fmt = lambda v, p=0: "-" if v is None else f"{v:,.{p}f}"
GOALS = [("llama-1b bs1", "llmc_llama-1b_bs1", "fast_llama-1b_bs1", 1150),
         ("llama-1b bs1 sampled", "llmc_llama-1b_bs1_sampled", "fast_llama-1b_bs1", None),
         ("smollm2-135m bs1", "llmc_smollm2-135m_bs1", "fast_smollm2-135m_bs1", 2200),
         ("smollm2-135m bs1 sampled", "llmc_smollm2-135m_bs1_sampled", "fast_smollm2-135m_bs1", None),
         ("llama-1b bs64", "llmc_llama-1b_bs64", "fast_llama-1b_bs64", 40000),
         ("llama-1b bs64 sampled", "llmc_llama-1b_bs64_sampled", "fast_llama-1b_bs64", None),
         ("llama-1b W4 bs1", "llmc_llama-1b-int4_bs1", "fast_llama-1b_bs1", 1289),
         ("llama2-7b bs1", "llmc_llama2-7b_bs1", "fast_llama2-7b_bs1", 270)]
print()
print(f"{'case':<26}{'LLM tok/s':>10}{'fast peer':>10}{'ratio':>7}{'goal':>8}{'step ms':>9}"
      f"{'kern/step':>10}{'GPU ms':>8}{'% roof':>8}{'TTFT ms':>9}")
for name, ours, peer, goal in GOALS:
    o, f = by.get(ours, {}), by.get(peer, {})
    a, b = o.get("decode_tok_s"), f.get("decode_tok_s")
    frac = o.get("roofline_frac")
    print(f"{name:<26}{fmt(a):>10}{fmt(b):>10}{(f'{a / b:.2f}x' if a and b else '-'):>7}{fmt(goal):>8}"
          f"{fmt(o.get('step_ms'), 3):>9}{fmt(o.get('kernels_per_step'), 1):>10}"
          f"{fmt(o.get('gpu_ms_per_step'), 3):>8}{fmt(frac and 100 * frac, 1):>8}"
          f"{fmt(o.get('ttft_s') and 1e3 * o['ttft_s'], 1):>9}")
load = os.path.join(sys.argv[2], "gpu_runtime_check.json")
if os.path.exists(load):
    for r in json.load(open(load)).get("load", []):
        print(f"serving load: {r['requests']} requests, {fmt(r['output_tok_s'])} output tok/s "
              f"(goal 40,000), mean TPOT {r['mean_tpot_ms']} ms, lengths ok {r['lengths_ok']}")
for r in rows:
    for k, why in (r.get("graph_failures") or {}).items():
        print(f"{r['label']}: decode shape {k} uncaptured: {why}")
    if "error" in r:
        print(f"FAILED {r['label']}: {r['error']}: {r.get('tail', '')[-300:]!r}")
print(f"\n{len(rows)} records in {sys.argv[1]}")
EOF2
