#!/usr/bin/env bash
# Create .venv-peers: llm-compressor as a real peer (tests/peers/ run it in a subprocess).
# llmcompressor pins transformers and compressed-tensors to versions older than the dev venv's,
# so it gets a venv of its own: torch==2.13.0 (the local CPU wheel; a looser pin pulls CUDA)
# first, then llmcompressor with its own pins. Tests that need it skip, naming this script,
# when the venv is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FP8EXPORT_PEER_VENV:-.venv-peers}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
"$VENV/bin/pip" install -q --disable-pip-version-check "llmcompressor==0.14.0.1" "torch==2.13.0"
"$VENV/bin/python" -c "import llmcompressor, transformers, compressed_tensors; print('llmcompressor', llmcompressor.__version__, 'transformers', transformers.__version__, 'compressed-tensors', compressed_tensors.__version__)"
