#!/usr/bin/env bash
# The GPU work of one device call. Run from the repository root on a machine staged as
# ../shared/gpu/README.md says (the kernels flexsgl overrides with, unpacked into /tmp/site): it
# installs flexsgl offline, records the machine and its attention backends, then runs the named
# steps in order, each under its own time limit, logs and JSON in $OUT, and prints each step's
# headline lines last. A device call runs at most 600 s: pick steps whose limits (below) sum to
# less, e.g. `check`, `latency throughput`, `prefill suite-kernels`.
#
#   tests          the GPU tests (`pytest -m gpu`): all of them, or what follows `--`
#   check          the batch-1 kernels against float64 and the engine against HF on every backend
#                  (155 tests, ~280 s on a warm machine; not the 8B, flex-kernel and split-KV cases)
#   latency        flexsgl bench latency, Qwen3-8B dummy, batch 1 (--override flags in $OVERRIDES)
#   throughput     flexsgl bench throughput, Qwen3-0.6B dummy, the default workload (--override flags in $OVERRIDES)
#   repeat         the throughput run in five fresh processes, one figure each: one run is good to
#                  ~2% across machines; on a fresh machine the first compiles and may be cut at 110 s
#   startup        flexsgl generate on the Qwen3-8B dummy with flex, then auto: once on an empty compile cache
#                  (TORCHINDUCTOR_CACHE_DIR fresh), once more on the cache that run left; ready and first-token
#                  times and the whole process's wall time
#   prefill        flexsgl bench prefill, Qwen3-8B dummy, 4k and 16k prompts (--override flags in $OVERRIDES)
#   flash-prefill  prefill on FlexAttention's FLASH backend (stage tools/stage_flash.sh first): the engine against HF
#                  with pages of 128 and the bf16 engine tests, then bench prefill of the Qwen3-8B dummy with pages
#                  of 128, auto and flex
#   suite-kernels  benchmarks/ attention kernels and the HF peers (pytest-benchmark)
#   suite-engine   benchmarks/test_engine.py for the backends $SUITE_BACKENDS selects (a -k expression;
#                  default fa3, fi and fa3-prefill,fi-decode). A row with flex prefill spends ~60 s
#                  compiling prefill: run the flex rows on their own, SUITE_BACKENDS=flex (~400 s)
#   profile        tools/profile_step.py: the kernels of a Qwen3-8B batch-1 decode step ($PROFILE_ARGS: other
#                  model and override, e.g. "--model deepseek-v2-lite --override fi-mla --max-total-tokens 65536";
#                  FLEXSGL_PDL=0 for a per-kernel breakdown)
#   gemv           tools/gemv_bench.py --chain-sweep: an 8B's projections from one graph, tiles per projection
#   mla            the MLA GPU tests (flex MLA, fi-mla and triton-mla against float64 and HF, grouped bf16 MoE),
#                  then bench latency of the deepseek-v2-lite dummy at batch 1 and 64, fi-mla, flex and
#                  triton-mla (~560 s)
#   serve          bench serve, Qwen3-0.6B dummy, the throughput workload's requests at 8, 32 and inf requests/s
#                  on one server per backend, auto and flex (~450 s on a cold cache); compare its inf column with
#                  `OVERRIDES="--override auto --override flex" tools/gpu.sh throughput`. Needs fastapi and
#                  uvicorn, which the image lacks: stage them with tools/stage_serve.sh, carry .gpu/serve and
#                  run its install.sh first
#   serve-structured  bench serve, Qwen3-0.6B dummy, auto, all at once: unconstrained, then every output
#                  constrained to a JSON schema (--structured json-schema), one server each (~300 s on a
#                  cold cache); the second's output tok/s over the first's is the cost of structured
#                  outputs. Stage and install .gpu/serve as for serve
#   tp-tests       (2 GPUs) pytest -m gpu tests/test_tensor_parallel.py: TP=2 against TP=1 on a Qwen3-8B-wide
#                  dummy of 4 layers (bf16 logits, greedy tokens; NCCL inside compiled layers and CUDA
#                  graphs) and greedy tokens of the tiny presets (float32)
#   tp-latency     (2 GPUs) bench latency, Qwen3-8B dummy, batch 1, --tp 1 then --tp 2 (TPOT, floor per rank)
#   tp-throughput  (2 GPUs) bench throughput, Qwen3-0.6B dummy, --tp 1 then --tp 2
#   tp-70b         (2 GPUs) bench latency, llama3-70b dummy (141 GB in bf16: 70 GB per rank), --tp 2
#   kernel-matrix  benchmarks/attention_matrix.py for $MATRIX_ARGS (default --pages 64 --gqa 4, ~230 s; the
#                  whole matrix, pages 16/64/128 and GQA 4/8, takes several calls: split it by --pages/--gqa).
#                  FlexAttention's FLASH backend (flash-attn-4): stage it with tools/stage_flash.sh, then e.g.
#                  MATRIX_ARGS="--phases prefill --pages 128 --gqa 4 --backends flex,flex-flash,fa3"
#
# The suite steps stop with SIGINT at their limit; a compile it interrupts fails as
# BackendCompilerFailed ("Attempted to unset ProxyTorchDispatchMode"), which hides the SIGINT. They
# also write each benchmark as it finishes to $OUT/benchmarks-*.jsonl (benchmarks/conftest.py), as
# pytest-benchmark writes its own JSON only at the end.
#
# Usage: FLEXSGL_COMMIT=<commit> bash tools/gpu.sh STEP... [-- PYTEST_ARGS...]
#   (the tree travels without .git, so the reports take the commit from FLEXSGL_COMMIT), e.g.
#   bash tools/gpu.sh tests -- tests/test_triton_decode.py -k "not 8b"
set -uo pipefail
# The CUTLASS DSL's package sits in a folder its .pth file adds to sys.path, and Python reads .pth
# files only in site directories, not on PYTHONPATH: name that folder too (tools/stage_flash.sh).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages:${PYTHONPATH:-}
OUT=${OUT:-/tmp/flexsgl-out}; mkdir -p "$OUT"
steps=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do steps+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#steps[@]} -gt 0 ] || steps=(check)
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python -c "import flashinfer, sgl_kernel; print('flashinfer', flashinfer.__version__, 'sgl_kernel', sgl_kernel.__version__)"
  python -m flexsgl.cli backends
} >"$OUT/machine.txt" 2>&1
# Progress bars redraw with carriage returns: split them off, so the line a bar shares with the
# next message does not take that message with it.
quiet() { tr '\r' '\n' | grep -v -E "capturing|loaded |it/s\]|tok/s\]|^ *$"; }
BENCH=(python -m flexsgl.cli bench)  # the image's python: the console script pip writes there has no torch
suite() {  # NAME, then pytest's arguments
  local name=$1; shift
  FLEXSGL_BENCH_LINES="$OUT/benchmarks-$name.jsonl" timeout -s INT "$LIMIT" python -m pytest -q -p no:cacheprovider \
    "$@" --benchmark-json="$OUT/benchmarks-$name.json" --benchmark-columns=median,rounds
}
declare -A LIMITS=([tests]=580 [flash-prefill]=420 [startup]=420 [check]=420 [latency]=270 [throughput]=300 [repeat]=590 [prefill]=240
                   [suite-kernels]=330 [suite-engine]=570 [profile]=200 [gemv]=240 [kernel-matrix]=560 [mla]=590 [serve]=560 [serve-structured]=560
                   [tp-tests]=200 [tp-latency]=240 [tp-throughput]=200 [tp-70b]=200)
