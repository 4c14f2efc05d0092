#!/usr/bin/env bash
# The GPU work of one device call. Run from the repository root on a machine staged as
# ../shared/gpu/README.md says (the kernels flexsgl overrides with, unpacked into /tmp/site): it
# installs flexsgl offline, records the machine and its attention backends, then runs the named
# steps in order, each under its own time limit (logs and JSON packed into $OUT/gpu.tgz), and prints
# each step's headline lines last. A device call runs at most 600 s: pick steps whose limits (below) sum to
# less, e.g. `check`, `latency throughput`, `prefill suite-kernels`.
#
#   tests          the GPU tests (`pytest -m gpu`): all of them, or what follows `--`. All of them run past one
#                  call's 600 s: run them in parts, `tests -- tests/test_gemv.py tests/test_rope_store.py
#                  tests/test_triton_decode.py tests/test_latent_query.py tests/test_latent_store.py`, then
#                  `tests -- tests/test_gpu.py tests/test_gpu_overrides.py tests/test_cold_start.py tests/test_gpt_oss.py
#                  tests/test_request_features.py tests/test_structured.py`, with `variants`, `mla`, `fp8` and the TP
#                  steps for the rest. test_structured needs .gpu/serve installed (tools/stage_serve.sh: xgrammar,
#                  jsonschema); test_gpt_oss compares against transformers 5.24, which the image lacks: install
#                  .gpu/transformers first (tools/stage_transformers.sh), or its engine tests skip
#                  On a machine of one GPU, `GPU_EACH_SHARED=1 tools/gpu_each.sh` runs four such parts at once
#                  (an H200 ran 233 of the compile-heavy tests in one call that way, a third of the suite). The
#                  log names each test as it passes (-v), so tools/gpu_tests_left.py lists what a cut run left
#   check          the batch-1 kernels against float64 and the engine against HF on every backend
#                  (155 tests, ~280 s on a warm machine; not the 8B, flex-kernel and split-KV cases)
#   latency        flexsgl bench latency, Qwen3-8B dummy, batch 1 (--override flags in $OVERRIDES)
#   throughput     flexsgl bench throughput, Qwen3-0.6B dummy, the default workload (--override flags in $OVERRIDES)
#   repeat         the throughput run in five fresh processes, one figure each: one run is good to
#                  ~2% across machines; on a fresh machine the first compiles and may be cut at 110 s
#   startup        flexsgl generate on the Qwen3-8B dummy with flex, then auto: once on an empty compile cache
#                  (TORCHINDUCTOR_CACHE_DIR fresh), once more on the cache that run left; ready and first-token
#                  times and the whole process's wall time
#   first-token    the README's command, `python -m flexsgl generate "Return the"` on the embedded model, with
#                  --override auto and flex (uncompiled by default for one prompt of a small model), and flex
#                  with --compile ("flex-compiled"), each on empty caches
#                  (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and FLASHINFER_WORKSPACE_BASE in a fresh folder) and
#                  again on what that run left: time to first token, ready time and the whole process's wall time
#                  in a table; logs in first-token-*.log.
#                  A run of each on throw-away caches writes Python's bytecode first (see PYTHONPYCACHEPREFIX)
#   prefill        flexsgl bench prefill, Qwen3-8B dummy, 4k and 16k prompts (--override flags in $OVERRIDES)
#   flash-prefill  prefill on FlexAttention's FLASH backend (stage tools/stage_flash.sh first): the engine against HF
#                  with pages of 128 and the bf16 engine tests, then bench prefill of the Qwen3-8B dummy with pages
#                  of 128, auto and flex
#   suite-kernels  benchmarks/ attention kernels and the HF peers (pytest-benchmark)
#   suite-engine   benchmarks/test_engine.py for the backends $SUITE_BACKENDS selects (a -k expression;
#                  default fa3, fi and fa3-prefill,fi-decode). A row with flex prefill spends ~60 s
#                  compiling prefill: run the flex rows on their own, SUITE_BACKENDS=flex (~400 s)
#   profile        tools/profile_step.py: the kernels of a Qwen3-8B batch-1 decode step ($PROFILE_ARGS: any of its
#                  options, given last so they win, e.g. "--model deepseek-v2-lite --override fi-mla
#                  --max-total-tokens 65536", or "--model qwen3-0.6b --workload throughput --quantization fp8
#                  --profile-steps 3 --profile-at decode:100"; FLEXSGL_PDL=0 for a per-kernel breakdown)
#   gemv           tools/gemv_bench.py --chain-sweep: an 8B's projections from one graph, tiles per projection;
#                  GEMV_FP8=1 adds --fp8: the kernel on FP8 weights against torch._scaled_mm at one row
#   mla            the MLA GPU tests (flex MLA, fi-mla and triton-mla against float64 and HF, grouped bf16 MoE),
#                  then bench latency of the deepseek-v2-lite dummy at batch 1 and 64, fi-mla, flex and
#                  triton-mla (~560 s)
#   serve          bench serve, Qwen3-0.6B dummy, the throughput workload's requests at 8, 32 and inf requests/s
#                  on one server per backend, auto and flex (~450 s on a cold cache); compare its inf column with
#                  `OVERRIDES="--override auto --override flex" tools/gpu.sh throughput`. Needs fastapi and
#                  uvicorn, which the image lacks: stage them with tools/stage_serve.sh, carry .gpu/serve and
#                  run its install.sh first
#   fi-allreduce-build  start building FlashInfer's all-reduce kernels in the background (minutes), for the
#                  TP steps to find built: run it in the call that finishes staging
#   tp-tests       (2 or 4 GPUs) the TP GPU tests but the exit ones: TP=2 (and TP=4) against TP=1 on a Qwen3-8B-wide
#                  dummy (bf16, compiled steps, CUDA graphs), every GQA override and MLA under TP=2, the
#                  symmetric-memory all-reduce against NCCL, the tiny presets' greedy tokens (18 tests, ~700 s on a
#                  cold compile cache: run them in parts, $TP_TESTS_K a pytest -k expression, e.g. "tiny" then
#                  "not tiny and not exit and not server_stop"; names as the ids spell them, "gpt-oss")
#   tp-exit        (2 GPUs) the TP exit tests: with NCCL, compiled steps and CUDA graphs, every exit path (normal
#                  end, shutdown(), a killed rank, Ctrl-C, SIGTERM to rank 0, `flexsgl generate --tp 2`, the
#                  server's stop) ends every process within 60 s (~250-400 s)
#   tp-allreduce   tools/allreduce_bench.py: us per all-reduce, NCCL against one-shot/two-shot over symmetric memory
#                  and (FlashInfer staged) FlashInfer's TensorRT-LLM all-reduce, alone and fused with residual +
#                  RMSNorm, 8 KB to 4 MB, on every GPU of the host (~40 s)
#   tp-memory      tools/tp_memory.py: llama3-70b dummy at TP=2 (and 4 where there are 4 GPUs), each rank's part
#                  against the allocator's peak while loading, then the engine at the largest TP and each GPU's
#                  memory in use (~200-300 s)
#   tp-bench       bench at TP=1, 2 (and 4 where there are 4 GPUs), Qwen3-8B dummy: batch-1 latency (TPOT, floor
#                  per rank), TTFT of a 4k prompt, the default throughput workload; then llama3-70b dummy latency
#                  at TP=2 (GPUs of 100+ GB) and 4; a table of them all last. $TP_BENCH picks parts (default
#                  "latency prefill throughput 70b"; ~900 s for all on 2 GPUs: split it over two calls, e.g.
#                  TP_BENCH="latency prefill" then TP_BENCH="throughput 70b"). It first waits for a FlashInfer
#                  all-reduce build under way, up to a third of its limit
#   Every TP command runs in a session of its own under a wall-clock limit; at the limit the session gets
#   SIGABRT (PYTHONFAULTHANDLER=1: each Python process prints its stacks), so a hang shows where it hangs.
#   base-compare   the throughput and latency steps' runs for a baseline tree in $BASE (a checkout of an earlier
#                  commit carried beside this one, e.g. .gpu/base) and for this tree, alternately, in one call
#   variants       the attention-variant GPU tests: every variant in bf16 with pages of 16 and 64 (decode in a CUDA
#                  graph), FA3's window/softcap/sinks, engines with per-layer variants graphed against eager, Mistral
#                  and Gemma 2 and 3 engines against HF, and with flash-attn-4 staged each variant's prefill on the
#                  FLASH backend (98 tests, ~700 s on a cold compile cache: run them in parts, $VARIANTS_K a pytest
#                  -k expression, "flash" then "not flash")
#   mistral        bench latency of the mistral-7b dummy (a 4,096-key window on every layer), flex, batch 1 and 32
#                  at 4k and 32k tokens of context: decode TPOT at 32k against 4k
#   window-kernels benchmarks/attention_matrix.py --window 4096: flex's windowed decode and prefill beside FA3's
#                  window_size, pages of 64, GQA 4, decode at batch 1 and 32 with 4k and 32k contexts
#                  ($WINDOW_BACKENDS: others, e.g. flex,flex-flash,fa3 with flash-attn-4 staged: flex-flash is
#                  the window's prefill on FlexAttention's FLASH backend)
#   variant-cost   a user's variant (alibi, a score_mod; and a mask_mod with a window) against plain causal
#                  attention: bench throughput of the Qwen3-0.6B dummy, flex
#   families       bench throughput of the gemma-2-9b dummy (softcap and windows), flex and fa3; bench latency of
#                  the gpt-oss-20b dummy (sinks, windows, MoE) at batch 1 with its floor, flex and fa3
#   serve-structured  bench serve, Qwen3-0.6B dummy, auto, all at once: unconstrained, then every output
#                  constrained to a JSON schema (--structured json-schema), one server each (~300 s on a
#                  cold cache); the second's output tok/s over the first's is the cost of structured
#                  outputs. Stage and install .gpu/serve as for serve
#   fp8            the FP8 GPU tests (Fp8Linear, FP8 checkpoints, online fp8, the FP8 KV cache compiled and
#                  graphed), then bench throughput of the Qwen3-0.6B dummy with flex: bf16, FP8 weights
#                  (--quantization fp8), FP8 KV (--kv-cache-dtype fp8_e4m3); and bench latency of the Qwen3-8B
#                  dummy at batch 1, bf16 and --quantization fp8, with their floors (~500 s on a cold cache)
#   fp8-bench      the fp8 step's benchmarks alone (~400 s on a cold cache, FP8 KV under flex compiling longest)
#   fp8-tests      every FP8 GPU test in one run: Fp8Linear per row and per block, the decode-batch FP8 kernel,
#                  FP8 and block-wise checkpoints, online fp8, the matrix-vector kernel on FP8 weights, FP8
#                  experts (grouped, one-token, block), the FP8 KV cache under flex and each override
#   fp8-kv         the FP8 KV cache under each override (kernels against float64, engines against HF), then
#                  bench throughput of the Qwen3-0.6B dummy with auto's SM90 backends named, bf16 and
#                  --kv-cache-dtype fp8_e4m3
#   fp8-moe        the FP8 expert GPU tests (torch._scaled_grouped_mm, the one-token MoE layer, an FP8 Qwen3-MoE
#                  checkpoint), then bench latency at batch 1 and throughput of the deepseek-v2-lite dummy, bf16
#                  and --quantization fp8 (~500 s on a cold cache)
#   fp8-gemm       tools/fp8_gemm_bench.py on the qwen3-8b projections ($FP8_GEMM_MODEL: another preset's):
#                  which FP8 product is fastest per M
#   fp8-agreement  tools/fp8_agreement.py, 256 prompts, --quantization fp8 against bf16 on the qwen3-8b and
#                  deepseek-v2-lite dummies ($FP8_AGREEMENT_MODELS: those named)
#   kernel-matrix  benchmarks/attention_matrix.py for $MATRIX_ARGS (default --pages 64 --gqa 4, ~230 s; the
#                  whole matrix, pages 16/64/128 and GQA 4/8, takes several calls: split it by --pages/--gqa).
#                  FlexAttention's FLASH backend (flash-attn-4): stage it with tools/stage_flash.sh, then e.g.
#                  MATRIX_ARGS="--phases prefill --pages 128 --gqa 4 --backends flex,flex-flash,fa3"
#
# The test steps stop with SIGINT at their limit, so that pytest prints what failed so far (the TP
# steps with SIGABRT, for every process's stacks); each failure is also written as it happens to
# $OUT/STEP.failures.txt. The suite steps stop with SIGINT too; a compile it interrupts fails as
# BackendCompilerFailed ("Attempted to unset ProxyTorchDispatchMode"), which hides the SIGINT. They
# also write each benchmark as it finishes to $OUT/benchmarks-*.jsonl (benchmarks/conftest.py), as
# pytest-benchmark writes its own JSON only at the end.
#
# Usage: FLEXSGL_COMMIT=<commit> bash tools/gpu.sh STEP... [-- PYTEST_ARGS...]
#   (on a multi-GPU machine, tools/gpu_each.sh runs one such list on each GPU at once)
#   (the tree travels without .git, so the reports take the commit from FLEXSGL_COMMIT), e.g.
#   bash tools/gpu.sh tests -- tests/test_triton_decode.py -k "not 8b"
set -uo pipefail
case "${1:-}" in -h|--help)  # the header above is the help
  sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
