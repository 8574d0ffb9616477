#!/usr/bin/env bash
# `specpilot search` on the H200, with the whole TVM (compiler too) there: candidates are built on
# the GPU machine by the search's own workers, forced against the PyTorch reference on the GPU, and
# measured there.  TVM comes from ../shared/tools/gpu-prep (extra wheels: z3-solver pydantic
# pydantic-core annotated-types typing-inspection typing-extensions), staged in four calls in a row
# on one warm machine (the machine keeps /tmp while it stays up):
#   bash bench/h200_search.sh stage N     carry .gpu/pN, N = 1..4 (the 4th installs)
#   bash bench/h200_search.sh run         the search; a later call on the same machine resumes it
#                                         from /tmp/search (run.jsonl + memory), losing no verdict
# What comes back in $OUT: search.log, run.jsonl, report.json/.md (once finished), memory.sqlite,
# environment.txt (GPU, driver, versions).
set -u
spec=${SPEC:-bench/specs/qwen35-27b-shape-4l-search.yaml}
case "${1:-run}" in
stage)
  bash ".gpu/p$2/stage.sh" ;;
run)
  [ -f /tmp/gpu/env.sh ] || { echo "no staged TVM on this machine (/tmp/gpu/env.sh): stage again"; exit 3; }
  source /tmp/gpu/env.sh
  export PATH=$PATH:/usr/local/cuda/bin SPECPILOT_CACHE_DIR=/tmp/specpilot-cache
  mkdir -p /tmp/search "${OUT:-/tmp/out}"
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import sys, torch, tvm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'tvm', tvm.__version__)"
  } | tee -a /tmp/search/environment.txt
  # the workers run in their own sessions: stop them with the search when the time is up
  timeout "${SEARCH_S:-540}" python3 -m specpilot.cli search "$spec" --target "cuda -arch=sm_90" \
    --rounds "${ROUNDS:-1}" --workers "${WORKERS:-2}" --memory /tmp/search/memory.sqlite -o /tmp/search/run ${SEARCH_ARGS:---repeats 8} \
    2>&1 | grep --line-buffered -v "missing 'max_shared_memory_per_block'" | tee -a /tmp/search/search.log
  rc=${PIPESTATUS[0]}
  pkill -f specpilot.agent.executor || true
  echo "search exit status $rc"
  for f in /tmp/search/search.log /tmp/search/run/run.jsonl /tmp/search/run/report.json /tmp/search/run/report.md \
           /tmp/search/memory.sqlite /tmp/search/memory.sqlite-wal /tmp/search/environment.txt; do
    [ -f "$f" ] && cp "$f" "${OUT:-/tmp/out}/"
  done
  for d in /tmp/search/run/builds/*/; do      # the last lines of each worker's log, for the rejected ones
    [ -f "$d/worker.log" ] && { echo "== $d"; tail -4 "$d/worker.log"; }
  done > "${OUT:-/tmp/out}/workers.txt" 2>/dev/null
  tail -40 /tmp/search/search.log ;;
esac
