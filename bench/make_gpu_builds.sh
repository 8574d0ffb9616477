#!/usr/bin/env bash
# The sm_90 builds the H200 runs use, cross-compiled here (no GPU needed), into .gpu/builds/:
# realistic shapes with --params seeded (weights redrawn on the GPU from the manifest's seeds),
# each also with CUDA graphs (kernel-schedule{graph=true}); tiny bf16 models with their weights;
# the 27B-style hybrid with tree verification at a 4k context.  Builds use the default schedule
# set (skinny-mma on sm_90); the -ntgemv builds are the same with --schedule nt-gemv, for A/B.
# Then the kernel libraries of bench/w12_gemm.py, bench/tree_verify.py and bench/skinny_gemm.py.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
sp=.venv/bin/specpilot
out=.gpu/builds
mkdir -p "$out" .gpu/w12
cuda="cuda -arch=sm_90"
graph="kernel-schedule{graph=true}"
$sp compile bench/specs/qwen3-8b-shape-8l.yaml --target "$cuda" --params seeded -o "$out/qwen3-8b-8l"
$sp compile bench/specs/qwen3-8b-shape-8l.yaml --target "$cuda" --params seeded --passes "$graph" -o "$out/qwen3-8b-8l-graph"
$sp compile bench/specs/qwen35-27b-shape-4l.yaml --target "$cuda" --params seeded -o "$out/qwen35-27b-4l"
$sp compile bench/specs/qwen35-27b-shape-4l.yaml --target "$cuda" --params seeded --passes "$graph" -o "$out/qwen35-27b-4l-graph"
$sp compile bench/specs/qwen35-27b-shape-4l-tree.yaml --target "$cuda" --params seeded -o "$out/qwen35-27b-4l-tree"
for m in qwen3-8b-shape-8l:qwen3-8b-8l qwen35-27b-shape-4l-tree:qwen35-27b-4l-tree; do
  $sp compile "bench/specs/${m%%:*}.yaml" --target "$cuda" --params seeded --schedule nt-gemv -o "$out/${m##*:}-ntgemv"
done
for m in tiny-llama-bf16 tiny-hybrid-bf16; do
  $sp compile "bench/specs/$m.yaml" --target "$cuda" -o "$out/$m"
  $sp compile "bench/specs/$m.yaml" --target "$cuda" --passes "$graph" -o "$out/$m-graph"
done
$sp compile bench/specs/tiny-hybrid-bf16.yaml --target "$cuda" --passes "tree-verify{budget=16},gdn-path-recompute" \
  -o "$out/tiny-hybrid-bf16-tree"
# W12 and stacked projections (session 6): realistic shapes seeded (the engine converts the redrawn
# weights at load), tiny W12-tileable specs with their weights for forcing, incl. the two-level stack
$sp compile bench/specs/qwen3-8b-shape-8l.yaml --target "$cuda" --params seeded --passes "fuse-projections" -o "$out/qwen3-8b-8l-f"
$sp compile bench/specs/qwen3-8b-shape-8l.yaml --target "$cuda" --params seeded --passes "fuse-projections,w12-layout" -o "$out/qwen3-8b-8l-fw"
$sp compile bench/specs/qwen35-27b-shape-4l.yaml --target "$cuda" --params seeded --passes "fuse-projections,w12-layout" -o "$out/qwen35-27b-4l-fw"
$sp compile bench/specs/qwen35-27b-shape-4l-tree.yaml --target "$cuda" --params seeded --passes "fuse-projections" -o "$out/qwen35-27b-4l-tree-f"
$sp compile bench/specs/tiny-llama-w12-bf16.yaml --target "$cuda" --passes "fuse-projections,w12-layout" -o "$out/tiny-llama-w12-fw"
$sp compile bench/specs/tiny-hybrid-w12-bf16.yaml --target "$cuda" \
  --passes "fuse-projections,w12-layout,nested-int8-view,tree-verify{budget=16},gdn-path-recompute,two-level-verify" \
  -o "$out/tiny-hybrid-w12-two-level"
stub() { .venv/bin/python -c "
import os, subprocess, sys
from specpilot.compiler.build import cuda_stub_env
sys.exit(subprocess.call([sys.executable] + sys.argv[1:], env={**os.environ, **cuda_stub_env()}))" "$@"; }
[ -f .gpu/w12/gemm.so ] || stub bench/w12_gemm.py build .gpu/w12/gemm.so
stub bench/tree_verify.py build .gpu/w12/gdn.so
[ -f .gpu/w12/skinny.so ] || stub bench/skinny_gemm.py build .gpu/w12/skinny.so
du -sh "$out"/* .gpu/w12/*.so
