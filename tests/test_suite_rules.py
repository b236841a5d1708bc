"""Rules for the test suite itself, checked by reading its source.

Our own modules are never optional: ``pytest.importorskip("fp8export...")`` turns a broken
module into a quiet skip, so a regression that breaks an import would pass CI as "skipped".
Import them plainly; a broken module then fails the tests that need it.
"""

from __future__ import annotations

import ast
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
