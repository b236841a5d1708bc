"""export-onnx FP8DIR on a folder converted from Keras dispatches to the Keras exporter."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "keras-float8"
pytestmark = [
    pytest.mark.slow,  # Keras convert + export: ~40-70 s on 2 cores
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(not (SAMPLE / "model" / "float8_model.keras").is_file(),
                       reason="Keras float8 sample not built"),
]


def test_keras_folder_via_cli(run_cli, tmp_path):
    if os.environ["KERAS_BACKEND"] != "torch":
        pytest.skip("runs Keras on the torch backend")
    pytest.importorskip("keras")
    import onnx

    from fp8export.api import convert
    from fp8export.config import ConvertConfig

    name = "kerasf8_model"
    if name not in sys.modules:  # registers the sample's custom layers, as a user script would
        spec = importlib.util.spec_from_file_location(name, SAMPLE / "model.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    convert(ConvertConfig(checkpoint=SAMPLE / "model" / "float8_model.keras",
                          output=tmp_path / "fp8", scales="history"))
    res = run_cli("export-onnx", tmp_path / "fp8", "-o", tmp_path / "m.onnx", "--dtype", "bf16")
    assert res.exit_code == 1 and "--dtype fp32" in res.output
    assert not (tmp_path / "m.onnx").exists()
    res = run_cli("export-onnx", tmp_path / "fp8", "-o", tmp_path / "m.onnx")
    assert res.exit_code == 0, res.output
    assert "fp32, opset 21" in res.output and "FP8-eligible GEMMs (TensorRT):" in res.output
    from fp8export.onnx.check import check_model

    report = check_model(tmp_path / "m.onnx")
    assert report.ok and report.fp8_gemms
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)
