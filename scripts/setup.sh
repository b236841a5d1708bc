#!/usr/bin/env bash
# Create .venv (if missing) with torch==2.13.0 (the local CPU wheel; a looser pin would pull
# GBs of CUDA packages) and fp8export installed editable with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
# keras-hub for the Keras tutorial sample and the Keras equivalence tests (which fail in CI
# without it): --no-deps because it declares tensorflow-text (and so TensorFlow), which its
# layers never import; the dev extra brought what it does import (the keras-hub-deps extra).
.venv/bin/pip install -q --disable-pip-version-check --no-deps "keras-hub==0.32.0"