# The CUTLASS DSL's package sits in a folder its .pth file adds to sys.path, and Python reads .pth
# files only in site directories, not on PYTHONPATH: name that folder too (tools/stage_flash.sh).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages:${PYTHONPATH:-}
# The image's packages carry no bytecode, and a process that imports torch, torch._dynamo and
# transformers from source spends ~9 s compiling it (a cProfile of `generate` on an H200 host). A pip
# install writes bytecode; here it goes to a folder of its own, filled by the first process.
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/flexsgl-pycache}
# The steps write their logs and JSON into a folder of their own; what comes back from a device call is at
# most 8 files, so $OUT receives them packed (gpu.tgz) beside the summary, after each step. A caller that
# keeps this script's whole output beside gpu.tgz (FLEXSGL_LOG_KEPT=1: tools/gpu_each.sh) gets no summary copy.
RESULTS=${OUT:-/tmp/flexsgl-out}; OUT=$(mktemp -d); mkdir -p "$RESULTS"
pack() {
  tar czf "$RESULTS/gpu.tgz" -C "$OUT" . && [ -z "${FLEXSGL_LOG_KEPT:-}" ] && cp "$OUT/summary.txt" "$RESULTS/" 2>/dev/null
  true
}
steps=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do steps+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#steps[@]} -gt 0 ] || steps=(check)
# FLEXSGL_INSTALLED=1: installed already, as when two runs share one machine (one GPU each, CUDA_VISIBLE_DEVICES)
[ -n "${FLEXSGL_INSTALLED:-}" ] || python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python -c "import flashinfer, sgl_kernel; print('flashinfer', flashinfer.__version__, 'sgl_kernel', sgl_kernel.__version__)"
  python -m flexsgl.cli backends
} >"$OUT/machine.txt" 2>&1
# Progress bars redraw with carriage returns: split them off, so the line a bar shares with the
# next message does not take that message with it.
# Line-buffered throughout: a step cut at its limit (or the device call's) keeps every line it printed.
LINES_NOW=$(command -v stdbuf >/dev/null && echo "stdbuf -oL")
quiet() { $LINES_NOW tr '\r' '\n' | grep --line-buffered -v -E "capturing|loaded |it/s\]|tok/s\]|^ *$"; }
SM90_AUTO="fa3-prefill,fi-decode,triton-decode<=64"
BENCH=(python -m flexsgl.cli bench)  # the image's python: the console script pip writes there has no torch
suite() {  # NAME, then pytest's arguments
  local name=$1; shift
  FLEXSGL_BENCH_LINES="$OUT/benchmarks-$name.jsonl" timeout -s INT "$LIMIT" python -m pytest -q -p no:cacheprovider \
    "$@" --benchmark-json="$OUT/benchmarks-$name.json" --benchmark-columns=median,rounds
}
declare -A LIMITS=([tests]=580 [flash-prefill]=420 [startup]=420 [first-token]=420 [check]=420 [latency]=270 [throughput]=300 [repeat]=590 [prefill]=240
                   [suite-kernels]=330 [suite-engine]=570 [profile]=200 [gemv]=240 [kernel-matrix]=560 [mla]=590 [serve]=560
                   [tp-tests]=580 [tp-exit]=580 [tp-allreduce]=200 [tp-memory]=500 [tp-bench]=590
                   [base-compare]=560 [variants]=580 [mistral]=420 [window-kernels]=300 [variant-cost]=420 [families]=480
                   [serve-structured]=560 [fp8]=590 [fp8-kv]=580 [fp8-moe]=590 [fp8-agreement]=590 [fp8-gemm]=400
                   [fp8-tests]=560 [fp8-bench]=560)
