#!/usr/bin/env bash
# Build the FP8 TensorRT engine and verify it against the bf16 reference, in one command, inside
# NVIDIA's TensorRT container (Docker + NVIDIA Container Toolkit + an FP8 GPU: Ada, Hopper,
# Blackwell). NOT executed on the machines fp8export is developed on (no Docker, no TensorRT):
# tests/engine/test_container_recipe.py checks the docker command with a fake docker only.
#
#   scripts/trt-container.sh MODEL.onnx REFERENCE_DIR DATA_FILE [OUT_DIR]
#
# Mounts (read-only except OUT_DIR): this checkout at /src, MODEL.onnx's folder at /in (so its
# .onnx.data travels with it), the bf16 checkpoint at /ref, the data file's folder at /data.
# Writes to OUT_DIR (default: ./trt-out): MODEL.engine, its .build.json/.layers.json/.trtexec.log
# (when trtexec builds), timing.cache, report/ (verify's report.json/.md/.html, junit.xml).
# Inside: installs fp8export (and with it a CUDA build of torch, for the reference and the engine
# I/O) into the container's Python, then `fp8export build-engine` (the tensorrt Python package
# when the image has it, else trtexec) and `fp8export verify REFERENCE ENGINE`.
# Environment: TRT_IMAGE (default below), BUILD_ARGS (extra build-engine options, e.g.
# "--shapes input_ids:1x1,4x128,8x512"), VERIFY_ARGS (extra verify options), DOCKER (default docker).
set -euo pipefail
if [ $# -lt 3 ] || [ $# -gt 4 ]; then
  echo "usage: scripts/trt-container.sh MODEL.onnx REFERENCE_DIR DATA_FILE [OUT_DIR]" >&2
  exit 2
fi
abs() { (cd "$(dirname "$1")" && printf '%s/%s' "$(pwd -P)" "$(basename "$1")"); }
for f in "$1" "$3"; do
  [ -f "$f" ] || { echo "Error: $f: no such file." >&2; exit 1; }
done
[ -d "$2" ] || { echo "Error: $2: no such folder (the bf16 reference checkpoint)." >&2; exit 1; }
onnx=$(abs "$1")
ref=$(abs "$2")
data=$(abs "$3")
out_dir=${4:-trt-out}
mkdir -p "$out_dir"
out=$(abs "$out_dir")
repo=$(cd "$(dirname "$0")/.." && pwd -P)
image=${TRT_IMAGE:-nvcr.io/nvidia/tensorrt:25.11-py3}
name=$(basename "$onnx" .onnx)

inner=$(cat <<EOF
export PATH="\$PATH:/opt/tensorrt/bin:/usr/src/tensorrt/bin"
mkdir -p /tmp/fp8export
tar -C /src --exclude=./.venv --exclude=./bench/_work --exclude=./demo-out -cf - . | tar -C /tmp/fp8export -xf -
python3 -m pip install -q /tmp/fp8export
fp8export build-engine /in/$(basename "$onnx") -o /out/$name.engine --timing-cache /out/timing.cache --force ${BUILD_ARGS:-}
fp8export verify /ref /out/$name.engine --data /data/$(basename "$data") --report-dir /out/report --force ${VERIFY_ARGS:-}
EOF
)

exec "${DOCKER:-docker}" run --rm --gpus all \
  -e PIP_BREAK_SYSTEM_PACKAGES=1 \
  -v "$repo:/src:ro" \
  -v "$(dirname "$onnx"):/in:ro" \
  -v "$ref:/ref:ro" \
  -v "$(dirname "$data"):/data:ro" \
  -v "$out:/out" \
  "$image" bash -euc "$inner"
