"""The package's imports follow the pipeline: no stage imports a later one.

Every ``import`` and ``from ... import`` in ``fp8export/`` and ``calibration/`` (installed as
``fp8export.calibration``) is parsed with ``ast``, function-level imports included, and checked
against :data:`STAGES`. Modules import each other by name only through ordinary import
statements (no ``importlib``/``__import__`` by string), and never take another module's private
(``_name``) names. docs/architecture.md describes the stages.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# In pipeline order. A unit is a subpackage or a top-level module of fp8export; a unit may
# import its own stage and earlier ones. Units of one stage do not import each other where a
# later stage is listed separately.
STAGES: list[tuple[str, set[str]]] = [
    ("foundation", {"fp8export", "errors", "config", "notes", "_lazy", "_progress",
                    "_time_limit", "_timings", "_threads", "cpu_gemm", "numerics", "io",
                    "placement", "distributed"}),
    ("read", {"checkpoint"}),
    ("scales", {"scales"}),
    ("fp8 folder", {"fp8dir"}),
    ("models", {"models", "moe", "keras_model"}),
    ("inputs", {"inputs"}),
    ("runtime", {"runtime"}),
    ("streaming", {"streaming"}),
    ("calibration", {"calibration"}),
    ("plots", {"plots"}),
    ("onnx", {"onnx"}),
    ("engine", {"engine"}),
    ("runners", {"runners"}),
    ("inspect", {"inspect"}),
    ("analysis", {"analysis"}),
    ("convert", {"convert"}),
    ("verify", {"verify"}),
    ("reports", {"reports"}),
    ("front", {"api", "commands", "cli"}),
]
STAGE_OF = {unit: i for i, (_, units) in enumerate(STAGES) for unit in units}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for the installed layout."""
    out = {}
    for root, prefix in ((REPO / "fp8export", "fp8export"),
                         (REPO / "calibration", "fp8export.calibration")):
        for path in sorted(root.rglob("*.py")):
            if path.is_relative_to(REPO / "fp8export" / "calibration"):
                continue  # a developer's link to calibration/, not part of the tree
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((prefix, *parts))] = path
    return out


MODULES = _modules()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path, module: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every fp8export import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [a.name for a in node.names]
            # `from fp8export import scales` names a submodule, not an attribute
            subs = [n for n in names if f"{base}.{n}" in MODULES]
            found += [(node.lineno, f"{base}.{n}", []) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                found.append((node.lineno, base, rest))
    return [f for f in found if f[1] == "fp8export" or f[1].startswith("fp8export.")]


def test_every_unit_has_a_stage():
    units = {_unit(m) for m in MODULES}
    assert units - set(STAGE_OF) == set(), "add new packages to STAGES (and architecture.md)"


def test_no_stage_imports_a_later_stage():
    bad = []
    for module, path in MODULES.items():
        here = STAGE_OF[_unit(module)]
        for line, target, _ in _imports(path, module):
            there = STAGE_OF.get(_unit(target))
            if there is not None and there > here:
                bad.append(f"{path.relative_to(REPO)}:{line}: {module} ({STAGES[here][0]}) "
                           f"imports {target} ({STAGES[there][0]})")
    assert not bad, "\n".join(bad)


def test_no_module_takes_another_modules_private_names():
    bad = []
    for module, path in MODULES.items():
        for line, target, names in _imports(path, module):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != module:
                bad.append(f"{path.relative_to(REPO)}:{line}: from {target} import "
                           f"{', '.join(private)}")
    assert not bad, "\n".join(bad)


def test_no_import_by_string():
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}(...)")
    assert not bad, "\n".join(bad)


def test_the_graph_test_sees_imports():
    """The parser finds function-level imports (the checks above would pass on an empty list)."""
    path = MODULES["fp8export.convert.activation"]
    targets = {t for _, t, _ in _imports(path, "fp8export.convert.activation")}
    assert "fp8export.calibration.api" in targets  # imported inside a function
    assert "fp8export.scales.history" in targets


# Each verb's config lives with its stage; the foundation's config.py holds only shared enums.
VERB_CONFIGS = {"ConvertConfig": "convert", "CalibrateConfig": "calibration",
                "ExportOnnxConfig": "onnx", "BuildEngineConfig": "engine",
                "VerifyConfig": "verify"}


def test_each_verbs_config_lives_with_its_stage():
    homes: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in VERB_CONFIGS:
                homes.setdefault(node.name, []).append(_unit(module))
    assert homes == {name: [unit] for name, unit in VERB_CONFIGS.items()}
    shared = ast.parse(MODULES["fp8export.config"].read_text(encoding="utf-8"))
    assert not [n.name for n in shared.body
                if isinstance(n, ast.ClassDef) and n.name.endswith("Config")]
