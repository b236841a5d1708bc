"""Rules for the test suite itself, checked by reading its source.

Our own modules are never optional: ``pytest.importorskip("fp8export...")`` turns a broken
module into a quiet skip, so a regression that breaks an import would pass CI as "skipped".
Import them plainly; a broken module then fails the tests that need it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
OURS = ("fp8export", "calibration")  # calibration/ is installed as fp8export.calibration


def _importorskips(source: str, name: str):
    """(line, module) of each importorskip call with a literal module name."""
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called == "importorskip" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            yield node.lineno, node.args[0].value


def _ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def test_no_test_skips_when_our_own_module_fails_to_import():
    offenders, seen = [], 0
    for path in sorted(TESTS.rglob("*.py")):
        for line, module in _importorskips(path.read_text(encoding="utf-8"), str(path)):
            seen += 1
            if _ours(module):
                offenders.append(f"{path.relative_to(TESTS.parent)}:{line}: {module}")
    assert seen > 5, "the scan found no importorskip at all: is it still reading the tests?"
    assert not offenders, "import our own modules plainly, never with importorskip:\n" + \
        "\n".join(offenders)


def test_the_rule_sees_every_spelling():
    source = '''
import pytest
from pytest import importorskip
api = pytest.importorskip("fp8export.api")
def f():
    importorskip("calibration.observers")
    pytest.importorskip("keras")
'''
    found = [m for _, m in _importorskips(source, "<example>")]
    assert found == ["fp8export.api", "calibration.observers", "keras"]
    assert [m for m in found if _ours(m)] == ["fp8export.api", "calibration.observers"]


def test_ci_runs_the_slow_tier():
    """The slow tier guards published numbers (the sample's accuracy table, the fault-injection
    gate, ONNX vs torch): .ci/run runs it unless told not to."""
    run = (TESTS.parent / ".ci" / "run").read_text()
    assert 'FP8EXPORT_SLOW=${FP8EXPORT_SLOW:-1} bash scripts/test.sh "$@"' in run
    assert not (TESTS.parent / ".ci" / "nightly").exists()  # nothing ran it


def test_ci_fails_when_the_keras_equivalence_tests_cannot_run(tmp_path):
    """Without keras_hub the Keras equivalence tests skip on a developer's machine, but under
    CI=true they are a collection error: the only comparison with real Keras never skips
    silently in CI."""
    blocked = tmp_path / "keras_hub"
    blocked.mkdir()
    (blocked / "__init__.py").write_text('raise ImportError("hidden for this test")\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "KERAS_BACKEND": "torch"}
    target = str(TESTS / "keras_model" / "test_vs_keras.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
           target]
    ci = subprocess.run(cmd, env={**env, "CI": "true"}, capture_output=True, text=True,
                        timeout=300, cwd=TESTS.parent)
    assert ci.returncode != 0 and "CI must run the Keras equivalence tests" in ci.stdout, \
        ci.stdout[-2000:]
    assert "hidden for this test" in ci.stdout


def test_a_session_leaves_nothing_in_the_temp_dir(tmp_path):
    """The suite's own scratch (the Hugging Face modules cache it points transformers at) is
    removed when the session ends: runs do not pile up empty folders in the system temp dir."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HF_MODULES_CACHE"}
    env.update(TMPDIR=str(temp))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(TESTS / "test_suite_rules.py"), "-k", "sees_every_spelling"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                         cwd=TESTS.parent)
    assert run.returncode == 0, run.stdout[-2000:]
    left = [p.name for p in temp.iterdir() if p.name.startswith("fp8export-test-")]
    assert left == []


def test_test_sh_runs_one_worker_per_cpu_each_file_whole():
    """scripts/test.sh spreads the files over xdist workers (`-n auto`, sized by conftest's
    hook); --dist loadfile keeps each file on one worker (its module fixtures and order); a
    crashed worker ends the run instead of being replaced (a replacement hangs the run)."""
    script = (TESTS.parent / "scripts" / "test.sh").read_text()
    assert ("-n \"$workers\" --dist loadfile --no-loadscope-reorder --max-worker-restart=0"
            in script)
    assert "workers=${FP8EXPORT_TEST_WORKERS:-auto}" in script


def test_auto_workers_follow_the_affinity_mask_and_memory(monkeypatch):
    """`-n auto` counts the CPUs this process may use (xdist's own count ignores the affinity
    mask and the cgroup quota) and leaves 3 GiB of memory to each worker."""
    from fp8export import _threads
    from tests import conftest

    monkeypatch.setattr(_threads, "_cgroup_quota", lambda: None)
    monkeypatch.setattr(conftest, "_available_memory", lambda: 64 << 30)
    monkeypatch.setattr(_threads, "_allowed_cpus", lambda: {0, 1, 2, 3})
    assert conftest.pytest_xdist_auto_num_workers(None) == 4
    monkeypatch.setattr(_threads, "_allowed_cpus", lambda: {3})
    assert conftest.pytest_xdist_auto_num_workers(None) == 1
    monkeypatch.setattr(_threads, "_allowed_cpus", lambda: set(range(64)))
    monkeypatch.setattr(_threads, "_cgroup_quota", lambda: 2)
    assert conftest.pytest_xdist_auto_num_workers(None) == 2
    monkeypatch.setattr(_threads, "_cgroup_quota", lambda: None)
    monkeypatch.setattr(conftest, "_available_memory", lambda: 7 << 30)
    assert conftest.pytest_xdist_auto_num_workers(None) == 2
    monkeypatch.setattr(conftest, "_available_memory", lambda: 1 << 30)
    assert conftest.pytest_xdist_auto_num_workers(None) == 1
