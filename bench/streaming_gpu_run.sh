#!/usr/bin/env bash
# One GPU call for layer streaming (bench/streaming_profile.py, bench/streaming.py): each step
# in its own process under a hard time limit (timeout -k), clipped to what is left of BUDGET_S;
# logs and JSONs land in $OUT.
#
#   OUT=/some/dir STEPS=install,profile,calibrate bash bench/streaming_gpu_run.sh
#
# Steps (default limit s): install (60); gpu_tests (90: the GPU tests of GPU_TESTS, default
# tests/streaming/test_stream.py); profile (200: streaming_profile.py, PROFILE_ARGS);
# calibrate (200: streaming.py (a) calibrate, streamed then whole via the device map,
# CALIB_ARGS); gptq (240: streaming.py (a) GPTQ streamed, GPTQ_ARGS); verify (240: (a) verify
# streamed, VERIFY_ARGS); gptq_kernel (200: bench/gptq_gpu.py, the GPTQ kernel against the
# torch loop, KERNEL_ARGS); plant (60: the kernel test against two planted arithmetic changes,
# each must fail; the tree is restored). calibrate, gptq and verify share one work folder (the model is
# written once). LIMIT_<STEP> changes a step's limit. Each step's log and files come back
# as $OUT/<step>.tgz (a call returns at most 8 files).
set -u
OUT=${OUT:?set OUT to the output folder}
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-560}
START=$(date +%s)
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
STEPS=${STEPS:-install,profile}
WORK=${WORK:-/tmp/fp8export-streaming-work}
export PYTHONUNBUFFERED=1 FP8EXPORT_NO_PROGRESS=1
elapsed() { echo $(( $(date +%s) - START )); }
want() { [[ ",$STEPS," == *",$1,"* ]]; }
step() {
  local name=$1 var="LIMIT_${1^^}" lim left t0 rc
  lim=${!var:-$2}
  left=$(( BUDGET - $(elapsed) - 5 ))
  (( lim > left )) && lim=$left
  shift 2
  if (( lim < 5 )); then echo "== $name: skipped (no time left)"; return; fi
  echo "== $name (limit ${lim}s, at $(elapsed)s)"
  mkdir -p "$OUT/$name"
  t0=$(date +%s)
  # each log line carries the seconds since the step began
  timeout -k 5 "$lim" "$@" 2>&1 | while IFS= read -r line; do
    printf '%4ds %s\n' $(( $(date +%s) - t0 )) "$line"; done > "$OUT/$name/log.txt"
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s"
  tail -n "${TAIL:-25}" "$OUT/$name/log.txt"
  # at most 8 files come back from a call: one archive per step
  tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
}
read -r -a PARGS <<< "${PROFILE_ARGS:-}"
read -r -a CARGS <<< "${CALIB_ARGS:-}"
read -r -a GARGS <<< "${GPTQ_ARGS:-}"
read -r -a VARGS <<< "${VERIFY_ARGS:-}"
read -r -a KARGS <<< "${KERNEL_ARGS:-}"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
want install && step install 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
want gpu_tests && step gpu_tests 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs \
  ${GPU_TESTS:-tests/streaming/test_stream.py}
want gptq_kernel && step gptq_kernel 200 "$PY" bench/gptq_gpu.py \
  --out "$OUT/gptq_kernel/gptq_gpu.json" "${KARGS[@]}"
want plant && step plant 60 bash -c '
  k=fp8export/numerics/gptq_kernel.py; cp "$k" /tmp/gptq_kernel.py.orig
  for p in "s/rtne/rtz/" "s/enable_fp_fusion=False/enable_fp_fusion=True/" "s/tl.math.div_rn(col, s)/(col \/ s)/"; do
    cp /tmp/gptq_kernel.py.orig "$k"; sed -i "$p" "$k"
    if cmp -s "$k" /tmp/gptq_kernel.py.orig; then echo "plant $p: did not apply"; continue; fi
    '"$PY"' -m pytest -q -p no:cacheprovider -m gpu tests/numerics/test_gptq_kernel.py >/tmp/plant.log 2>&1
    echo "plant $p: pytest exit $? ($(tail -n 1 /tmp/plant.log))"
  done
  cp /tmp/gptq_kernel.py.orig "$k"'
want profile && step profile 200 "$PY" bench/streaming_profile.py --out "$OUT/profile" "${PARGS[@]}"
want calibrate && step calibrate 200 "$PY" bench/streaming.py --parts a --steps calibrate \
  --whole map --work "$WORK" --out "$OUT/calibrate/calibrate.json" "${CARGS[@]}"
want gptq && step gptq 240 "$PY" bench/streaming.py --parts a --steps gptq --whole none \
  --work "$WORK" --out "$OUT/gptq/gptq.json" "${GARGS[@]}"
want verify && step verify 240 "$PY" bench/streaming.py --parts a --steps verify --whole none \
  --work "$WORK" --out "$OUT/verify/verify.json" "${VARGS[@]}"
echo "done in $(elapsed)s"
