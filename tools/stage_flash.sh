#!/usr/bin/env bash
# Stage flash-attn-4 and the CUTLASS DSL (FlexAttention's FLASH backend, `kernel_options={"BACKEND":
# "FLASH"}`) for the device machine, which has no registry: wheels for its Python 3.12 and CUDA 13,
# split into .gpu/flash0 and .gpu/flash1 (git-ignored), each under what one device call carries.
# Carry them one per call, each running `bash .gpu/flashK/install.sh`; the second installs into
# /tmp/site and prints the versions. gpu.sh puts /tmp/site on PYTHONPATH, and the folder the CUTLASS
# DSL's .pth file would add (Python reads .pth files only in site directories).
# Pins: from 4.6 on, the CUTLASS DSL wheels this workplace's pip holds carry its MLIR bindings but no
# `cutlass.cute` package; 4.5.3's base wheel carries the whole DSL. flash-attn-4 4.0.0b19 and
# quack-kernels 0.5.0 are the newest releases that accept it.
set -euo pipefail
case "${1:-}" in -h|--help)  # the header above is the help
  sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(git rev-parse --show-toplevel)"
gitdir=$(git rev-parse --git-dir); mkdir -p "$gitdir/info"
grep -qxF '/.gpu/' "$gitdir/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$gitdir/info/exclude"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --pre --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d "$work/wheels" flash-attn-4==4.0.0b19 nvidia-cutlass-dsl==4.5.3 nvidia-cutlass-dsl-libs-base==4.5.3 \
  quack-kernels==0.5.0 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops
tar -C "$work/wheels" -cf - . | split -b 48m -d -a 1 - "$work/part."
rm -rf .gpu/flash0 .gpu/flash1
for k in 0 1; do
  mkdir -p ".gpu/flash$k"; mv "$work/part.$k" ".gpu/flash$k/"
  cat > ".gpu/flash$k/install.sh" <<'SH'
#!/usr/bin/env bash
# Keep this part in /tmp/flash-parts; once both are there, unpack the wheels into /tmp/site, offline.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p /tmp/flash-parts && cp "$here"/part.* /tmp/flash-parts/
[ -f /tmp/flash-parts/part.0 ] && [ -f /tmp/flash-parts/part.1 ] || { echo "staged $(ls /tmp/flash-parts | wc -l) of 2 parts"; exit 0; }
mkdir -p /tmp/flash-wheels && cat /tmp/flash-parts/part.0 /tmp/flash-parts/part.1 | tar -C /tmp/flash-wheels -xf - &&
  python -m pip install -q --no-deps --no-index --target /tmp/site /tmp/flash-wheels/*.whl &&
  PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages python -c "import flash_attn.cute, cutlass; from importlib.metadata import version as v; print('flash-attn-4', v('flash-attn-4'), '| nvidia-cutlass-dsl', v('nvidia-cutlass-dsl'))"
SH
done
[ -z "$(ls "$work"/part.* 2>/dev/null)" ] || { echo "the wheels no longer fit two parts" >&2; exit 1; }
du -sh .gpu/flash0 .gpu/flash1
