#!/usr/bin/env bash
# The FP8 accuracy gate: convert MODEL to FP8 with static input scales calibrated on CALIB_DATA,
# export its ONNX, and verify both against the bf16 reference logits on EVAL_DATA.
#
# .github/workflows/fp8-gate.yml runs this script, and so does CI (scripts/install_check.sh, on
# a fresh wheel install), so the gate we ship is the gate we test. It calls the `fp8export`
# found on PATH. Settings, from the environment:
#   MODEL          the bf16 checkpoint            (default samples/tiny-llama/model)
#   CALIB_DATA     calibration samples            (default samples/tiny-llama/data/calib.txt)
#   EVAL_DATA      evaluation samples             (default samples/tiny-llama/data/eval.txt)
#   THRESHOLDS     strict | default | loose | path/to/thresholds.yaml   (default default)
#   OUT            FP8 folder and .onnx go here   (default build)
#   REPORTS        verify reports go here         (default fp8-report)
#   CALIB_SAMPLES  use at most N calibration samples (default: fp8export's, 512)
#   VERIFY_SAMPLES use at most N eval samples     (default: all)
#
# Exit status: 0 when everything passed; 3 when verify ran and a candidate missed its
# thresholds (and nothing else failed); otherwise the first other failure's status (1 bad input
# or environment, 2 usage). Both verifications run even when the first fails.
set -uo pipefail

MODEL=${MODEL:-samples/tiny-llama/model}
CALIB_DATA=${CALIB_DATA:-samples/tiny-llama/data/calib.txt}
EVAL_DATA=${EVAL_DATA:-samples/tiny-llama/data/eval.txt}
THRESHOLDS=${THRESHOLDS:-default}
OUT=${OUT:-build}
REPORTS=${REPORTS:-fp8-report}
SAMPLES=()
if [ -n "${VERIFY_SAMPLES:-}" ]; then SAMPLES=(--samples "$VERIFY_SAMPLES"); fi
CALIB=()
if [ -n "${CALIB_SAMPLES:-}" ]; then CALIB=(--calib-samples "$CALIB_SAMPLES"); fi
export FP8EXPORT_NO_PROGRESS=${FP8EXPORT_NO_PROGRESS:-1}  # one [stage] line per step in logs

status=0
record() {  # fold one step's exit code into the gate's
  local rc=$1
  if [ "$rc" -ne 0 ] && { [ "$status" -eq 0 ] || [ "$status" -eq 3 ]; }; then status=$rc; fi
}

step() {  # step "title" command...: run one step, grouped and annotated on GitHub Actions
  local title=$1 rc
  shift
  if [ "${GITHUB_ACTIONS:-}" = true ]; then echo "::group::$title"; else echo "== $title"; fi
  "$@"
  rc=$?
  [ "${GITHUB_ACTIONS:-}" = true ] && echo "::endgroup::"
  if [ "$rc" -eq 3 ]; then
    annotate "$title: the FP8 candidate failed its accuracy thresholds (exit 3); see $REPORTS"
  elif [ "$rc" -ne 0 ]; then
    annotate "$title: fp8export exited $rc (1: bad input or environment, 2: usage)"
  fi
  record "$rc"
  return "$rc"
}

annotate() {
  if [ "${GITHUB_ACTIONS:-}" = true ]; then echo "::error::$1"; else echo "gate: $1" >&2; fi
}

step "Inspect the checkpoint" fp8export inspect "$MODEL" || exit "$status"
step "Convert to FP8 (static input scales calibrated on $CALIB_DATA)" \
  fp8export convert "$MODEL" -o "$OUT/model-fp8" --scales calibrate --calib-data "$CALIB_DATA" \
  "${CALIB[@]}" --force || exit "$status"
step "Inspect the FP8 folder" fp8export inspect "$OUT/model-fp8" || exit "$status"
step "Export ONNX (fp16 Q/DQ graph, runs in onnxruntime)" \
  fp8export export-onnx "$OUT/model-fp8" -o "$OUT/model-fp8.onnx" --dtype fp16 --force
step "Verify the FP8 folder (torch FP8 runtime, per-layer attribution)" \
  fp8export verify "$MODEL" "$OUT/model-fp8" --data "$EVAL_DATA" --thresholds "$THRESHOLDS" \
  --per-layer --report-dir "$REPORTS/folder" --force "${SAMPLES[@]}"
if [ -f "$OUT/model-fp8.onnx" ]; then
  step "Verify the ONNX graph (onnxruntime)" \
    fp8export verify "$MODEL" "$OUT/model-fp8.onnx" --data "$EVAL_DATA" \
    --thresholds "$THRESHOLDS" --report-dir "$REPORTS/onnx" --force "${SAMPLES[@]}"
fi
if [ "$status" -eq 0 ]; then echo "gate: PASSED"; else echo "gate: FAILED (exit $status)"; fi
exit "$status"
