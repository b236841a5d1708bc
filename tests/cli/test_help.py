"""``fp8export --help`` must be instant: it imports no torch/onnx/transformers (a subprocess proves it)."""

import subprocess
import sys

HEAVY = ("torch", "onnx", "onnxruntime", "transformers", "keras", "tensorrt", "numpy")


def _imported_after(args: list[str]) -> set[str]:
    code = (
        "import sys\n"
        "from fp8export.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        f"print('MODULES', ' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = [l for l in out.stdout.splitlines() if l.startswith("MODULES")][-1]
    return set(line.split()[1:])


def test_top_level_help_imports_nothing_heavy():
    assert _imported_after(["--help"]) == set()


def test_every_command_help_imports_nothing_heavy():
    from fp8export.cli import COMMANDS, LazyGroup

    for name in COMMANDS:
        if LazyGroup._load(name) is None:
            continue
        assert _imported_after([name, "--help"]) == set(), name


def test_version(run_cli):
    result = run_cli("--version")
    assert result.exit_code == 0
    assert "fp8export" in result.output