# Short latency runs for the TP steps: one capture size, few repeats (TPOT at batch 1).
TP_LATENCY=(--workload latency --batch-size 1 --input-len 512 --output-len 128 --repeats 2 --cuda-graph-bs 1)
GPUS=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
GPU_GB=$(python -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)" 2>/dev/null || echo 0)
TP_SIZES="1 2"; [ "$GPUS" -ge 4 ] && TP_SIZES="1 2 4"
# guard SECONDS CMD...: CMD in a session of its own; at the limit SIGABRT to all of it (Python stacks with
# PYTHONFAULTHANDLER=1), SIGKILL 20 s later.
guard() { local limit=$1; shift; PYTHONFAULTHANDLER=1 setsid -w timeout -s ABRT -k 20 "$limit" "$@"; }
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
# FlashInfer compiles its all-reduce kernels on first use (minutes: over 5 on 32 cores), and `auto` takes its
# all-reduce only once they are built. The build runs in the background, never in a step's time: start it
# with the step `fi-allreduce-build` as soon as FlashInfer is staged (its log: /tmp/fi-allreduce-build.log);
# a TP step starts it where it has not started, and runs without FlashInfer's all-reduce until it is done.
fi_allreduce_build() {
  python -c "import flashinfer.comm" 2>/dev/null || { echo "FlashInfer is not staged: no all-reduce build"; return 0; }
  if python -c "from flexsgl.distributed.nvlink_allreduce import flashinfer_comm_built as b; exit(0 if b() else 1)"; then
    echo "FlashInfer's all-reduce kernels: built"
  elif [ -f /tmp/fi-allreduce-build.log ]; then
    echo "FlashInfer's all-reduce kernels: building since $(stat -c %y /tmp/fi-allreduce-build.log | cut -c12-19)"
  else
    setsid nohup python -c "from flashinfer.comm.trtllm_ar import get_trtllm_comm_module as g; g()" \
      >/tmp/fi-allreduce-build.log 2>&1 < /dev/null &
    echo "FlashInfer's all-reduce kernels: build started in the background"
  fi
}
# A TP bench waits for a build under way, up to $1 s, so that its figures are those of the all-reduce `auto` picks.
fi_allreduce_wait() {
  local until=$((SECONDS + $1))
  while pgrep -f get_trtllm_comm_module >/dev/null && [ $SECONDS -lt $until ]; do sleep 5; done
  pgrep -f get_trtllm_comm_module >/dev/null \
    && echo "FlashInfer's all-reduce kernels: still building after $1 s; this bench runs without them"
}
printf '%s\n' "${steps[@]}" | grep -q '^tp-' && fi_allreduce_build
# A device call runs at most 600 s: each step's limit is cut to the time left before $CALL_S (default 580 s from
# this script's start), so the summary always prints; a step with under a minute left is skipped.
CALL_S=${CALL_S:-580}
for s in "${steps[@]}"; do
  LIMIT=${LIMITS[$s]:-300}; t0=$SECONDS; left=$((CALL_S - SECONDS - 10))
  if [ "$left" -lt 60 ]; then echo "== $s: skipped, $left s left of the call" | tee -a "$OUT/summary.txt"; continue; fi
  [ "$LIMIT" -gt "$left" ] && LIMIT=$left
  export FLEXSGL_FAILURES_FILE="$OUT/$s.failures.txt"  # each test failure as it happens (tests/conftest.py)
  echo "== $s (limit $LIMIT s)"
  case $s in
    fi-allreduce-build) fi_allreduce_build ;;
    tests) timeout -s INT -k 30 "$LIMIT" python -m pytest -m gpu -v -p no:cacheprovider -rfs "${@:-tests}" ;;
    fp8|fp8-bench) [ "$s" = fp8 ] && timeout -s INT -k 30 200 python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_fp8_gpu.py \
                     tests/test_fp8_gemm.py tests/test_fp8_kv_cache.py
         for q in "" "--quantization fp8" "--kv-cache-dtype fp8_e4m3"; do
           run="fp8-throughput${q//[ -]/_}"
           timeout 160 "${BENCH[@]}" --workload throughput --model qwen3-0.6b --override flex $q \
             --json "$OUT/$run.json" >"$OUT/$run.log" 2>&1 || echo "throughput ${q:-bf16}: exit $? (124: cut at 160 s; $run.log)"
           grep -E "^output tok/s" "$OUT/$run.log" | sed "s|^|throughput ${q:-bf16}: |"
         done
         for q in "" "--quantization fp8"; do
           timeout 100 "${BENCH[@]}" --workload latency --model qwen3-8b --repeats 2 $q \
             --json "$OUT/fp8-latency${q//[ -]/_}.json" 2>&1 | grep -E "TPOT" | sed "s|^|latency ${q:-bf16}: |"
         done ;;
    fp8-tests) timeout -s INT -k 30 "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_fp8_gpu.py \
                 tests/test_fp8_gemm.py tests/test_fp8_kv_cache.py tests/test_moe.py tests/test_gemv.py \
                 tests/test_gpu_overrides.py tests/test_triton_decode.py tests/test_block_fp8_experts.py \
                 -k "fp8 or FP8 or block or overrides_read" ;;
    fp8-kv) timeout -s INT -k 30 300 python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_gpu_overrides.py \
              tests/test_triton_decode.py tests/test_fp8_kv_cache.py -k "fp8 or overrides_read"
         for q in "" "--kv-cache-dtype fp8_e4m3"; do  # auto's SM90 backends, named (auto takes flex for FP8)
           timeout 120 "${BENCH[@]}" --workload throughput --model qwen3-0.6b --override "$SM90_AUTO" $q \
             --json "$OUT/fp8-kv-throughput${q//[ -]/_}.json" 2>&1 | grep -E "^output tok/s" | sed "s|^|throughput ${q:-bf16}: |"
         done ;;
    fp8-moe) timeout -s INT -k 30 150 python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_moe.py tests/test_fp8_gpu.py \
               -k "fp8 or FP8"
         for q in "" "--quantization fp8"; do
           timeout 100 "${BENCH[@]}" --workload latency --model deepseek-v2-lite --repeats 2 $q \
             --json "$OUT/fp8-moe-latency${q//[ -]/_}.json" 2>&1 | grep -E "TPOT" | sed "s|^|latency ${q:-bf16}: |"
           timeout 100 "${BENCH[@]}" --workload throughput --model deepseek-v2-lite $q \
             --json "$OUT/fp8-moe-throughput${q//[ -]/_}.json" 2>&1 | grep -E "^output tok/s" | sed "s|^|throughput ${q:-bf16}: |"
         done ;;
    fp8-gemm) timeout "$LIMIT" python tools/fp8_gemm_bench.py --model "${FP8_GEMM_MODEL:-qwen3-8b}" ;;
    fp8-agreement) for m in ${FP8_AGREEMENT_MODELS:-qwen3-8b deepseek-v2-lite}; do
           timeout 280 python tools/fp8_agreement.py --model $m --load-format dummy --quantization fp8 --prompts 256 \
             --json "$OUT/fp8-agreement-$m.json" 2>&1 | tail -3 | sed "s|^|agreement $m: |"
         done ;;
    check) timeout -s INT -k 30 "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_gemv.py \
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
    first-token) table="$OUT/first-token.txt"
                 # bytecode as a pip install leaves it (see PYTHONPYCACHEPREFIX above), compile caches apart
                 for ov in flex auto; do
                   warm=$(mktemp -d)
                   TORCHINDUCTOR_CACHE_DIR=$warm/inductor TRITON_CACHE_DIR=$warm/triton FLASHINFER_WORKSPACE_BASE=$warm \
                     timeout 100 python -m flexsgl generate "Return the" --override "$ov" >/dev/null 2>&1
                 done
                 printf "%-8s %-5s %14s %8s %10s  %s\n" override cache "first token s" "ready s" "process s" \
                   "attention (exit code)" >"$table"
                 for ov in auto flex flex-compiled; do  # flex-compiled: flex with --compile
                   caches=$(mktemp -d)
                   args=(--override "${ov%-compiled}"); [ "$ov" = flex-compiled ] && args+=(--compile)
                   for run in cold warm; do
                     log="$OUT/first-token-$ov-$run.log"; t=$(date +%s.%N)
                     TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton \
                       FLASHINFER_WORKSPACE_BASE=$caches timeout 100 python -m flexsgl generate "Return the" \
                       "${args[@]}" >"$log" 2>&1
                     rc=$?; wall=$(python -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t" "$(date +%s.%N)")
                     first=$(sed -n 's/.*first token \([0-9.]*\)s after start.*/\1/p' "$log")
                     ready=$(sed -n 's/.*ready in \([0-9.]*\)s .*/\1/p' "$log")
                     attention=$(sed -n 's/^\[flexsgl\] attention: //p' "$log")
                     grep -E "KV cache|attention|auto took|captured|compiled|ready in|first token|tokens in|error" "$log" \
                       | sed "s/^/$ov $run: /"
                     printf "%-8s %-5s %14s %8s %10s  %s\n" "$ov" "$run" "${first:--}" "${ready:--}" "$wall" \
                       "${attention:--} ($rc)" >>"$table"
                   done
                 done
                 cat "$table" ;;
    prefill) timeout "$LIMIT" "${BENCH[@]}" --workload prefill --model qwen3-8b --max-num-batched-tokens 16384 ${OVERRIDES:-} \
               --json "$OUT/prefill.json" ;;
    flash-prefill) timeout -s INT -k 30 200 python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_gpu.py -k "flash_prefill or bf16_engine"
               timeout 200 "${BENCH[@]}" --workload prefill --model qwen3-8b --max-num-batched-tokens 16384 --page-size 128 \
                 --override auto --override flex --json "$OUT/prefill-128.json" ;;
    suite-kernels) suite kernels benchmarks/test_attention_kernels.py benchmarks/test_peers.py ;;
    suite-engine) suite engine benchmarks/test_engine.py -k "${SUITE_BACKENDS:-fa3 or (fi and not decode)}" ;;
    profile) timeout "$LIMIT" python tools/profile_step.py --model qwen3-8b --workload latency \
               --profile-steps 20 --profile-at decode:8 --rows 30 ${PROFILE_ARGS:-} ;;  # the last of an option wins
    gemv) timeout "$LIMIT" python tools/gemv_bench.py --chain-sweep ${GEMV_FP8:+--fp8} ;;
    mla) timeout -s INT -k 30 320 python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_mla_attention.py tests/test_moe.py \
           tests/test_triton_mla.py
         for b in 1 64; do
           timeout 130 "${BENCH[@]}" --workload latency --model deepseek-v2-lite --batch-size "$b" --input-len 512 \
             --output-len 64 --repeats 1 --cuda-graph-bs "$b" --max-total-tokens 65536 --override fi-mla --override flex \
             --override triton-mla \
             --json "$OUT/mla-latency-b$b.json"
         done ;;
    serve) timeout "$LIMIT" "${BENCH[@]}" --workload serve --model qwen3-0.6b --request-rate 8,32,inf --override auto \
             --override flex --json "$OUT/serve.json" ;;
    tp-tests) guard "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_tensor_parallel.py \
                -k "${TP_TESTS_K:-not exit and not server_stop}" ;;
    tp-exit) guard "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_tensor_parallel.py \
               -k "exit or server_stop" ;;
    tp-allreduce) guard "$LIMIT" python tools/allreduce_bench.py ;;
    tp-memory) sizes=$([ "$GPUS" -ge 4 ] && echo 2,4 || echo 2)
               guard "$LIMIT" python tools/tp_memory.py --model llama3-70b --tp "$sizes" ;;
    tp-bench) fi_allreduce_wait $((LIMIT / 3))
              for part in ${TP_BENCH:-latency prefill throughput 70b}; do
                case $part in
                  latency) for tp in $TP_SIZES; do
                             guard 150 "${BENCH[@]}" "${TP_LATENCY[@]}" --model qwen3-8b --tp "$tp" \
                               --json "$OUT/tp-bench-latency-tp$tp.json"
                           done ;;
                  prefill) for tp in $TP_SIZES; do
                             guard 150 "${BENCH[@]}" --workload prefill --model qwen3-8b --input-len 4096 --repeats 3 \
                               --tp "$tp" --json "$OUT/tp-bench-prefill-tp$tp.json"
                           done ;;
                  throughput) for tp in $TP_SIZES; do
                                guard 300 "${BENCH[@]}" --workload throughput --model qwen3-8b --tp "$tp" \
                                  --json "$OUT/tp-bench-throughput-tp$tp.json"
                              done ;;
                  70b) for tp in 2 4; do
                         [ "$tp" -le "$GPUS" ] || continue
                         [ "$tp" -eq 2 ] && [ "$GPU_GB" -lt 100 ] && { echo "70b at TP=2 needs GPUs of 100+ GB"; continue; }
                         guard 300 "${BENCH[@]}" "${TP_LATENCY[@]}" --model llama3-70b --tp "$tp" \
                           --max-total-tokens 65536 --json "$OUT/tp-bench-70b-tp$tp.json"
                       done ;;
                esac
              done
              python tools/tp_bench_table.py "$OUT" ;;
    base-compare) for run in throughput latency; do
                    for tree in "$BASE" .; do
                      args=(--workload throughput --model qwen3-0.6b)
                      [ $run = latency ] && args=(--workload latency --model qwen3-8b --repeats 2)
                      (cd "$tree" && timeout 130 python -m flexsgl.cli bench "${args[@]}" --json "$OUT/base-compare-$run-${tree//[\/.]/_}.json") \
                        | grep -E "output tok/s|TPOT|^  *auto" | sed "s|^|$run ${tree}: |"
                    done
                  done ;;
    variants) timeout -s INT -k 30 "$LIMIT" python -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_attention_variants_gpu.py \
                -k "${VARIANTS_K:-}" ;;
    mistral) for b in 1 32; do
               for ctx in 4096 32000; do
                 timeout $((ctx > 4096 ? 120 : 80)) "${BENCH[@]}" --workload latency --model mistral-7b --batch-size "$b" \
                   --input-len "$ctx" --output-len 64 --repeats 1 --cuda-graph-bs "$b" --override flex \
                   --json "$OUT/mistral-b$b-$ctx.json"
               done
             done ;;
    window-kernels) timeout "$LIMIT" python benchmarks/attention_matrix.py --window 4096 --pages 64 --gqa 4 \
                      --batches 1,32 --contexts 4096,32768 --backends "${WINDOW_BACKENDS:-flex,fa3}" \
                      --json "$OUT/window-kernels.json" ;;
    variant-cost) for att in none alibi "tests.test_attention_variants:user_local_window"; do
                    flag=(); [ "$att" = none ] || flag=(--attention "$att")
                    timeout 130 "${BENCH[@]}" --workload throughput --model qwen3-0.6b --override flex "${flag[@]}" \
                      --json "$OUT/variant-throughput-${att##*:}.json"
                  done ;;
    families) timeout 250 "${BENCH[@]}" --workload throughput --model gemma-2-9b --override flex --override fa3 \
                --json "$OUT/gemma2-throughput.json"
              timeout 220 "${BENCH[@]}" --workload latency --model gpt-oss-20b --repeats 2 --override flex \
                --override fa3 --json "$OUT/gpt-oss-latency.json" ;;
    serve-structured) for s in "" json-schema; do
                        timeout $((LIMIT / 2)) "${BENCH[@]}" --workload serve --model qwen3-0.6b --request-rate inf \
                          ${s:+--structured $s} --json "$OUT/serve-structured${s:+-$s}.json"
                      done ;;
    kernel-matrix) timeout "$LIMIT" python benchmarks/attention_matrix.py ${MATRIX_ARGS:---pages 64 --gqa 4} \
                     --json "$OUT/attention-matrix.json" ;;
    *) echo "unknown step $s"; false ;;
  esac 2>&1 | quiet | tee "$OUT/$s.log"
  echo "== $s: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  pack
