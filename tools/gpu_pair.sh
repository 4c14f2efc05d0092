#!/usr/bin/env bash
# Two single-GPU runs of tools/gpu.sh at once, one on each GPU of a two-GPU machine: one device call
# does the work of two. Each argument is one run's arguments to gpu.sh, quoted as one word:
#
#   FLEXSGL_COMMIT=<commit> bash tools/gpu_pair.sh "tests -- tests/test_gemv.py" "latency"
#
# flexsgl is installed once (the image's python, offline), then each run has its GPU
# (CUDA_VISIBLE_DEVICES), its log ($OUT/gpu0.txt, $OUT/gpu1.txt) and its packed results ($OUT/gpu0/, $OUT/gpu1/).
# Both runs keep gpu.sh's deadline (CALL_S), so both summaries print before the device call ends.
# A run's word may start with variables for that run alone:
#
#   bash tools/gpu_pair.sh "tests -- tests/test_fp8_kv_cache.py -k 'fp8 or block'" "GEMV_FP8=1 gemv latency"
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: bash tools/gpu_pair.sh 'STEPS FOR GPU 0 [-- ARGS]' 'STEPS FOR GPU 1 [-- ARGS]'"; exit 2; }
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
RESULTS=${OUT:-/tmp/flexsgl-out}; mkdir -p "$RESULTS"
python -m pip install -q --no-deps --no-build-isolation -e . >"$RESULTS/install.log" 2>&1 \
  || { cat "$RESULTS/install.log"; exit 1; }
args=("$1" "$2"); pids=()
for gpu in 0 1; do
  eval "words=(${args[$gpu]})"  # the shell's quoting: -k "fp8 or block" stays one argument
  env=(); while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} =~ ^[A-Z_][A-Z0-9_]*= ]]; do env+=("${words[0]}"); words=("${words[@]:1}"); done
  mkdir -p "$RESULTS/gpu$gpu"
  env "${env[@]}" CUDA_VISIBLE_DEVICES=$gpu FLEXSGL_INSTALLED=1 OUT="$RESULTS/gpu$gpu" \
    bash tools/gpu.sh "${words[@]}" >"$RESULTS/gpu$gpu.txt" 2>&1 &
  pids+=($!)
done
for gpu in 0 1; do wait "${pids[$gpu]}"; done
for gpu in 0 1; do
  echo "==== GPU $gpu: ${args[$gpu]}"
  sed -n '/^== summary/,$p' "$RESULTS/gpu$gpu.txt"
done
