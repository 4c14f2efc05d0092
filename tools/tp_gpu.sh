#!/usr/bin/env bash
# The tensor-parallel GPU check, for a machine with 2 GPUs (2 H200s), in one device call of at most
# 600 s. Run from the repository root on a machine staged as ../shared/gpu/README.md says (as for
# tools/gpu.sh): it installs flexsgl offline, then runs the named steps (default: all, in order),
# each under its own time limit, logs and JSON in $OUT, and prints a short table last.
#
#   tests       pytest -m gpu tests/test_tensor_parallel.py: TP=2 against TP=1 on a Qwen3-8B-wide
#               dummy of 4 layers (bf16 logits, greedy tokens; NCCL inside compiled steps and CUDA
#               graphs) and greedy tokens of the tiny presets (float32)
#   latency     flexsgl bench latency, Qwen3-8B dummy, batch 1, --tp 1 then --tp 2 (TPOT)
#   throughput  flexsgl bench throughput, Qwen3-0.6B dummy, --tp 1 then --tp 2
#   70b         flexsgl bench latency, llama3-70b dummy (141 GB in bf16: 70 GB per rank), --tp 2
#
# If one call cannot hold them all (a cold machine compiles more), split them, e.g.
# `bash tools/tp_gpu.sh tests latency` then `bash tools/tp_gpu.sh throughput 70b`.
# Usage: FLEXSGL_COMMIT=<commit> bash tools/tp_gpu.sh [STEP...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:${PYTHONPATH:-}
OUT=${OUT:-/tmp/flexsgl-out}; mkdir -p "$OUT"
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(tests latency throughput 70b)
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  nvidia-smi topo -m
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} >"$OUT/machine.txt" 2>&1
quiet() { tr '\r' '\n' | grep -v -E "capturing|loaded |it/s\]|tok/s\]|^ *$"; }
BENCH=(python -m flexsgl.cli bench)
# Short runs: one capture size, few repeats; the figures are TPOT at batch 1 and output tok/s.
LATENCY=(--workload latency --batch-size 1 --input-len 512 --output-len 128 --repeats 2 --cuda-graph-bs 1)
declare -A LIMITS=([tests]=170 [latency]=170 [throughput]=130 [70b]=150)
for s in "${steps[@]}"; do
  LIMIT=${LIMITS[$s]:-150}; t0=$SECONDS
  echo "== $s (limit $LIMIT s)"
  case $s in
    tests) timeout "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_tensor_parallel.py ;;
    latency) for tp in 1 2; do
               timeout $((LIMIT / 2)) "${BENCH[@]}" "${LATENCY[@]}" --model qwen3-8b --tp "$tp" \
                 --json "$OUT/latency-tp$tp.json"
             done ;;
    throughput) for tp in 1 2; do
                  timeout $((LIMIT / 2)) "${BENCH[@]}" --workload throughput --model qwen3-0.6b --tp "$tp" \
                    --json "$OUT/throughput-tp$tp.json"
                done ;;
    70b) timeout "$LIMIT" "${BENCH[@]}" "${LATENCY[@]}" --model llama3-70b --load-format dummy --tp 2 \
           --max-total-tokens 65536 --json "$OUT/latency-70b-tp2.json" ;;
    *) echo "unknown step $s"; false ;;
  esac 2>&1 | quiet | tee "$OUT/$s.log"
  echo "== $s: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
done
echo; echo "== machine"; head -3 "$OUT/machine.txt"
echo "== summary"; cat "$OUT/summary.txt"
grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -3
python - "$OUT" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*-tp*.json")):
    rep = json.loads(f.read_text())
    for r in rep["results"]:
        rows.append((f.stem, r.get("tpot_s"), r.get("floor_tpot_s"), r.get("output_tokens_per_s"), r.get("startup_s")))
print(f"{'run':<24}{'TPOT ms':>10}{'floor ms':>10}{'out tok/s':>12}{'start s':>9}")
fmt = lambda v, k=1.0: "-" if v is None else f"{v * k:,.2f}"
for name, tpot, floor, tps, start in rows:
    print(f"{name:<24}{fmt(tpot, 1e3):>10}{fmt(floor, 1e3):>10}{fmt(tps):>12}{fmt(start):>9}")
PY
true  # the steps' own exit codes are in the summary above
