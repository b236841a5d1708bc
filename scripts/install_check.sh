#!/usr/bin/env bash
# fp8export as a user installs it (CI runs this; .ci/run): build the wheel, install it into a
# fresh venv with torch==2.13.0 first and no extras, and run every command through the
# installed console script on the shipped samples — --help of each, the shipped FP8 gate
# (scripts/fp8_gate.sh: inspect, calibrated convert, export-onnx, verify of the folder and the
# ONNX), calibrate, inspect of the ONNX, build-engine without TensorRT, and a Keras input
# without the keras extra. Then `pip install 'fp8export[keras]'` into the same venv and convert
# the Keras sample from its folder and from its .keras file, export it to ONNX and verify the
# folder and the ONNX against the .keras reference.
#
# Every step checks the exit code and the last stderr line (PASSED/FAILED | <cmd> | <s>).
# Settings, from the environment:
#   PYTHON          interpreter for the venv            (default python3)
#   VERIFY_SAMPLES  eval samples per verify             (default 32; empty: all 256)
#   CALIB_SAMPLES   calibration samples for the gate    (default 64; empty: all 256)
#   KEEP_WORK=1     keep the work folder (printed at the start)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
export VERIFY_SAMPLES=${VERIFY_SAMPLES-32} CALIB_SAMPLES=${CALIB_SAMPLES-64}
export CI=${CI:-true} PIP_DISABLE_PIP_VERSION_CHECK=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fp8export-install-check.XXXXXX")
[ "${KEEP_WORK:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
echo "install-check: work folder $WORK"
passed=0
failed=0
started=$(date +%s)

ok() { passed=$((passed + 1)); echo "  ok: $1"; }
bad() { failed=$((failed + 1)); echo "  FAILED: $1" >&2; }

# expect RC CMD_NAME [GREP] -- command...: run it, check its exit code, its last stderr line and,
# when GREP is given, that its output contains GREP (fixed string).
expect() {
  local want=$1 name=$2 pattern=$3
  shift 4
  local log="$WORK/step-$((passed + failed)).log" rc last
  local t0=$SECONDS
  "$@" >"$log.out" 2>"$log.err"
  rc=$?
  last=$(grep -v '^[[:space:]]*$' "$log.err" | tail -n 1)
  local what="fp8export ${*:2} (exit $rc, want $want, $((SECONDS - t0))s)"
  local status_word=PASSED
  [ "$want" -ne 0 ] && status_word=FAILED
  if [ "$rc" -ne "$want" ]; then
    bad "$what"; tail -n 30 "$log.out" "$log.err" >&2
  elif [ "$name" != "-" ] && [[ "$last" != "$status_word | $name | "* ]]; then
    bad "$what: last stderr line is '$last', want '$status_word | $name | ...'"
  elif [ -n "$pattern" ] && ! grep -qF -- "$pattern" "$log.out" "$log.err"; then
    bad "$what: output lacks '$pattern'"; tail -n 30 "$log.err" >&2
  elif grep -q "Traceback" "$log.err"; then
    bad "$what: printed a traceback"; tail -n 30 "$log.err" >&2
  else
    ok "$what"
  fi
}

echo "== build the wheel (from the tracked files, as pip builds it for a user)"
SRC="$WORK/src"
mkdir -p "$SRC"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$REPO" ls-files -z --cached --others --exclude-standard \
    | (cd "$REPO" && xargs -0 cp --parents -t "$SRC" 2>/dev/null)
else
  cp -r "$REPO/." "$SRC"
fi
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$SRC" || { echo "wheel build failed" >&2; exit 1; }
WHEEL=$(ls "$WORK"/dist/fp8export-*.whl)
echo "  $(basename "$WHEEL")"

echo "== fresh venv: torch==2.13.0 first (the CPU wheel), then the wheel, no extras"
t0=$SECONDS
"$PY" -m venv "$WORK/venv"
# --no-compile: byte-compiling torch's thousands of modules is most of an install's CPU time,
# and Python compiles what it imports anyway; what gets installed is the same.
VPIP=("$WORK/venv/bin/python" -m pip install -q --no-compile)
"${VPIP[@]}" "torch==2.13.0" || { echo "torch install failed" >&2; exit 1; }
"${VPIP[@]}" "$WHEEL" || { echo "wheel install failed" >&2; exit 1; }
echo "  installed in $((SECONDS - t0))s"
"$WORK/venv/bin/python" -m pip check >/dev/null && ok "pip check" || bad "pip check"
for pkg in keras h5py compressed_tensors pytest; do  # a plain install pulls no extra
  if "$WORK/venv/bin/python" -c "import $pkg" 2>/dev/null; then bad "$pkg installed"; fi
done
export PATH="$WORK/venv/bin:$PATH"
[ "$(command -v fp8export)" = "$WORK/venv/bin/fp8export" ] && ok "console script" \
  || bad "fp8export on PATH is $(command -v fp8export)"

# Run from outside the checkout: the installed package, never the source tree, is tested.
cd "$WORK"
S="$REPO/samples"
LM="$S/tiny-llama"
K="$S/keras-float8"

echo "== the compiled E4M3 helper, and convert without it (no compiler at install): same bytes"
SO=$("$WORK/venv/bin/python" -c "import importlib.util as u
s = u.find_spec('fp8export.numerics._fp8lut'); print(s.origin if s else '')")
if [ -z "$SO" ]; then
  bad "the wheel has no compiled helper (fp8export.numerics._fp8lut)"
else
  expect 0 convert "" -- fp8export convert "$LM/model" -o "$WORK/with-helper"
  mv "$SO" "$SO.away"
  expect 0 convert "" -- fp8export convert "$LM/model" -o "$WORK/without-helper"
  mv "$SO.away" "$SO"
  if diff -r "$WORK/with-helper" "$WORK/without-helper" >/dev/null; then
    ok "convert without the helper wrote the same bytes"
  else
    bad "convert without the helper wrote different bytes"
  fi
fi

echo "== --help of every command"
expect 0 - "convert" -- fp8export --help
for cmd in convert calibrate export-onnx build-engine verify inspect; do
  expect 0 - "Usage: fp8export $cmd" -- fp8export "$cmd" --help
done

echo "== the shipped FP8 gate (scripts/fp8_gate.sh, as .github/workflows/fp8-gate.yml runs it)"
t0=$SECONDS
if MODEL="$LM/model" CALIB_DATA="$LM/data/calib.txt" EVAL_DATA="$LM/data/eval.txt" \
    OUT="$WORK/build" REPORTS="$WORK/fp8-report" bash "$REPO/scripts/fp8_gate.sh" \
    >"$WORK/gate.log" 2>&1; then
  ok "fp8_gate.sh ($((SECONDS - t0))s)"
else
  bad "fp8_gate.sh exited $? ($((SECONDS - t0))s)"; tail -n 60 "$WORK/gate.log" >&2
fi
for r in folder onnx; do
  if [ -f "$WORK/fp8-report/$r/report.json" ] && grep -q '"passed": true' \
      "$WORK/fp8-report/$r/report.json"; then ok "report $r passed"; else bad "report $r"; fi
done

echo "== the other commands"
expect 0 calibrate "calibrated" -- fp8export calibrate "$LM/model" --calib-data \
  "$LM/data/calib.txt" --calib-samples 32 -o "$WORK/amax.json"
expect 0 convert "from calibration" -- fp8export convert "$LM/model" -o "$WORK/from-amax" \
  --calib-amax "$WORK/amax.json"
expect 0 inspect "checks OK" -- fp8export inspect "$WORK/build/model-fp8.onnx"
expect 1 build-engine "fp8export[tensorrt]" -- fp8export build-engine \
  "$WORK/build/model-fp8.onnx" -o "$WORK/model.engine"
expect 2 convert "needs --calib-data" -- fp8export convert "$LM/model" -o "$WORK/x" \
  --scales calibrate
expect 2 verify "neither a preset" -- fp8export verify "$LM/model" "$WORK/build/model-fp8" \
  --thresholds bogus

echo "== Keras input without the keras extra: one clear error naming it"
expect 1 convert "pip install 'fp8export[keras]'" -- fp8export convert "$K/model" \
  -o "$WORK/keras-noextra"

echo "== pip install 'fp8export[keras]' (the same wheel, the extra added)"
"${VPIP[@]}" "$WHEEL[keras]" || { echo "keras extra install failed" >&2; exit 1; }
expect 0 convert "from history" -- fp8export convert "$K/model" -o "$WORK/keras-folder-fp8" \
  --scales history
expect 0 convert "from history" -- fp8export convert "$K/model/float8_model.keras" \
  -o "$WORK/keras-fp8" --scales history
if cmp -s "$WORK/keras-folder-fp8/model.safetensors" "$WORK/keras-fp8/model.safetensors"; then
  ok "the folder and its .keras file convert to the same weights"
else
  bad "the folder and its .keras file convert differently"
fi
expect 0 export-onnx "FP8-eligible GEMMs" -- fp8export export-onnx "$WORK/keras-fp8" \
  -o "$WORK/keras-fp8.onnx"
expect 0 verify "PASSED: 200 samples" -- fp8export verify "$K/model/float8_model.keras" \
  "$WORK/keras-fp8" --data "$K/data/eval.npz" --samples 200 --report-dir "$WORK/keras-report/folder"
expect 0 verify "PASSED: 200 samples" -- fp8export verify "$K/model/float8_model.keras" \
  "$WORK/keras-fp8.onnx" --data "$K/data/eval.npz" --samples 200 \
  --report-dir "$WORK/keras-report/onnx"

echo "install-check: $passed passed, $failed failed in $(($(date +%s) - started))s"
[ "$failed" -eq 0 ]
