#!/usr/bin/env bash
# End to end on the H200 (bench/README "End to end"): `specpilot bench` on the SmolLM2-135M-Instruct bf16
# builds of bench/make_smollm2_builds.sh (--params load) under a runtime-only TVM.  One warm machine,
# calls in a row (each carries at most 64 MiB with the working tree; /tmp stays between calls):
#   bash bench/h200_e2e.sh stage DIR...     copy carried folders into /tmp/e2e (runtime TVM, wheels, GGUF parts)
#   bash bench/h200_e2e.sh smol [BUILD...]  assemble + check the GGUF, run the bench on each build, JSON to $OUT
#   bash bench/h200_e2e.sh serve BUILD      sampled forcing and bench, then bench/serve_load.py (1, 8, 32 clients)
#   bash bench/h200_e2e.sh full-check       the counter-based seeded draw on the GPU equals the CPU's
#   bash bench/h200_e2e.sh full-ref BUILD   full-depth 27B-class: compiled AR vs transformers eager / torch.compile
#   bash bench/h200_e2e.sh full-sweep BUILD full-depth 27B-class, replay drafter: ALPHAS and PROFILES, every engine
#   bash bench/h200_e2e.sh exact-batch BUILD...  small seeded builds of the 27B batch plan (bench/specs/mid-hybrid-batch-*):
#                                           every batched engine forced onto batched AR at BATCHES, `auto` tolerance
#                                           (float32: none), to $OUT
#   bash bench/h200_e2e.sh full-batch BUILD full-depth 27B-class, continuous batching at BATCHES, every engine
#                                           (and the scheduled one under each NODES/CHUNK of SCHEDULES, every
#                                           speculative one under each set of DRAFT_LENGTHS)
#   bash bench/h200_e2e.sh batch-profile BUILD  the host's side of a batched run (cProfile at BATCHES), to $OUT
#   bash bench/h200_e2e.sh timeline BUILD   bench/batch_timeline.py: where the device waits for the host a pass, to $OUT
#   bash bench/h200_e2e.sh pass-cost BUILD   a batched pass's AR step / verification / drafter level per kernel, to $OUT
#   bash bench/h200_e2e.sh packed-verify BUILD  bench/packed_verify.py: padded against packed verification, to $OUT
#   bash bench/h200_e2e.sh skinny LIB.so     bench/skinny_gemm.py run (LIB built here with the same SKINNY_*), to $OUT
#   bash bench/h200_e2e.sh gdn LIB.so        bench/gdn_recurrence.py run (LIB built here), to $OUT
#   bash bench/h200_e2e.sh smol-batch BUILD  SmolLM2, continuous batching at BATCHES, every engine (GGUF staged)
#   bash bench/h200_e2e.sh train-drafters   distil SmolLM2's block and feature drafters (examples/drafters), to $OUT
#   bash bench/h200_e2e.sh cost BUILD...     bench/drafter_cost.py on block / feature builds, to $OUT
#   bash bench/h200_e2e.sh fd-profile BUILD  the host's side of a trained drafter's tree engine (cProfile), to $OUT
#   bash bench/h200_e2e.sh fd [BUILD...]    the block / feature builds (bench/specs/smollm2-{block,feature}-bf16.yaml)
#                                           with the trained drafters (SPECPILOT_DRAFTER=$E/drafters/KIND where the
#                                           build's is a seeded stand-in), to $OUT
# Carried: the runtime TVM (bench/make_gpu_runtime.sh's site.tgz), the wheels the image lacks (pydantic, gguf;
# for serving fastapi, uvicorn, prometheus-client, openai and theirs: `pip download --python-version 3.12`), the GGUF split in
# three (+ its sha256), and the builds as NAME.txz (tar -cJf, without kernels.json), spread over the calls.
set -euo pipefail
E=/tmp/e2e
setup() {
  [ -d /tmp/rt/site ] || { mkdir -p /tmp/rt && tar xzf $E/site.tgz -C /tmp/rt; }
  [ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site $E/*.whl
  # torch's cache in growable segments: the 27B plan's prefill of a burst of 16 on an H100 otherwise finds 12 GB
  # reserved in pieces and 1.4 GB free for its 1.9 GB of logits
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  export PYTHONPATH=/tmp/rt/site:/tmp/site:$PWD TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    SPECPILOT_CACHE=/tmp/spcache SPECPILOT_WEIGHTS=$E/SmolLM2-135M-Instruct.Q4_1.gguf
}
# the GGUF assembled from its parts and checked, the runtime and wheels installed, the builds unpacked to $E/builds
prepare() {
  assemble
  setup
  unpack
}
# the GGUF from its parts, kept only when its sha256 matches (a part still to come leaves none)
assemble() {
  G=$E/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f $G ] || cat $E/smolpart.* > $G
  echo "$(cat $E/sha256)  $G" | sha256sum -c || { rm -f $G; return 1; }
}
unpack() {
  b=$E/builds; mkdir -p $b
  for t in $E/*.txz; do [ -e "$t" ] && [ ! -d $b/$(basename $t .txz) ] && tar xJf $t -C $b; done; true
}
# SPECPILOT_DRAFTER for a build whose block / feature drafter is a seeded stand-in: the trained one staged in
# $E/drafters where there is one (a build lowered from a drafter checkpoint keeps its own; empty: none)
trained() {
  python3 -c "import json, os; d = json.load(open('$b/$1/manifest.json'))['spec']['drafter']
staged = '$E/drafters/' + d['kind']
print(staged if d['kind'] in ('block', 'feature') and not d.get('checkpoint') and os.path.isdir(staged) else '')"
}
# batch 1 at a 4k context: prompts of 4096 token ids (a seeded model has no tokenizer; any ids will do)
long_prompts() {
  [ -f $E/long.jsonl ] || python3 -c "
import json, random
r = random.Random(0)
for _ in range(4):
    print(json.dumps({'prompt_ids': [r.randrange(1000, 200000) for _ in range(4096)]}))" > $E/long.jsonl
}
# batched serving: PROMPTS (32) prompts of PROMPT_TOKENS (512) token ids, $E/batch.jsonl
batch_prompts() {
  python3 -c "
import json, random
r = random.Random(1)
for _ in range(${PROMPTS:-32}):
    print(json.dumps({'prompt_ids': [r.randrange(1000, 200000) for _ in range(${PROMPT_TOKENS:-512})]}))" > $E/batch.jsonl
}
case "${1:-}" in
  stage)
    shift; mkdir -p $E; for d in "$@"; do cp -r "$d"/. $E/; done; ls -la $E ;;
  smol)
    shift
    prepare
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    # a process per run: two loads of a CUDA-graph build in one process crashed (illegal address)
    for build in ${@:-ngram l4 l12 l12-two-level}; do
      engines=compiled,compiled-spec,compiled-tree
      grep -q '"two_level": true' $b/$build/manifest.json && engines=compiled,compiled-tree,compiled-two-level
      for set in ${SETS:-code chat}; do
        timeout ${BENCH_S:-150} python3 -m specpilot.cli bench $b/$build --prompts $set --requests ${REQUESTS:-6} \
          --max-new-tokens ${TOKENS:-256} --engines $engines -o $OUT/e2e-smollm2-$build-$set.json 2>&1 | tail -3
      done
    done
    # what a user has without SpecPilot, on the same weights: stock PyTorch and transformers generate
    [ -n "${REFERENCE:-1}" ] && timeout ${REF_S:-200} python3 -m specpilot.cli bench $b/ngram --prompts code \
      --requests ${REF_REQUESTS:-3} --max-new-tokens ${TOKENS:-256} \
      --engines compiled,stock,stock-spec,hf-generate,hf-assisted -o $OUT/e2e-smollm2-ngram-code-reference.json \
      2>&1 | tail -3
    ;;
  serve)
    prepare
    build=$b/${2:-ngram}
    # sampled: the build's noise kernel on the GPU draws stock PyTorch's tokens for the same seed
    timeout ${VERIFY_S:-120} python3 -m specpilot.cli verify $build --engine compiled-tree --temperature 0.8 \
      --top-p 0.95 --seed 1 --max-new-tokens 128 --json > $OUT/verify-sampled-smollm2.json || true
    tail -c 400 $OUT/verify-sampled-smollm2.json; echo
    for set in ${SETS-code chat}; do
      timeout ${BENCH_S:-150} python3 -m specpilot.cli bench $build --prompts $set --requests ${REQUESTS:-4} \
        --max-new-tokens ${TOKENS:-256} --engines compiled,compiled-spec,compiled-tree --temperature 0.7 --seed 1 \
        -o $OUT/e2e-smollm2-ngram-$set-sampled.json 2>&1 | tail -3
    done
    timeout ${LOAD_S:-300} python3 bench/serve_load.py $build --engines compiled,compiled-tree --clients 1,8,32 \
      --seconds ${LOAD_SECONDS:-12} --max-tokens 128 -o $OUT/serve-load-smollm2-ngram.json
    ;;
  full-check)
    # the counter-based draw on the GPU equals the CPU's (what lets a seeded 27B-class model be drawn where it runs)
    setup
    python3 - <<'PY'
import torch
from specpilot.core import counter_draw
a = counter_draw.normal(7, "w", (4099, 1031), 0.03)
b = counter_draw.normal(7, "w", (4099, 1031), 0.03, device="cuda", dtype=torch.bfloat16)
print("counter draw, CUDA == CPU:", torch.equal(a, b.float().cpu()))
PY
    ;;
  full-ref)
    # compiled AR vs transformers generate, eager and torch.compile (static cache), on the same weights
    shift; setup; unpack
    long_prompts
    timeout ${REF_S:-420} python3 -m specpilot.cli bench $b/$1 --prompts $E/long.jsonl --requests ${REF_REQUESTS:-1} \
      --max-new-tokens ${REF_TOKENS:-64} --engines ${REF_ENGINES:-compiled,hf-generate,hf-compiled} --breakdown-requests 0 \
      --tie-tolerance ${TIE:-auto} -o $OUT/e2e-27b-full-reference.json 2>&1 | tail -12 ;;
  full-sweep)
    # the replay drafter at each alpha and on recorded profiles, every engine of the build, AR first; forced onto
    # AR's tokens (a deep seeded bf16 model is full of near-ties that would take a run off the recorded continuation)
    shift; setup; unpack
    long_prompts
    engines=compiled,compiled-tree
    grep -q '"two_level": true' $b/$1/manifest.json && engines=compiled,compiled-tree,compiled-two-level
    engines=$engines${EXTRA_ENGINES:+,$EXTRA_ENGINES}
    timeout ${SWEEP_S:-420} python3 -m specpilot.cli bench $b/$1 --prompts $E/long.jsonl --requests ${REQUESTS:-2} \
      --max-new-tokens ${TOKENS:-256} --engines $engines --replay-alpha ${ALPHAS:-0.6,0.7,0.8,0.9} \
      $(for f in ${PROFILES:-bench/profiles/smollm2-l12-tree64-code.json}; do echo --replay-profile $f; done) \
      --tie-tolerance ${TIE:-auto} --breakdown-requests 1 --forced -o $OUT/e2e-27b-full-$1.json 2>&1 | tail -40 ;;
  full-batch)
    # continuous batching: every engine at each batch size, the requests all at once (one per cache row);
    # speculative engines forced onto the batched AR reference's tokens (the replay drafter follows them);
    # BATCH_REQUESTS: that many requests at every batch size, at most the batch size running (a saturated load);
    # TAG: a suffix for the result file's name; CONFIDENCE: a profile whose drafter confidences score the replay's
    # proposals (bench/profiles/smollm2-block-chain-mixed.json: the trained block drafter's)
    shift; setup; unpack
    PROMPTS=$(( ${BATCH_REQUESTS:-32} > 32 ? ${BATCH_REQUESTS:-32} : 32 )) batch_prompts
    timeout ${BATCH_S:-480} python3 -m specpilot.cli bench $b/$1 --prompts $E/batch.jsonl --batch ${BATCHES:-1,2,4,8,16,32} \
      ${BATCH_REQUESTS:+--requests $BATCH_REQUESTS} \
      --max-new-tokens ${TOKENS:-128} ${ENGINES:+--engines $ENGINES} ${SCHEDULES:+--schedules $SCHEDULES} \
      ${DRAFT_LENGTHS:+--draft-lengths $DRAFT_LENGTHS} ${CONFIDENCE:+--replay-confidence $CONFIDENCE} \
      --tie-tolerance ${TIE:-auto} --forced -o $OUT/e2e-27b-batch-$1${TAG:+-$TAG}.json 2>&1 | tail -${TAIL:-40} \
      || { rc=$?; [ $rc = 124 ] && echo "full-batch $1: BATCH_S=${BATCH_S:-480} s ran out, no result file" >&2; exit $rc; } ;;
  exact-batch)
    # the batch plan's engines on the GPU against batched AR, forced, at the tolerance derived for each build
    # (float32 builds: no tolerance); prompts of PROMPT_TOKENS ids drawn below the build's vocabulary
    shift; setup; unpack
    for build in "$@"; do
      python3 -c "
import json, random, sys
vocab = json.load(open(sys.argv[1]))['spec']['target']['config']['vocab_size']
r = random.Random(1)
for _ in range(32):
    print(json.dumps({'prompt_ids': [r.randrange(10, vocab) for _ in range(int(sys.argv[2]))]}))" \
        "$b/$build/manifest.json" ${PROMPT_TOKENS:-64} > $E/exact.jsonl
      # a failing build is reported and the next one still runs
      timeout ${EXACT_S:-240} python3 -m specpilot.cli bench "$b/$build" --prompts $E/exact.jsonl --batch ${BATCHES:-16,32} \
        --max-new-tokens ${TOKENS:-128} --engines ${ENGINES:-compiled,compiled-spec,compiled-tree,compiled-tree-sched} \
        --tie-tolerance ${TIE:-auto} --forced -o "$OUT/batch-exact-$(basename "$build").json" 2>&1 | tail -${TAIL:-16} \
        || echo "exact-batch $build: failed (exit ${PIPESTATUS[0]})"
    done ;;
  batch-profile)
    # the host's side of a batched run: cProfile of the batch bench at BATCHES (PROFILE_ENGINES), the stats
    # to $OUT (`python -m pstats`); device time shows where the host waits for it (tolist, numpy, cpu)
    shift; setup; unpack
    batch_prompts
    timeout ${PROFILE_S:-300} python3 -m cProfile -o $OUT/batch-profile-$1.pstats -m specpilot.cli bench $b/$1 \
      --prompts $E/batch.jsonl --batch ${BATCHES:-16} --max-new-tokens ${TOKENS:-128} \
      --engines ${PROFILE_ENGINES:-compiled,compiled-tree-sched} --tie-tolerance ${TIE:-auto} --forced \
      -o $OUT/batch-profile-$1.json 2>&1 | tail -8
    python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(25)
s.sort_stats('cumtime').print_stats('specpilot', 30)" $OUT/batch-profile-$1.pstats | cut -c1-160 ;;
  timeline)
    # each part of a batched pass split into device-busy and idle time (profiler trace), TL_ARGS: its options
    shift; setup; unpack
    timeout ${TL_S:-300} python3 bench/batch_timeline.py $b/$1 --batches ${BATCHES:-16} ${TL_ARGS:-} --out $OUT 2>&1 \
      | grep -v -e WARN -e USDT | tail -${TAIL:-12} ;;
  pass-cost)
    # where a batched pass's time goes (bench/batch_pass_cost.py): AR step, verification, drafter level, per kernel
    shift; setup; unpack
    timeout ${COST_S:-400} python3 bench/batch_pass_cost.py $b/$1 --batches ${BATCHES:-8,16,32} ${COST_ARGS:-} --out $OUT 2>&1 | tail -40 ;;
  skinny)
    # bench/skinny_gemm.py on a kernel library built here (the same SKINNY_* as at its build), to $OUT
    shift; setup
    timeout ${SKINNY_S:-300} python3 bench/skinny_gemm.py run $1 --out $OUT 2>&1 | grep -v Warning | tail -80 ;;
  gdn)
    # bench/gdn_recurrence.py on a kernel library built here, to $OUT
    shift; setup
    timeout ${GDN_S:-200} python3 bench/gdn_recurrence.py run $1 --out $OUT 2>&1 | grep -v Warning | tail -60 ;;
  smol-batch)
    # continuous batching on SmolLM2-135M bf16 (a batched SmolLM2 build: bench/specs/smollm2-block-batch-bf16.yaml): every engine at each
    # batch size, the 32 prompts of the code and chat sets all at once; speculative rows forced onto batched AR's
    # (TIE: a fixed tie tolerance; `auto` runs stock PyTorch on every prompt first, minutes at 32)
    # (a block / feature drafter's build drafts with the trained drafter staged in $E/drafters, or SPECPILOT_DRAFTER's)
    shift; prepare
    export SPECPILOT_DRAFTER=${SPECPILOT_DRAFTER:-$(trained ${1:-smol-batch})}
    timeout ${BATCH_S:-480} python3 -m specpilot.cli bench $b/${1:-smol-batch} --prompts mixed --batch ${BATCHES:-1,2,4,8,16,32} \
      --max-new-tokens ${TOKENS:-128} ${ENGINES:+--engines $ENGINES} --tie-tolerance ${TIE:-auto} --forced \
      -o $OUT/e2e-smollm2-batch-${1:-smol-batch}.json \
      2>&1 | tail -${TAIL:-40} ;;
  train-drafters)
    # block (DFlash-style) and feature (EAGLE-3-style) drafters distilled from SmolLM2 on the target's own
    # continuations (generated once, shared), never on the bench's prompts
    prepare
    d=$E/drafters; mkdir -p $d/feature/training
    printf 'target:\n  gguf: %s\ndrafter:\n  kind: ngram\ndeployment:\n  dtype: float32\n' $G > $E/smollm2.yaml
    python3 -c "import json; from specpilot.runtime.prompt_sets import CODE, CHAT; json.dump(CODE + CHAT, open('$E/holdout.json', 'w'))"
    common="--steps ${STEPS:-20000} --batch ${BATCH:-32} --seq-len 256 --generate ${GENERATE:-2048} --holdout $E/holdout.json"
    declare -A options=([block]="--layers ${LAYERS:-2} --block-size 8" [feature]="--ttt 3 --draft-vocab 8192")
    for k in ${KINDS:-block feature}; do      # the continuations are generated once and shared
      mkdir -p $d/$k/training; [ -f $d/$k/training/sequences.json ] || cp $d/*/training/sequences.json $d/$k/training/ 2>/dev/null || true
      python3 -m specpilot.cli drafter train $E/smollm2.yaml --kind $k ${options[$k]} -o $d/$k $common \
        --time-limit ${TIME_LIMIT:-150} ${TRAIN_ARGS:-} 2>&1 | grep -v "e.g." | tail -4
    done
    # back in parts of 15 MB (a file coming back holds 16 MiB at most): cat KIND/part.* > model.safetensors
    for k in ${KINDS:-block feature}; do
      mkdir -p $OUT/$k; cp $d/$k/config.json $d/$k/training.json $OUT/$k/; split -b 15000000 $d/$k/model.safetensors $OUT/$k/part.
    done ;;
  fd)
    # the trained drafters in their builds: compiled AR vs chain vs tree, code and chat, identical tokens
    shift; prepare
    for build in ${@:-block feature}; do
      for set in ${SETS:-code chat}; do
        SPECPILOT_DRAFTER=${SPECPILOT_DRAFTER:-$(trained $build)} timeout ${BENCH_S:-150} python3 -m specpilot.cli bench $b/$build \
          --prompts $set --requests ${REQUESTS:-6} --max-new-tokens ${TOKENS:-256} \
          --engines compiled,compiled-spec,compiled-tree -o $OUT/e2e-smollm2-$build-$set.json 2>&1 | tail -8
      done
    done ;;
  fd-profile)
    # the host's side of a trained drafter's tree engine (cProfile of one code-set bench run), the stats to $OUT
    shift; prepare
    SPECPILOT_DRAFTER=$(trained $1) timeout ${PROFILE_S:-200} python3 -m cProfile -o $OUT/fd-profile-$1.pstats \
      -m specpilot.cli bench $b/$1 --prompts code --requests ${REQUESTS:-2} --max-new-tokens ${TOKENS:-256} \
      --engines ${PROFILE_ENGINES:-compiled,compiled-tree} -o $OUT/fd-profile-$1.json 2>&1 | tail -4
    python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(25)
