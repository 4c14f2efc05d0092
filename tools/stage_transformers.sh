#!/usr/bin/env bash
# Stage HF transformers at this machine's version (the CPU tests' reference) for the device machine, whose
# image holds an older one (5.17, where GptOssMLP computes otherwise on the same weights: tests/test_gpt_oss.py
# skips there). Wheels for its Python 3.12 in .gpu/transformers (git-ignored), with an install.sh that installs
# them offline over the image's; numpy stays the image's. Carry .gpu/transformers with a device call that runs
# `bash .gpu/transformers/install.sh`; every later GPU test in that machine's life compares against it.
set -euo pipefail
case "${1:-}" in -h|--help)  # the header above is the help
  sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(git rev-parse --show-toplevel)"
gitdir=$(git rev-parse --git-dir); mkdir -p "$gitdir/info"
grep -qxF '/.gpu/' "$gitdir/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$gitdir/info/exclude"
version=$(python3 -c "import transformers; print(transformers.__version__)")
rm -rf .gpu/transformers; mkdir -p .gpu/transformers
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d .gpu/transformers "transformers==$version"
rm -f .gpu/transformers/numpy-*.whl
cat > .gpu/transformers/install.sh <<SH
#!/usr/bin/env bash
# Install transformers $version from the wheels beside this script, offline, over the image's.
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
python -m pip install -q --no-index --find-links "\$here" "transformers==$version" &&
  python -c "import transformers; print('transformers', transformers.__version__)"
SH
du -sh .gpu/transformers
