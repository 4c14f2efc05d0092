#!/usr/bin/env bash
# Stage fastapi, uvicorn, uvloop, httptools and xgrammar (what `flexsgl serve` needs beyond the GPU image), and jsonschema
# (what the serving and structured-output tests check outputs with) for the device machine,
# which has no package registry: wheels for its Python 3.12 in .gpu/serve (git-ignored), with an
# install.sh. Carry it with a device call that runs `bash .gpu/serve/install.sh` before `tools/gpu.sh serve`.
set -euo pipefail
case "${1:-}" in -h|--help)  # the header above is the help
  sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(git rev-parse --show-toplevel)"
gitdir=$(git rev-parse --git-dir); mkdir -p "$gitdir/info"
grep -qxF '/.gpu/' "$gitdir/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$gitdir/info/exclude"
rm -rf .gpu/serve; mkdir -p .gpu/serve
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d .gpu/serve "fastapi>=0.110" "uvicorn>=0.29" "uvloop>=0.19" "httptools>=0.6" "jsonschema>=4"
# xgrammar without its needs (torch, transformers, triton and numpy are the image's), and apache-tvm-ffi.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d .gpu/serve "xgrammar>=0.1.25" apache-tvm-ffi
cat > .gpu/serve/install.sh <<'SH'
#!/usr/bin/env bash
# Install the server's packages from the wheels beside this script, offline; the image's packages stay.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python -m pip install -q --no-index --find-links "$here" fastapi uvicorn uvloop httptools jsonschema &&
  python -m pip install -q --no-index --no-deps --find-links "$here" xgrammar apache-tvm-ffi &&
  python -c "import fastapi, uvicorn, uvloop, httptools, xgrammar, prometheus_client, jsonschema; print('fastapi', fastapi.__version__, '| uvicorn', uvicorn.__version__, '| uvloop', uvloop.__version__, '| xgrammar ok')"
SH
du -sh .gpu/serve
