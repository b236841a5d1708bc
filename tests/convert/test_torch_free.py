"""convert's default path (safetensors in, per-tensor scales from the weights) runs without
importing torch; a path that needs a model still gets it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama"
_RUN = ("import sys; from fp8export.cli import main\n"
        "assert main(sys.argv[1:]) == 0\n"
        "print('TORCH', 'torch' in sys.modules)")


def _torch_loaded(*args) -> bool:
    r = subprocess.run([sys.executable, "-c", _RUN, "convert", *map(str, args)],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip().splitlines()[-1] == "TORCH True"


def test_default_convert_does_not_import_torch(tmp_path):
    assert not _torch_loaded(SAMPLE / "model", "-o", tmp_path / "a")
    assert (tmp_path / "a" / "model.safetensors").is_file()


def test_calibration_imports_torch(tmp_path):
    assert _torch_loaded(SAMPLE / "model", "-o", tmp_path / "b", "--calib-data",
                         SAMPLE / "data" / "calib.txt", "--calib-samples", "2", "--seq-len", "8")
