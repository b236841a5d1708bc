"""The wheel users install: every module is in it, the dependencies match what commands import.

The wheel is built from this checkout (``pip wheel --no-deps``), as a user's ``pip install``
builds it. The full install test (a fresh venv, every command through the console script on
the shipped samples) is ``scripts/install_check.sh``, which CI runs.
"""

from __future__ import annotations

import email
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    try:
        import setuptools  # noqa: F401  build with this venv's setuptools: no index needed

        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "-w", str(out), str(REPO)], check=True, capture_output=True, text=True)
    (path,) = out.glob("fp8export-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def _metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


def test_every_source_module_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "fp8export").rglob("*.py")}
    expected |= {"fp8export/calibration/" + p.relative_to(REPO / "calibration").as_posix()
                 for p in (REPO / "calibration").rglob("*.py")}
    expected = {n for n in expected if "__pycache__" not in n}
    missing = sorted(expected - names)
    assert not missing, f"modules left out of the wheel: {missing}"
    assert "fp8export/inspect/__init__.py" in names  # once forgotten by a hand-kept list
    assert not any(n.startswith(("tests/", "calibration/", "samples/")) for n in names)


def test_console_script_entry_point(wheel):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "fp8export = fp8export.cli:main" in wheel.read(name).decode()


def test_core_dependencies_cover_the_common_path(wheel):
    meta = _metadata(wheel)
    requires = meta.get_all("Requires-Dist") or []
    core = {r.split(">")[0].split("=")[0].split("[")[0].strip().lower().replace("_", "-")
            for r in requires if "extra ==" not in r}
    # export-onnx traces with torch.onnx.export(dynamo=True), which needs onnxscript
    for pkg in ("torch", "safetensors", "onnx", "onnxscript", "onnxruntime", "transformers",
                "click", "numpy", "ml-dtypes", "tqdm", "pyyaml"):
        assert pkg in core, f"{pkg} is not a core dependency"
    # Keras reading is an extra (h5py only: fp8export never imports Keras), never required
    assert "h5py" not in core and "keras" not in core
    keras = [r for r in requires if 'extra == "keras"' in r]
    assert [r.split(";")[0].split(">")[0].strip() for r in keras] == ["h5py"]
    assert "keras" in (meta.get_all("Provides-Extra") or [])


def test_pytest_runs_from_a_checkout_that_is_not_installed():
    """``python -m pytest`` from the checkout's root, with the editable install's finder (which
    maps ``calibration/`` to ``fp8export.calibration``) removed, as in a fresh checkout or a venv
    holding another install: the calibration tests still collect."""
    code = ("import sys, pytest\n"
            "sys.meta_path[:] = [f for f in sys.meta_path\n"
            "                    if not getattr(f, '__module__', '').startswith('__editable__')]\n"
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider',\n"
            "                      'tests/calibration']))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "ERROR " not in done.stdout, done.stdout[-3000:]
    assert "tests/calibration/test_cli.py::" in done.stdout