# Short latency runs for the TP steps: one capture size, few repeats (TPOT at batch 1).
TP_LATENCY=(--workload latency --batch-size 1 --input-len 512 --output-len 128 --repeats 2 --cuda-graph-bs 1)
for s in "${steps[@]}"; do
  LIMIT=${LIMITS[$s]:-300}; t0=$SECONDS
  echo "== $s (limit $LIMIT s)"
  case $s in
    tests) timeout "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rs "${@:-tests}" ;;
    check) timeout "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_gemv.py \
             tests/test_rope_store.py tests/test_gpu.py tests/test_gpu_overrides.py \
             -k "gemv or fused or batch_1 or tracks_hf or kernel_matches" ;;
    latency) timeout "$LIMIT" "${BENCH[@]}" --workload latency --model qwen3-8b --repeats 2 ${OVERRIDES:-} \
               --json "$OUT/latency.json" ;;
    throughput) timeout "$LIMIT" "${BENCH[@]}" --workload throughput --model qwen3-0.6b ${OVERRIDES:-} \
                  --json "$OUT/throughput.json" ;;
    repeat) for i in 1 2 3 4 5; do
              timeout 110 "${BENCH[@]}" --workload throughput --model qwen3-0.6b --json "$OUT/repeat-$i.json" 2>&1 \
                | grep -E "^output tok/s" | sed "s/^/process $i: /"
            done ;;
    startup) for ov in flex auto; do
               cache=$(mktemp -d)
               for run in cold warm; do
                 t=$SECONDS
                 TORCHINDUCTOR_CACHE_DIR=$cache timeout 150 python -m flexsgl.cli generate "Return the" --model qwen3-8b \
                   --load-format dummy --max-new-tokens 16 --override "$ov" 2>&1 | grep -E "ready in|first token|tokens in" \
                   | sed "s/^/$ov $run: /"
                 echo "$ov $run: process $((SECONDS - t)) s, exit ${PIPESTATUS[0]}"
               done
             done ;;
    prefill) timeout "$LIMIT" "${BENCH[@]}" --workload prefill --model qwen3-8b --max-num-batched-tokens 16384 ${OVERRIDES:-} \
               --json "$OUT/prefill.json" ;;
    flash-prefill) timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_gpu.py -k "flash_prefill or bf16_engine"
               timeout 200 "${BENCH[@]}" --workload prefill --model qwen3-8b --max-num-batched-tokens 16384 --page-size 128 \
                 --override auto --override flex --json "$OUT/prefill-128.json" ;;
    suite-kernels) suite kernels benchmarks/test_attention_kernels.py benchmarks/test_peers.py ;;
    suite-engine) suite engine benchmarks/test_engine.py -k "${SUITE_BACKENDS:-fa3 or (fi and not decode)}" ;;
    profile) timeout "$LIMIT" python tools/profile_step.py ${PROFILE_ARGS:---model qwen3-8b} --workload latency \
               --profile-steps 20 --profile-at decode:8 --rows 30 ;;
    gemv) timeout "$LIMIT" python tools/gemv_bench.py --chain-sweep ;;
    mla) timeout 320 python -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_mla_attention.py tests/test_moe.py \
           tests/test_triton_mla.py
         for b in 1 64; do
           timeout 130 "${BENCH[@]}" --workload latency --model deepseek-v2-lite --batch-size "$b" --input-len 512 \
             --output-len 64 --repeats 1 --cuda-graph-bs "$b" --max-total-tokens 65536 --override fi-mla --override flex \
             --override triton-mla \
             --json "$OUT/mla-latency-b$b.json"
         done ;;
    serve) timeout "$LIMIT" "${BENCH[@]}" --workload serve --model qwen3-0.6b --request-rate 8,32,inf --override auto \
             --override flex --json "$OUT/serve.json" ;;
    serve-structured) for s in "" json-schema; do
                        timeout $((LIMIT / 2)) "${BENCH[@]}" --workload serve --model qwen3-0.6b --request-rate inf \
                          ${s:+--structured $s} --json "$OUT/serve-structured${s:+-$s}.json"
                      done ;;
    tp-tests) timeout "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_tensor_parallel.py ;;
    tp-latency) for tp in 1 2; do
                  timeout $((LIMIT / 2)) "${BENCH[@]}" "${TP_LATENCY[@]}" --model qwen3-8b --tp "$tp" \
                    --json "$OUT/tp-latency-tp$tp.json"
                done ;;
    tp-throughput) for tp in 1 2; do
                     timeout $((LIMIT / 2)) "${BENCH[@]}" --workload throughput --model qwen3-0.6b --tp "$tp" \
                       --json "$OUT/tp-throughput-tp$tp.json"
                   done ;;
    tp-70b) timeout "$LIMIT" "${BENCH[@]}" "${TP_LATENCY[@]}" --model llama3-70b --load-format dummy --tp 2 \
              --max-total-tokens 65536 --json "$OUT/tp-70b-tp2.json" ;;
    kernel-matrix) timeout "$LIMIT" python benchmarks/attention_matrix.py ${MATRIX_ARGS:---pages 64 --gqa 4} \
                     --json "$OUT/attention-matrix.json" ;;
    *) echo "unknown step $s"; false ;;
  esac 2>&1 | quiet | tee "$OUT/$s.log"
  echo "== $s: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
done
echo; echo "== machine"; cat "$OUT/machine.txt"
echo "== summary"; cat "$OUT/summary.txt"
for s in "${steps[@]}"; do
  log="$OUT/$s.log"
  case $s in
    tests|check|tp-tests) grep -E "passed|failed|error" "$log" | tail -3 ;;
    latency|throughput|repeat|prefill|mla|serve|serve-structured|tp-latency|tp-throughput|tp-70b) grep -E "^process [0-9]|\[flexsgl\] [a-z0-9,<=@./ -]+: (output|TTFT)" "$log" | tail -8 ;;
    flash-prefill) grep -E "passed|failed|error|\[flexsgl\] [a-z0-9,<=@./ -]+: TTFT" "$log" | tail -6 ;;
    startup) grep -E "^(flex|auto) (cold|warm)" "$log" ;;
    profile) grep -E "gemv_kernel|rope_store|Prefill|Merge|triton_|device time|decode floor" "$log" ;;
    gemv) tail -12 "$log" ;;
    kernel-matrix) grep -E "^(decode|prefill) " "$log" ;;
  esac
done
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
