#!/usr/bin/env bash
# SmolLM2-135M-Instruct bf16 builds for the H200 end-to-end bench (bench/README "End to end"),
# cross-compiled here for sm_90 with --params load: each build references the GGUF (path + digest)
# instead of carrying 270 MB of weights; on the H200, SPECPILOT_WEIGHTS points at the staged GGUF.
# CUDA graphs on; one build per drafter (AR, chain and tree engines), two-level for the L12 adapter.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
out=${OUT_DIR:-.gpu/smol-builds}
mkdir -p "$out"
tree=${BUDGET:-32}
for d in ngram l4 l12; do
  .venv/bin/specpilot compile "bench/specs/smollm2-$d-bf16.yaml" --target "cuda -arch=sm_90" --params load \
    --passes "tree-verify{budget=$tree},kernel-schedule{graph=true}" -o "$out/$d"
done
.venv/bin/specpilot compile bench/specs/smollm2-l12-bf16.yaml --target "cuda -arch=sm_90" --params load \
  --passes "w12-layout,nested-int8-view,tree-verify{budget=$tree},two-level-verify,kernel-schedule{graph=true}" \
  -o "$out/l12-two-level"
rm -f "$out"/*/kernels.json     # the cost model's; the bench does not read it
du -sh "$out"/*
