"""The Keras samples through the CLI with Keras, keras_hub and TensorFlow unimportable.

A fresh interpreter hides those packages from the import system before fp8export loads, then
runs ``convert`` → ``export-onnx`` → ``verify`` (against the FP8 folder and against the ONNX
graph) exactly as a user types them, and finally checks that none of the blocked packages was
imported. h5py stays: reading a ``.keras`` file needs it (the ``keras`` extra).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
DRIVER = r"""
import importlib.machinery, importlib.util, json, sys

BLOCKED = ("keras", "keras_hub", "keras_nlp", "tensorflow")


class Hiding(importlib.machinery.PathFinder):
    # The path finder that cannot see the blocked packages: exactly as if not installed
    # (importlib.util.find_spec gives None, import raises ModuleNotFoundError).
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [Hiding if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
assert Hiding in sys.meta_path and importlib.util.find_spec("keras") is None
from fp8export.cli import main

codes = [main(argv) for argv in json.loads(sys.argv[1])]
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print("RESULT", json.dumps({"codes": codes, "leaked": leaked}))
"""


def _commands(sample: str, tmp: Path, *, folder_verify: bool) -> list[list[str]]:
    model = SAMPLES / sample / "model" / "float8_model.keras"
    data = SAMPLES / sample / "data" / "eval.npz"
    out = tmp / sample
    # a quick run: 100 reviews (one flipped prediction is 1 point), so the loose preset
    verify = ["--data", str(data), "--samples", "100", "--batch-size", "50", "--thresholds",
              "loose"]
    commands = [
        ["convert", str(model), "-o", str(out / "fp8"), "--scales", "history"],
        ["export-onnx", str(out / "fp8"), "-o", str(out / "model.onnx")],
        ["verify", str(model), str(out / "model.onnx"), *verify, "--reference-dtype", "fp32",
         "--report-dir", str(out / "r-onnx")],
    ]
    if folder_verify:
        commands.append(["verify", str(model), str(out / "fp8"), *verify,
                         "--report-dir", str(out / "r-fp8")])
    return commands


def test_both_keras_samples_convert_export_and_verify_without_keras(tmp_path):
    samples = {"keras-hub-float8": True, "keras-float8": False}
    missing = [s for s in samples if not (SAMPLES / s / "model" / "float8_model.keras").is_file()]
    if missing:
        pytest.fail(f"sample checkpoints missing: {missing}")
    commands = [c for s, full in samples.items()
                for c in _commands(s, tmp_path, folder_verify=full)]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)],
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(line[len("RESULT "):])
    assert result["codes"] == [0] * len(commands), proc.stderr[-4000:]
    assert result["leaked"] == []
    assert proc.stderr.count("PASSED | ") == len(commands)
    reports = [(s, "r-onnx") for s in samples] + [("keras-hub-float8", "r-fp8")]
    for sample, report in reports:
        m = json.loads((tmp_path / sample / report / "report.json").read_text())["metrics"]
        assert m["tokens"] == 100  # one prediction per review
        assert m["accuracy_candidate"] > 0.6 and abs(m["accuracy_drop"]) <= 0.03
        assert m["prob_max_abs"] < 0.1
