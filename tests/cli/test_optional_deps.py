"""A plain install (no extras): optional packages are imported only by the inputs that need them.

Each run is a subprocess in which the extras' packages cannot be imported (``sys.modules[name]
= None`` makes ``import name`` raise ImportError), as on a machine where they were never
installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parents[2] / "samples"

EXTRAS = ("h5py", "keras", "matplotlib", "tensorrt", "compressed_tensors", "sentence_transformers")


def _run_without_extras(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys\n"
            f"for name in {EXTRAS!r}:\n    sys.modules[name] = None\n"
            "from fp8export.cli import main\n"
            f"sys.exit(main({[str(a) for a in args]!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "CI": "1"}, timeout=300)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_convert_and_inspect_of_a_safetensors_folder_need_no_extra(tmp_path):
    out = tmp_path / "fp8"
    res = _run_without_extras("convert", SAMPLES / "tiny-llama" / "model", "-o", out)
    assert res.returncode == 0, res.stderr
    assert _lines(res.stderr)[-1].startswith("PASSED | convert | ")
    res = _run_without_extras("inspect", out)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("source", ["model", "model/float8_model.keras"])
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_keras_input_without_the_extra_is_one_error_naming_it(tmp_path, command, source):
    args = [command, SAMPLES / "keras-float8" / source]
    if command == "convert":
        args += ["-o", tmp_path / "out"]
    res = _run_without_extras(*args)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in _lines(res.stderr) if line.startswith("Error:")]
    assert len(errors) == 1 and "pip install 'fp8export[keras]'" in errors[0], res.stderr
    assert _lines(res.stderr)[-1].startswith(f"FAILED | {command} | ")
    assert not (tmp_path / "out").exists()
