#!/usr/bin/env bash
# One GPU call for FP8 attention and the FP8 KV cache (H100/H200; torch + CUDA + Triton there):
# the GPU tests of the kernels against the CPU emulation, then bench/gpu_fp8.py's sections for
# the targets, bf16 in the same processes, and the report rendered from their JSONs. Each step
# runs in its own process under a hard time limit (timeout -k), clipped to what is left of
# BUDGET_S, so a stuck step cannot eat the call; everything lands in $OUT.
#
#   OUT=/some/dir bash bench/gpu_attention_run.sh
#
# Steps (limit s): install (45); eager prefill 1x512 (50), alone: it is host-bound, so nothing
# may run beside it; the attention kernel alone against SDPA, with its tile sweep (60), alone
# too; then --warm-only processes compile the decode steps and the compiled
# prefill once in the background (Inductor's on-disk caches, WARM_THREADS compile threads
# each) while the GPU tests (90) and the memory step (45: the largest decode batch in 8 GiB and
# the logits check; neither is a timing) run; then, alone again: decode with CUDA graphs at batch 1/8/32
# (100) and compiled prefill, one process per shape (compiled_8x2048 110, compiled_32x512 90,
# compiled_1x128 80: a shape that runs out of time costs only itself); the report (10).
# Environment: BUDGET_S (default 345), PYTHON (default python3), LIMIT_<STEP> to change one
# step's limit (STEP in upper case; 0 skips it; LIMIT_COMPILED is the default of every
# compiled_<shape> step), REPORT_RESERVE_S (seconds kept for the report, default 10), STEPS
# (the steps to run, comma separated, default all: install, eager, attention, warm, gpu_tests,
# memory, decode, compiled), GPU_TESTS (the test files of gpu_tests, default the attention kernel's),
# EAGER_SHAPES (default 1x512), COMPILE_SHAPES (default 8x2048,32x512,1x128), DECODE_BATCHES
# (compiled, default 1,8,32), BENCH_ARGS (more arguments for every gpu_fp8.py step, e.g.
# --host-profile), WARM_THREADS (Inductor compile threads of each warm process, default 8).
set -u
OUT=${OUT:?set OUT to the output folder}
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-345}
REPORT_RESERVE=${REPORT_RESERVE_S:-10}
START=$(date +%s)
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fp8export-inductor-cache}
STATUS="$OUT/sections.tsv"
: > "$STATUS"
STEPS=${STEPS:-install,eager,attention,warm,gpu_tests,memory,decode,compiled}
GPU_TESTS=${GPU_TESTS:-tests/runtime/test_fp8_attention_gpu.py}
EAGER_SHAPES=${EAGER_SHAPES:-1x512}
COMPILE_SHAPES=${COMPILE_SHAPES:-8x2048,32x512,1x128}
DECODE_BATCHES=${DECODE_BATCHES:-1,8,32}
WARM_THREADS=${WARM_THREADS:-8}
read -r -a EXTRA <<< "${BENCH_ARGS:-}"

elapsed() { echo $(( $(date +%s) - START )); }
want() { [[ ",$STEPS," == *",$1,"* ]]; }

# limit NAME DEFAULT [RESERVE]: the step's limit, clipped to the budget left minus RESERVE
# (LIMIT_<NAME>, else for compiled_<shape> LIMIT_COMPILED, else DEFAULT)
limit() {
  local var="LIMIT_$(echo "$1" | tr '[:lower:]-' '[:upper:]_')" group=
  [[ $1 == compiled_* ]] && group=LIMIT_COMPILED || group=$var
  local want=${!var:-${!group:-$2}} left=$(( BUDGET - $(elapsed) - ${3:-$REPORT_RESERVE} ))
  (( want < left )) && echo "$want" || echo "$left"
}

# step NAME DEFAULT_LIMIT CMD...: run CMD with its output in $OUT/NAME.log; record
# name, seconds, limit, exit code, stopped (124/137: the limit ended it) in sections.tsv
step() {
  local name=$1 lim t0 rc
  lim=$(limit "$1" "$2")
  shift 2
  if (( lim < 5 )); then
    printf '%s\t0\t%s\tskipped\t0\n' "$name" "$lim" >> "$STATUS"
    echo "== $name: skipped (no time left)"
    return
  fi
  echo "== $name (limit ${lim}s, at $(elapsed)s)"
  t0=$(date +%s)
  timeout -k 5 "$lim" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$(( $(date +%s) - t0 ))" "$lim" "$rc" \
    "$([[ $rc == 124 || $rc == 137 ]] && echo 1 || echo 0)" >> "$STATUS"
  tail -n 3 "$OUT/$name.log"
}