done
echo; echo "== machine"; cat "$OUT/machine.txt"
echo "== summary"; cat "$OUT/summary.txt"
for s in "${steps[@]}"; do
  log="$OUT/$s.log"
  case $s in
    tests|check|tp-tests|tp-exit|fp8-tests|variants) grep -E "^FAILED" "$log" | cut -c1-300 | head -20
                                  grep -E "passed|failed|error" "$log" | tail -3
                                  # a run cut at its limit prints no summary: its failures as they came
                                  grep -E "^====|^E " "$OUT/$s.failures.txt" 2>/dev/null | cut -c1-300 | head -30 ;;
    tp-allreduce|tp-memory) grep -E "^ *[0-9]+ |^(all-reduce|loading|engine|rank|gpu| +KB)" "$log" | tail -24 ;;
    tp-bench) sed -n '/^TP bench/,$p' "$log" ;;
    fp8|fp8-bench|fp8-kv|fp8-moe|fp8-agreement) grep -E "^FAILED|passed|failed|^(throughput|latency|agreement) " "$log" ;;
    fp8-gemm) tail -30 "$log" ;;
    latency|throughput|repeat|prefill|mla|serve|serve-structured) grep -E "^process [0-9]|\[flexsgl\] [a-z0-9,<=@./ -]+: (output|TTFT)" "$log" | tail -8 ;;
    flash-prefill) grep -E "passed|failed|error|\[flexsgl\] [a-z0-9,<=@./ -]+: TTFT" "$log" | tail -6 ;;
    startup) grep -E "^(flex|auto) (cold|warm)" "$log" ;;
    first-token) cat "$OUT/first-token.txt" ;;
    profile) grep -E "gemv_kernel|rope_store|Prefill|Merge|triton_|device time|decode floor" "$log" ;;
    gemv) if [ -n "${GEMV_FP8:-}" ]; then tail -25 "$log"; else tail -12 "$log"; fi ;;
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
