#!/usr/bin/env bash
# One device call on the H200: runtime-only TVM, then decode, W12 GEMM and bf16 forcing benches,
# each under its own time limit, results into $OUT (and printed).  Needs, carried along:
# .gpu/rt (bench/make_gpu_runtime.sh), .gpu/builds and .gpu/w12 (bench/make_gpu_builds.sh).
set -u
mkdir -p /tmp/rt && tar xzf .gpu/rt/site.tgz -C /tmp/rt
export PYTHONPATH=/tmp/rt/site:$PWD PYTHONUNBUFFERED=1 TVM_USE_RUNTIME_LIB=1
out=${OUT:-bench/results}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout "${DECODE_S:-330}" python3 bench/decode.py .gpu/builds/qwen3-8b-8l .gpu/builds/qwen35-27b-4l \
  --context 512 --steps 32 --batches 4,8 --out "$out" 2>&1 | grep -v Warning | tail -40
timeout "${GEMM_S:-170}" python3 bench/w12_gemm.py run .gpu/w12/gemm.so --out "$out" 2>&1 | tail -75
timeout "${FORCING_S:-90}" python3 bench/gpu_forcing.py .gpu/builds/tiny-llama-bf16 .gpu/builds/tiny-hybrid-bf16 \
  --max-new-tokens 128 --out "$out" 2>&1 | tail -8
