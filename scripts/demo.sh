#!/usr/bin/env bash
# The README's main job on the shipped sample LM (samples/tiny-llama): set up .venv, then
# inspect -> convert (static activation scales calibrated on held-apart text) -> export-onnx
# -> verify both the FP8 folder and its ONNX against the bf16 reference. Outputs in demo-out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
FP8=.venv/bin/fp8export
S=samples/tiny-llama
OUT=${DEMO_OUT:-demo-out}
mkdir -p "$OUT"
set -x
$FP8 inspect "$S/model" --plot "$OUT/scales.svg" --force | tail -n 12
$FP8 convert "$S/model" -o "$OUT/tiny-llama-fp8" --scales calibrate \
  --calib-data "$S/data/calib.txt" --calib-method max --force
$FP8 inspect "$OUT/tiny-llama-fp8" | tail -n 8
$FP8 export-onnx "$OUT/tiny-llama-fp8" -o "$OUT/tiny-llama-fp8.onnx" --dtype fp16 --force
# all 256 eval lines whole (--seq-len 256): the numbers of the README's accuracy table
$FP8 verify "$S/model" "$OUT/tiny-llama-fp8" --data "$S/data/eval.txt" --seq-len 256 \
  --report-dir "$OUT/report-torch-fp8" --force
$FP8 verify "$S/model" "$OUT/tiny-llama-fp8.onnx" --data "$S/data/eval.txt" --seq-len 256 \
  --report-dir "$OUT/report-onnx" --force
set +x
echo "demo done: reports in $OUT/report-*/ (report.md, report.html, report.json, junit.xml)"
