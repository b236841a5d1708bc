"""No code from a checkpoint ever runs: every transformers loading call in the package passes
``trust_remote_code=False`` (found by reading the source, so a new call cannot slip by)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (REPO / "fp8export", REPO / "calibration")
# transformers entry points that may import a checkpoint's auto_map code
LOADERS = {"from_pretrained", "from_config", "pipeline"}
FORBIDDEN = {"get_class_from_dynamic_module", "get_cached_module_file"}


def _calls(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            yield name, node


def _trusts_nothing(call: ast.Call) -> bool:
    return any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant)
               and k.value.value is False for k in call.keywords)


def test_every_transformers_loading_call_refuses_remote_code():
    offenders, seen = [], 0
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            for name, call in _calls(path):
                where = f"{path.relative_to(REPO)}:{call.lineno}"
                if name in FORBIDDEN:
                    offenders.append(f"{where}: {name} imports checkpoint code")
                elif name in LOADERS:
                    seen += 1
                    if not _trusts_nothing(call):
                        offenders.append(f"{where}: {name}(...) without trust_remote_code=False")
    assert seen >= 3, "the scan found no loading calls: did the package move?"
    assert not offenders, "\n".join(offenders)


def test_the_scan_catches_a_call_without_it(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import transformers\n"
                   "transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)\n"
                   "transformers.AutoModel.from_config(c, trust_remote_code=True)\n"
                   "transformers.AutoModel.from_config(c, trust_remote_code=False)\n")
    flagged = [call.lineno for name, call in _calls(bad)
               if name in LOADERS and not _trusts_nothing(call)]
    assert flagged == [2, 3]
