#!/usr/bin/env bash
# Single-GPU runs of tools/gpu.sh at once, one on each GPU of a multi-GPU machine: one device call on
# an x2 does the work of two, on an x4 of four. Each argument is one run's arguments to gpu.sh,
# quoted as one word; the first runs on GPU 0, the second on GPU 1, and so on:
#
#   FLEXSGL_COMMIT=<commit> bash tools/gpu_each.sh "tests -- tests/test_gemv.py" "latency"
#
# flexsgl is installed once (the image's python, offline), then each run has its GPU
# (CUDA_VISIBLE_DEVICES) and a folder, $OUT/gpuN/, of two files: its whole output (log.txt) and its
# packed results (gpu.tgz); four runs fill the 8 files a device call brings back. Every run keeps
# gpu.sh's deadline (CALL_S), so every summary prints before the device call ends.
# A gpu.sh step run in the same device call before these (fi-allreduce-build) writes into $OUT too,
# and its files take some of the 8: give it OUT=/tmp/... of its own.
# A run's word may start with variables for that run alone:
#
#   bash tools/gpu_each.sh "tests -- tests/test_fp8_kv_cache.py -k 'fp8 or block'" "GEMV_FP8=1 gemv latency"
#
# GPU_EACH_SHARED=1 runs them all on GPU 0 at once instead: test runs spend most of their time compiling
# on the host, so on a one-GPU machine runs that share the GPU overlap their compiles. Not for
# benchmarks, which would time each other.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash tools/gpu_each.sh 'STEPS FOR GPU 0 [-- ARGS]' ['STEPS FOR GPU 1' ...]"; exit 2; }
[ $# -le 4 ] || { echo "at most four runs: a device call brings back 8 files, two a run"; exit 2; }
SHARED=${GPU_EACH_SHARED:-}
if [ -z "$SHARED" ] && command -v nvidia-smi >/dev/null; then
  have=$(nvidia-smi -L | grep -c '^GPU')
  [ $# -le "$have" ] || { echo "$# runs asked for, and this machine has $have GPUs"; exit 2; }
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
RESULTS=${OUT:-/tmp/flexsgl-out}; mkdir -p "$RESULTS"
python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/flexsgl-install.log 2>&1 \
  || { cat /tmp/flexsgl-install.log; exit 1; }
python -c "import flashinfer, sgl_kernel" 2>/dev/null \
  || echo "FlashInfer and sgl_kernel do not import here (stage them: ../shared/gpu/README.md): their tests skip"
args=("$@"); pids=()
for gpu in "${!args[@]}"; do
  eval "words=(${args[$gpu]})"  # the shell's quoting: -k "fp8 or block" stays one argument
  env=(); while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} =~ ^[A-Z_][A-Z0-9_]*= ]]; do env+=("${words[0]}"); words=("${words[@]:1}"); done
  mkdir -p "$RESULTS/gpu$gpu"
  env "${env[@]}" CUDA_VISIBLE_DEVICES=$([ -n "$SHARED" ] && echo 0 || echo "$gpu") FLEXSGL_INSTALLED=1 FLEXSGL_LOG_KEPT=1 OUT="$RESULTS/gpu$gpu" \
    bash tools/gpu.sh "${words[@]}" >"$RESULTS/gpu$gpu/log.txt" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for gpu in "${!args[@]}"; do
  echo "==== GPU $gpu: ${args[$gpu]}"
  sed -n '/^== summary/,$p' "$RESULTS/gpu$gpu/log.txt"
done
