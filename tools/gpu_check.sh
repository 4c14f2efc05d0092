#!/usr/bin/env bash
# On the device machine, from the repo root, after staging (../shared/gpu/README.md): install flexsgl
# offline and run the GPU tests given as arguments (default: all of them). Logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:${PYTHONPATH:-}
OUT=${OUT:-/tmp/flexsgl-out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python -c "import flashinfer, sgl_kernel; print('flashinfer', flashinfer.__version__, 'sgl_kernel', sgl_kernel.__version__)"
} | tee "$OUT/machine.txt"
python -m flexsgl.cli backends | tee "$OUT/backends.txt"
python -m pytest -m gpu -q -p no:cacheprovider -rs "${@:-tests}" 2>&1 | tee "$OUT/gpu_tests.log"
echo "== summary"; cat "$OUT/machine.txt"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