BENCH=("$PY" bench/gpu_fp8.py --no-logits-check "${EXTRA[@]}" --parts)

want install && step install 45 "$PY" -m pip install --no-deps --no-build-isolation -e .

want eager && step eager 50 "${BENCH[@]}" eager --shapes "$EAGER_SHAPES" --out "$OUT/eager.json"
want attention && step attention 60 "${BENCH[@]}" attention --out "$OUT/attention.json"

# compile caches, in the background, while the GPU tests and the memory step run
W=()
if want warm; then
  WLIM=$(limit warm 150 130)
  if (( WLIM >= 5 )) && want decode; then
    TORCHINDUCTOR_COMPILE_THREADS=$WARM_THREADS timeout -k 5 "$WLIM" "${BENCH[@]}" decode \
      --decode-eager '' --decode-compiled "$DECODE_BATCHES" --warm-only \
      --out "$OUT/warm_decode.json" > "$OUT/warm_decode.log" 2>&1 &
    W+=($!)
  fi
  if (( WLIM >= 5 )) && want compiled; then
    TORCHINDUCTOR_COMPILE_THREADS=$WARM_THREADS timeout -k 5 "$WLIM" "${BENCH[@]}" compiled \
      --warm-only --compile-shapes "$COMPILE_SHAPES" --out "$OUT/warm_compiled.json" \
      > "$OUT/warm_compiled.log" 2>&1 &
    W+=($!)
  fi
fi
read -r -a TEST_FILES <<< "$GPU_TESTS"
want gpu_tests && step gpu_tests 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs \
  "${TEST_FILES[@]}" --junitxml "$OUT/gpu_tests.xml"
want memory && step memory 45 "$PY" bench/gpu_fp8.py --parts memory --out "$OUT/memory.json"
if (( ${#W[@]} )); then
  t0=$(date +%s)
  for pid in "${W[@]}"; do wait "$pid"; echo "warm process $pid exited $?"; done
  printf 'warm (background, compile only)\t%s\t%s\t-\t0\n' "$(( $(date +%s) - t0 ))" \
    "$WLIM" >> "$STATUS"
fi

want decode && step decode 100 "${BENCH[@]}" decode --decode-eager '' \
  --decode-compiled "$DECODE_BATCHES" --out "$OUT/decode.json"
if want compiled; then
  declare -A CLIMIT=([8x2048]=110 [32x512]=90 [1x128]=80)
  for shape in ${COMPILE_SHAPES//,/ }; do
    step "compiled_$shape" "${CLIMIT[$shape]:-90}" "${BENCH[@]}" compiled \
      --compile-shapes "$shape" --out "$OUT/compiled_$shape.json"
  done
fi
# sections.json: the status of every step, for the report (written here, without python)
NOTE="Each step ran in its own process under a hard time limit (bench/gpu_attention_run.sh)."
want eager && NOTE="$NOTE Eager prefill ran first, alone."
if (( ${#W[@]} )); then
  NOTE="$NOTE The decode and compiled-prefill steps ran alone after --warm-only processes had \
compiled the same graphs beside the GPU tests and the memory step (Inductor's caches: \
fxgraph_cache_hit in each row's dynamo stats)."
fi
TESTS=$(tail -n 1 "$OUT/gpu_tests.log" 2>/dev/null | tr -d '"\\' | tr -s '=' | sed 's/^= *//; s/ *=$//')
{
  echo "{\"note\": \"$NOTE\", \"gpu_tests\": \"${TESTS:-not run}\","
  echo " \"gpu_test_files\": \"$GPU_TESTS\","
  echo ' "sections": {'
  first=1
  while IFS=$'\t' read -r name secs lim rc stopped; do
    (( first )) || echo ','
    first=0
    [[ $rc =~ ^[0-9]+$ ]] || rc="\"$rc\""
    printf '  "%s": {"seconds": %s, "limit_s": %s, "rc": %s, "timed_out": %s}' \
      "$name" "$secs" "$lim" "$rc" "$([[ $stopped == 1 ]] && echo true || echo false)"
  done < "$STATUS"
  echo '}}'
} > "$OUT/sections.json"

JSONS=()
for part in attention memory decode compiled_* eager; do
  for f in "$OUT"/$part.json; do
    [[ -s "$f" ]] && JSONS+=("$f")
  done
done
REPORT_RESERVE=0 step report 10 "$PY" bench/gpu_fp8_report.py "${JSONS[@]}" \
  "$OUT/sections.json" --md "$OUT/gpu_fp8_attention.md"
echo "done in $(elapsed)s; $(wc -l < "$STATUS") steps in $STATUS"
