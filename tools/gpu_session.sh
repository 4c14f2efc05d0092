#!/usr/bin/env bash
# One device call's worth of GPU work, after staging (../shared/gpu/README.md): install flexsgl
# offline, then run the named steps in order, each under its own time limit, logs and JSON in $OUT,
# and print each step's headline lines last. A device call runs at most 600 s: pick steps whose
# limits (below) sum to less, e.g. `check attention`, `latency throughput`, `prefill suite-kernels`. Steps:
#   check       GPU tests of the batch-1 kernels and the engine against HF (tools/gpu_check.sh)
#   latency     flexsgl bench latency, Qwen3-8B dummy, batch 1
#   attention   tools/decode_attention_sweep.py: decode kernels and options at throughput shapes
#   gemv        tools/gemv_bench.py --no-sweep --chain-sweep: an 8B's projections from one graph,
#               plain vs PDL, and tiles per projection inside the PDL chain
#   profile     tools/profile_step.py: the kernels of a Qwen3-8B batch-1 decode step
#   split-kv    GPU tests of the triton-decode kernel (alone, against flex, in the engine against HF)
#   attention-small  decode kernels at batch 1-64, timed inside CUDA graphs, triton-decode included
#   latency-compare  flexsgl bench latency, Qwen3-8B: fa3-prefill,fi-decode against auto (which adds
#               triton-decode for small batches on SM90)
#   throughput  flexsgl bench throughput, Qwen3-0.6B dummy, the default workload
#   repeat      the throughput run in five fresh processes, one figure each (a single run says
#               little: machines differ by ~2%, docs/BENCHMARKS.md, seventh session); on a fresh
#               machine the first one compiles everything and may be cut by its 110 s limit
#   prefill     flexsgl bench prefill, Qwen3-8B dummy, 4k and 16k prompts
#   suite-kernels  benchmarks/ attention kernels and the HF peers (pytest-benchmark), JSON in $OUT
#   suite-engine   benchmarks/test_engine.py for $SUITE_BACKENDS (a -k expression; default the
#                  kernel backends fa3, fi and fa3-prefill,fi-decode). A row with flex prefill spends
#                  ~60 s compiling prefill and, with flex decode, ~25 s per decode bucket: run the
#                  flex rows on their own, e.g. SUITE_BACKENDS=flex (384 s on a fresh machine at ae9b945)
# The suite steps stop with SIGINT at their limit; a compile it interrupts fails as
# BackendCompilerFailed ("Attempted to unset ProxyTorchDispatchMode"), which hides the SIGINT.
# They also write each benchmark as it finishes to $OUT/benchmarks-*.jsonl (benchmarks/conftest.py):
# pytest-benchmark's own JSON comes only at the end, and an interrupted benchmark can keep it from
# being written at all.
# Usage: bash tools/gpu_session.sh [STEP ...]   (set FLEXSGL_COMMIT; the tree travels without .git)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:${PYTHONPATH:-}
OUT=${OUT:-/tmp/flexsgl-out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# Progress bars redraw with carriage returns: split them off, so the line a bar shares with the
# next message does not take that message with it.
quiet() { tr '\r' '\n' | grep -v -E "capturing|loaded |it/s\]|tok/s\]|^ *$"; }
declare -A LIMIT=([check]=420 [latency]=270 [attention]=150 [throughput]=240 [prefill]=240 [suite-kernels]=330
                  [suite-engine]=570
                  [gemv]=240 [repeat]=590 [profile]=200 [split-kv]=300 [attention-small]=200 [latency-compare]=480)
for step in "${@:-check attention}"; do
  for s in $step; do
    log="$OUT/$s.log"; t0=$SECONDS
    echo "== $s (limit ${LIMIT[$s]:-300} s)"
    case $s in
      check) timeout "${LIMIT[$s]}" bash tools/gpu_check.sh tests/test_gemv.py tests/test_rope_store.py \
               tests/test_gpu.py tests/test_gpu_overrides.py -k "gemv or fused or batch_1 or tracks_hf or kernel_matches" ;;
      split-kv) timeout "${LIMIT[$s]}" bash tools/gpu_check.sh tests/test_triton_decode.py tests/test_gpu_overrides.py \
                  -k "triton and not 8b" ;;
      attention-small) timeout "${LIMIT[$s]}" python tools/decode_attention_sweep.py --graph \
                         --cases 1x1152 1x4096 4x1152 8x1500 16x1800 32x1500 64x1500 128x1100 \
                         --variants fi-tc fi-cuda fa3-1split triton triton-1x triton-4x triton-w2 triton-w8 triton-s3 ;;
      latency-compare) timeout "${LIMIT[$s]}" python -m flexsgl.cli bench --workload latency --model qwen3-8b \
                         --override fa3-prefill,fi-decode --override auto --json "$OUT/latency-compare.json" ;;
      gemv) timeout "${LIMIT[$s]}" python tools/gemv_bench.py --no-sweep --chain-sweep ;;
      profile) timeout "${LIMIT[$s]}" python tools/profile_step.py --model qwen3-8b --batch 1 --steps 20 --rows 30 ;;
      latency) timeout "${LIMIT[$s]}" python -m flexsgl.cli bench --workload latency --model qwen3-8b --repeats 2 \
                 --json "$OUT/latency.json" ;;
      attention) timeout "${LIMIT[$s]}" python tools/decode_attention_sweep.py ;;
      throughput) timeout "${LIMIT[$s]}" python -m flexsgl.cli bench --workload throughput --model qwen3-0.6b \
                    --json "$OUT/throughput.json" ;;
      repeat) for i in 1 2 3 4 5; do
                timeout 110 python -m flexsgl.cli bench --workload throughput --model qwen3-0.6b \
                  --json "$OUT/repeat-$i.json" 2>&1 | grep -E "^output tok/s" | sed "s/^/process $i: /"
              done ;;
      prefill) timeout "${LIMIT[$s]}" python -m flexsgl.cli bench --workload prefill --model qwen3-8b \
                 --max-batch-tokens 16384 --json "$OUT/prefill.json" ;;
      suite-kernels) FLEXSGL_BENCH_LINES="$OUT/benchmarks-kernels.jsonl" timeout -s INT "${LIMIT[$s]}" python -m pytest -q -p no:cacheprovider \
                       benchmarks/test_attention_kernels.py benchmarks/test_peers.py \
                       --benchmark-json="$OUT/benchmarks-kernels.json" --benchmark-columns=median,rounds ;;
      suite-engine) FLEXSGL_BENCH_LINES="$OUT/benchmarks-engine.jsonl" timeout -s INT "${LIMIT[$s]}" python -m pytest -q -p no:cacheprovider benchmarks/test_engine.py \
                      -k "${SUITE_BACKENDS:-fa3 or (fi and not decode)}" --benchmark-json="$OUT/benchmarks-engine.json" \
                      --benchmark-columns=median,rounds ;;
      *) echo "unknown step $s"; false ;;
    esac 2>&1 | quiet | tee "$log"
    echo "== $s: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  done
done
echo; echo "== summary"; cat "$OUT/summary.txt"
for s in check split-kv latency latency-compare throughput repeat prefill; do
  [ -f "$OUT/$s.log" ] && grep -E "passed|failed|^process [0-9]|\[flexsgl bench\] [a-z0-9,<=-]+: " "$OUT/$s.log" | tail -6
done
[ -f "$OUT/attention.log" ] && tail -12 "$OUT/attention.log"
[ -f "$OUT/attention-small.log" ] && tail -16 "$OUT/attention-small.log"
[ -f "$OUT/gemv.log" ] && tail -12 "$OUT/gemv.log"
[ -f "$OUT/profile.log" ] && grep -E "gemv_kernel|rope_store|Prefill|Merge|triton_|device time" "$OUT/profile.log"
for f in "$OUT"/benchmarks-*.jsonl; do
  [ -f "$f" ] && python - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    figs = {k: round(v, 1) for k, v in r["extra_info"].items() if isinstance(v, float)}
    print(f'{r["name"]:<50} {r["median_s"] * 1e3:10.3f} ms  {figs}')
PY
done
true  # the steps' own exit codes are in the summary above
