#!/usr/bin/env bash
# On the device machine, from the repo root: install flexsgl offline, run the GPU tests and a decode
# timing. Logs go to $OUT; a short summary is printed last.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flexsgl-out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; } | tee "$OUT/machine.txt"
python -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log"
PYTHONPATH=. python tools/decode_timing.py --model qwen3-0.6b --batch 1 64 2>&1 | tee "$OUT/timing.log"
echo "== summary"; cat "$OUT/machine.txt"; tail -1 "$OUT/gpu_tests.log"; tail -3 "$OUT/timing.log"
