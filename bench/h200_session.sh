#!/usr/bin/env bash
# Device calls on the H200 under a runtime-only TVM, results into $OUT (and printed).  Needs,
# carried along: .gpu/rt (bench/make_gpu_runtime.sh), .gpu/pyd (pydantic's wheels), .gpu/builds and .gpu/w12
# (bench/make_gpu_builds.sh).  One part per call (each under the per-call limit):
#   bash bench/h200_session.sh decode    decode: compiled vs eager vs torch.compile, per-kernel
#                                        profile; the same builds with CUDA graphs
#   bash bench/h200_session.sh tree      bf16 matmuls on tensor cores; GDN kernels; tree verification
#                                        vs an AR step at 4k; bf16 token forcing of the tiny builds
#                                        (chain, tree, with/without graphs; the graph builds only if carried)
#   bash bench/h200_session.sh gemm      the W12 GEMM kernels
#   bash bench/h200_session.sh mma       skinny tensor-core GEMMs (bench/skinny_gemm.py); tree verify at 4k,
#                                        nt-gemv vs the default (skinny-mma) build
#   bash bench/h200_session.sh compare   builds under $STAGE (.gpu/stage; one carried folder): compiled decode of
#                                        $DECODE_BUILDS (and with eager/torch.compile: $DECODE_FULL_BUILDS),
#                                        tree verify at 4k of $TREE_BUILDS, bf16 forcing of $FORCING_BUILDS,
#                                        the attention kernels of $ATTN_LIB (bench/attention_rows.py build)
#   bash bench/h200_session.sh cpp       libspecpilot (carried in .gpu/cpp: libspecpilot.so, specpilot-generate)
#                                        beside the Python engine on $CPP_BUILDS under $STAGE; $MATERIALIZE builds
#                                        (--params seeded) get their weights written in first (bench/cpp_runtime.py)
set -u
mkdir -p /tmp/rt && tar xzf .gpu/rt/site.tgz -C /tmp/rt
# the manifest's pydantic (and its own deps), from wheels carried in .gpu/pyd (`pip download --python-version 3.12
# --only-binary=:all: pydantic`): the GPU machine's Python lacks it
[ -d .gpu/pyd ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyd .gpu/pyd/*.whl
export PYTHONPATH=/tmp/rt/site:$PWD:/tmp/pyd PYTHONUNBUFFERED=1 TVM_USE_RUNTIME_LIB=1
out=${OUT:-bench/results}
b=.gpu/builds
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
case "${1:-decode}" in
decode)
  timeout "${DECODE_S:-380}" python3 bench/decode.py $b/qwen3-8b-8l $b/qwen35-27b-4l --no-w12 --profile 8 \
    --context 512 --steps 32 --batches 4,8 --out "$out" 2>&1 | grep -v Warning | tail -60
  timeout "${GRAPH_S:-150}" python3 bench/decode.py $b/qwen3-8b-8l-graph $b/qwen35-27b-4l-graph --compiled-only \
    --context 512 --steps 32 --batches 4,8 --out "$out" 2>&1 | grep -v Warning | tail -12 ;;
tree)
  timeout "${TREE_S:-330}" python3 bench/tree_verify.py run --lib .gpu/w12/gdn.so --build $b/qwen35-27b-4l-tree \
    --context 4096 --out "$out" 2>&1 | grep -v Warning | tail -30
  timeout "${FORCING_S:-200}" python3 bench/gpu_forcing.py $b/tiny-llama-bf16 $b/tiny-hybrid-bf16 \
    $b/tiny-hybrid-bf16-tree $(ls -d $b/tiny-*-graph 2>/dev/null) --max-new-tokens 128 --out "$out" 2>&1 \
    | tail -12 ;;
mma)
  timeout "${SKINNY_S:-170}" python3 bench/skinny_gemm.py run .gpu/w12/skinny.so --out "$out" 2>&1 | grep -v Warning | tail -40
  for t in ${TREES:-qwen35-27b-4l-tree-ntgemv qwen35-27b-4l-tree}; do
    timeout "${TREE_S:-110}" python3 bench/tree_verify.py run --lib .gpu/w12/gdn.so --build $b/$t --context 4096 \
      --parts steps --out "$out" 2>&1 | grep -v Warning | tail -34
  done ;;
compare)
  st=${STAGE:-.gpu/stage}
  [ -n "${ATTN_LIB:-}" ] && timeout "${ATTN_S:-120}" python3 bench/attention_rows.py run "$ATTN_LIB" --out "$out" 2>&1 \
    | grep -v Warning | tail -40
  [ -n "${FORCING_BUILDS:-}" ] && timeout "${FORCING_S:-150}" python3 bench/gpu_forcing.py \
    $(for x in $FORCING_BUILDS; do echo $st/$x; done) --max-new-tokens 128 --out "$out" 2>&1 | tail -12
  for t in ${TREE_BUILDS:-}; do
    timeout "${TREE_S:-110}" python3 bench/tree_verify.py run --lib none --build $st/$t --context 4096 \
      --parts steps --out "$out" 2>&1 | grep -v Warning | tail -34
  done
  [ -n "${DECODE_FULL_BUILDS:-}" ] && timeout "${DECODE_FULL_S:-300}" python3 bench/decode.py \
    $(for x in $DECODE_FULL_BUILDS; do echo $st/$x; done) --no-w12 --profile 8 ${DECODE_FULL_ARGS:-} --context 512 --steps 32 \
    --batches 4,8 --out "$out" 2>&1 | grep -v Warning | tail -50
  [ -n "${DECODE_BUILDS:-}" ] && timeout "${DECODE_S:-300}" python3 bench/decode.py \
    $(for x in $DECODE_BUILDS; do echo $st/$x; done) --compiled-only --profile 8 ${DECODE_ARGS:-} --context 512 --steps 32 \
    --batches 4,8 --out "$out" 2>&1 | grep -v Warning | tail -90 ;;
cpp)
  st=${STAGE:-.gpu/stage}
  export LD_LIBRARY_PATH=$PWD/.gpu/cpp:/tmp/rt/site/tvm/lib:/tmp/rt/site/tvm_ffi/lib SPECPILOT_TVM_LIBDIR=/tmp/rt/site/tvm/lib
  for x in ${MATERIALIZE:-}; do
    [ -d "$st/$x-file" ] || timeout "${MATERIALIZE_S:-300}" python3 -c \
      "import sys; from specpilot.runtime.materialize import materialize; materialize(sys.argv[1], sys.argv[2])" \
      "$st/$x" "$st/$x-file" 2>&1 | tail -3
  done
  timeout "${CPP_S:-400}" python3 bench/cpp_runtime.py $(for x in $CPP_BUILDS; do echo $st/$x; done) \
    --programs .gpu/cpp ${CPP_ARGS:-} --out "$out" 2>&1 | grep -v Warning | tail -20 ;;
gemm)
  timeout "${GEMM_S:-170}" python3 bench/w12_gemm.py run .gpu/w12/gemm.so --out "$out" 2>&1 | tail -75 ;;
esac
