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
# may run beside it; then two --warm-only processes compile the decode steps and the compiled
# prefill once in the background (Inductor's on-disk caches, 8 compile threads each) while the
# GPU tests (90) and the memory step (45: the largest decode batch in 8 GiB and the logits
# check; neither is a timing) run; then, alone again: decode with CUDA graphs at batch 1/8/32
# (100) and compiled prefill 8x2048/32x512/1x128 (100); the report (10).
# Environment: BUDGET_S (default 345), PYTHON (default python3), LIMIT_<STEP> to change one
# step's limit (STEP in upper case; 0 skips it), REPORT_RESERVE_S (seconds kept for the report,
# default 10).
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

elapsed() { echo $(( $(date +%s) - START )); }

# limit NAME DEFAULT [RESERVE]: the step's limit, clipped to the budget left minus RESERVE
limit() {
  local var="LIMIT_$(echo "$1" | tr '[:lower:]-' '[:upper:]_')"
  local want=${!var:-$2} left=$(( BUDGET - $(elapsed) - ${3:-$REPORT_RESERVE} ))
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

BENCH=("$PY" bench/gpu_fp8.py --no-logits-check --parts)

step install 45 "$PY" -m pip install --no-deps --no-build-isolation -e .

step eager 50 "${BENCH[@]}" eager --shapes 1x512 --out "$OUT/eager.json"

# compile caches, in the background, while the GPU tests and the memory step run
WLIM=$(limit warm 150 130)
W=()
if (( WLIM >= 5 )); then
  TORCHINDUCTOR_COMPILE_THREADS=8 timeout -k 5 "$WLIM" "${BENCH[@]}" decode --decode-eager '' \
    --warm-only --out "$OUT/warm_decode.json" > "$OUT/warm_decode.log" 2>&1 &
  W+=($!)
  TORCHINDUCTOR_COMPILE_THREADS=8 timeout -k 5 "$WLIM" "${BENCH[@]}" compiled --warm-only \
    --out "$OUT/warm_compiled.json" > "$OUT/warm_compiled.log" 2>&1 &
  W+=($!)
fi
step gpu_tests 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs \
  tests/runtime/test_fp8_attention_gpu.py --junitxml "$OUT/gpu_tests.xml"
step memory 45 "$PY" bench/gpu_fp8.py --parts memory --out "$OUT/memory.json"
t0=$(date +%s)
for pid in "${W[@]}"; do wait "$pid"; echo "warm process $pid exited $?"; done
printf 'warm (background, compile only)\t%s\t%s\t-\t0\n' "$(( $(date +%s) - t0 ))" \
  "$WLIM" >> "$STATUS"

step decode 100 "${BENCH[@]}" decode --decode-eager '' --out "$OUT/decode.json"
step compiled 100 "${BENCH[@]}" compiled --out "$OUT/compiled.json"
# sections.json: the status of every step, for the report (written here, without python)
NOTE="Each step ran in its own process under a hard time limit (bench/gpu_attention_run.sh); \
eager prefill ran first, alone."
if (( ${#W[@]} )); then
  NOTE="$NOTE The decode and compiled-prefill steps ran alone after --warm-only processes had \
compiled the same graphs beside the GPU tests and the memory step (Inductor's caches: \
fxgraph_cache_hit in each row's dynamo stats)."
fi
TESTS=$(tail -n 1 "$OUT/gpu_tests.log" 2>/dev/null | tr -d '"\\' | tr -s '=' | sed 's/^= *//; s/ *=$//')
{
  echo "{\"note\": \"$NOTE\", \"gpu_tests\": \"${TESTS:-not run}\","
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
for part in memory decode compiled eager; do
  [[ -s "$OUT/$part.json" ]] && JSONS+=("$OUT/$part.json")
done
REPORT_RESERVE=0 step report 10 "$PY" bench/gpu_fp8_report.py "${JSONS[@]}" \
  "$OUT/sections.json" --md "$OUT/gpu_fp8_attention.md"
echo "done in $(elapsed)s; $(wc -l < "$STATUS") steps in $STATUS"
