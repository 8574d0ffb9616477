#!/usr/bin/env bash
# A runtime-only TVM for the GPU machine (Python 3.12), small enough to carry in one run:
# the cp312 wheels that ../shared/tools/gpu-prep caches, unpacked, without libtvm_compiler.so.
#
#   ../shared/tools/gpu-prep && bench/make_gpu_runtime.sh      # writes .gpu/rt/site.tgz (~10 MB)
#   device run, carry [".gpu/rt", ...]:
#     mkdir -p /tmp/rt && tar xzf .gpu/rt/site.tgz -C /tmp/rt && \
#     export PYTHONPATH=/tmp/rt/site:$PWD TVM_USE_RUNTIME_LIB=1 && python3 bench/decode.py ...
set -euo pipefail
root=$(git rev-parse --show-toplevel)
wheels=${XDG_CACHE_HOME:-$HOME/.cache}/specpilot-gpu/wheels
ls "$wheels"/apache_tvm-*.whl "$wheels"/apache_tvm_ffi-*.whl "$wheels"/ml_dtypes-*.whl >/dev/null
work=$(mktemp -d)
mkdir -p "$work/site"
for w in "$wheels"/apache_tvm-*.whl "$wheels"/apache_tvm_ffi-*.whl "$wheels"/ml_dtypes-*.whl; do
  (cd "$work/site" && python3 -m zipfile -e "$w" .)
done
rm -f "$work/site/tvm/lib/libtvm_compiler.so"
mkdir -p "$root/.gpu/rt"
tar -C "$work" -czf "$root/.gpu/rt/site.tgz" site
rm -rf "$work"
du -h "$root/.gpu/rt/site.tgz"