s.sort_stats('cumtime').print_stats('specpilot', 30)" $OUT/fd-profile-$1.pstats | cut -c1-150 ;;
  packed-verify)
    # bench/packed_verify.py: a batch build's verification padded against packed (tree-verify{packed=true}),
    # PV_ARGS: its options, to $OUT
    shift; setup; unpack
    timeout ${PV_S:-200} python3 bench/packed_verify.py $b/$1 ${PV_ARGS:-} --out $OUT 2>&1 | tail -${TAIL:-6} ;;
  cost)
    # a drafting cycle beside an AR step of the same build (bench/drafter_cost.py): SmolLM2's (--params load:
    # the GGUF staged) at a 1k context, the 27B-class one (seeded) at 4k (CONTEXT: another); COST_ARGS: more
    # options (--batches 2,4,...: a batch build's cycles in one call against a call each)
    shift; setup; unpack
    [ -f $E/smolpart.aa ] && { assemble || echo "the GGUF's parts are not all staged: SmolLM2 builds cannot load"; }
    for build in "$@"; do
      context=1024; grep -q '"num_hidden_layers": 64' $b/$build/manifest.json && context=4096
      timeout ${COST_S:-300} python3 bench/drafter_cost.py $b/$build --context ${CONTEXT:-$context} ${COST_ARGS:-} \
        --out $OUT 2>&1 | tail -${TAIL:-8}
    done ;;
  *) echo "usage: $0 stage DIR... | smol [BUILD...] | serve [BUILD] | full-check | full-ref BUILD | full-sweep BUILD | full-batch BUILD | exact-batch BUILD... | batch-profile BUILD | timeline BUILD | pass-cost BUILD | packed-verify BUILD | skinny LIB | gdn LIB | smol-batch BUILD | train-drafters | fd [BUILD...] | fd-profile BUILD | cost BUILD..." >&2
     exit 2 ;;
esac
