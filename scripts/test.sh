#!/usr/bin/env bash
# The README's test command (.ci/run calls it): set up .venv, then run the test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/numerics -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing (exit 5 must not pass as success)" >&2
  exit 1
fi
exit "$rc"
