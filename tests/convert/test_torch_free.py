"""convert's default path (safetensors in, per-tensor scales from the weights) runs without
importing torch or any other heavy library (start-up is part of every convert's time); a path
that needs a model still gets torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama"
_RUN = ("import sys; from fp8export.cli import main\n"
        "assert main(sys.argv[1:]) == 0\n"
        "print('LOADED', *sorted({m.split('.')[0] for m in sys.modules}))\n"
        "print('TORCH', 'torch' in sys.modules)")
# What the default convert needs is numpy, ml_dtypes, safetensors (the real reader, for
# read-back) and click; each of these costs 0.1-2 s of imports.
HEAVY = {"torch", "transformers", "onnx", "onnxruntime", "scipy", "pandas", "keras",
         "tensorflow", "jax", "huggingface_hub", "tokenizers", "datasets", "accelerate",
         "sklearn", "matplotlib", "tqdm", "compressed_tensors", "modelopt", "tensorrt",
         "sympy", "PIL", "yaml", "jinja2", "requests"}


def _run(*args) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _RUN, "convert", *map(str, args)],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip().splitlines()


def _torch_loaded(*args) -> bool:
    return _run(*args)[-1] == "TORCH True"


def test_default_convert_imports_no_heavy_library(tmp_path):
    lines = _run(SAMPLE / "model", "-o", tmp_path / "a")
    loaded = set(next(line for line in lines if line.startswith("LOADED ")).split()[1:])
    assert {"numpy", "fp8export"} <= loaded  # the list is real
    assert loaded & HEAVY == set()
    assert (tmp_path / "a" / "model.safetensors").is_file()


def test_calibration_imports_torch(tmp_path):
    assert _torch_loaded(SAMPLE / "model", "-o", tmp_path / "b", "--calib-data",
                         SAMPLE / "data" / "calib.txt", "--calib-samples", "2", "--seq-len", "8")
