#!/usr/bin/env bash
# The sm_90 builds the H200 runs use, cross-compiled here (no GPU needed), into .gpu/builds/:
# realistic shapes with --params seeded (weights redrawn on the GPU from the manifest's seeds),
# tiny bf16 models with their weights.  Then bench/w12_gemm.py's kernel library.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
sp=.venv/bin/specpilot
out=.gpu/builds
mkdir -p "$out" .gpu/w12
$sp compile bench/specs/qwen3-8b-shape-8l.yaml --target "cuda -arch=sm_90" --params seeded -o "$out/qwen3-8b-8l"
$sp compile bench/specs/qwen35-27b-shape-4l.yaml --target "cuda -arch=sm_90" --params seeded -o "$out/qwen35-27b-4l"
$sp compile bench/specs/tiny-llama-bf16.yaml --target "cuda -arch=sm_90" -o "$out/tiny-llama-bf16"
$sp compile bench/specs/tiny-hybrid-bf16.yaml --target "cuda -arch=sm_90" -o "$out/tiny-hybrid-bf16"
[ -f .gpu/w12/gemm.so ] || .venv/bin/python -c "
import os, subprocess, sys
from specpilot.compiler.build import cuda_stub_env
sys.exit(subprocess.call([sys.executable, 'bench/w12_gemm.py', 'build', '.gpu/w12/gemm.so'], env={**os.environ, **cuda_stub_env()}))"
du -sh "$out"/* .gpu/w12/gemm.so
