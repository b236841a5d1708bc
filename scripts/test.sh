#!/usr/bin/env bash
# The README's test command (.ci/run calls it): set up .venv, lint with ruff (config in
# pyproject.toml), then run the test suite. Both run; either failing fails the command.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/numerics -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# llm-compressor in a venv of its own (its pins clash with the dev venv): the MoE peer tests
# (tests/families/test_llmcompressor_peer.py) compare against it, and skip without it.
if [ -n "${CI:-}" ] || [ -n "${FP8EXPORT_PEERS:-}" ]; then
  bash scripts/peer_venv.sh || echo "llm-compressor peer venv failed: its comparison tests skip" >&2
fi
set +e
.venv/bin/ruff check .
lint_rc=$?
# One pytest-xdist worker per CPU (tests/conftest.py: pytest_xdist_auto_num_workers;
# FP8EXPORT_TEST_WORKERS=N to choose, 0 for one process). Each test file runs whole on one
# worker (module fixtures built once, the file's order kept); the heavy files start first
# (tests/conftest.py: HEAVY_FIRST). A worker that crashes (a segfault in a C library) ends
# the run at once (--max-worker-restart=0): with a replacement worker, xdist 3.8's loadfile
# scheduler gives it no work and the run hangs.
workers=${FP8EXPORT_TEST_WORKERS:-auto}
if [ "$workers" = 0 ]; then xdist=(); else
  xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder --max-worker-restart=0)
fi
.venv/bin/python -m pytest -q "${xdist[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing (exit 5 must not pass as success)" >&2
  exit 1
fi
if [ "$lint_rc" -ne 0 ]; then
  echo "ruff found problems (exit $lint_rc): see above (\`ruff check --fix .\` fixes what it can)" >&2
  [ "$rc" -ne 0 ] || rc=$lint_rc
fi
exit "$rc"
