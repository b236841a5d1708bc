"""OrtRunner / OnnxReferenceRunner on a one-linear FP8 graph, against an ml_dtypes emulation."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx_graphs import single_linear_model
from onnx_reference import OnnxReferenceRunner

from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.reader import QuantLayer
from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3
from fp8export.runners.ort_runner import OrtRunner, graph_uses_bf16

W_SCALE = float(amax_to_scale(2.0))
IN_SCALE = float(amax_to_scale(4.0))


def _layer(input_scale=IN_SCALE) -> QuantLayer:
    w = torch.from_numpy(np.random.RandomState(0).uniform(-2, 2, (24, 16)).astype(np.float32))
    return QuantLayer("lin", quantize_e4m3(w, W_SCALE), "out_in", W_SCALE, input_scale)


def _save(tmp_path, **kw):
    input_scale = kw.pop("input_scale", IN_SCALE)
    path = tmp_path / "lin.onnx"
    onnx.save(single_linear_model(_layer(input_scale), **kw), str(path))
    return path


def _emulate(x: np.ndarray, input_scale=IN_SCALE) -> np.ndarray:
    """numpy + ml_dtypes: clamp, RNE cast to E4M3, dequantize, matmul (independent of torch)."""
    layer = _layer(input_scale)
    w = layer.weight.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    w = w * np.float32(W_SCALE)
    if input_scale is not None:
        q = np.clip(x.astype(np.float32) / np.float32(input_scale), -448, 448)
        x = q.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(input_scale)
    return x.astype(np.float32) @ w.T


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


X = np.random.RandomState(1).uniform(-6, 6, (2, 5, 16)).astype(np.float32)  # some saturate


def test_fp32_graph_matches_emulation(tmp_path):
    path = _save(tmp_path)
    with OrtRunner(path, providers=["CPUExecutionProvider"]) as r:
        y = r.infer({"x": X})["y"]
        # as InferenceSession(path) runs it: onnxruntime's own default level
        assert r.describe()["graph_optimization_level"] == "ORT_ENABLE_ALL"
        assert r.describe()["level_source"] == "onnxruntime default"
        assert r.providers == ["CPUExecutionProvider"]
    assert y.shape == (2, 5, 24)
    assert _rel(_emulate(X), y) <= 1e-6


@pytest.mark.parametrize("choice,level", [("disable", "ORT_DISABLE_ALL"),
                                          ("basic", "ORT_ENABLE_BASIC"),
                                          ("extended", "ORT_ENABLE_EXTENDED"),
                                          ("all", "ORT_ENABLE_ALL")])
def test_requested_level_runs_and_is_described(tmp_path, choice, level):
    path = _save(tmp_path)
    runner = OrtRunner(path, providers=["CPUExecutionProvider"], graph_optimization_level=choice)
    assert runner.describe()["graph_optimization_level"] == level  # before activate too
    with runner as r:
        y = r.infer({"x": X})["y"]
        assert r.session.get_session_options().graph_optimization_level.name == level
        assert r.describe()["level_source"] == "requested"
        assert "level_warning" not in r.describe()
    assert _rel(_emulate(X), y) <= 1e-6


def test_unknown_level_is_a_usage_error(tmp_path):
    from fp8export.errors import UsageError

    with pytest.raises(UsageError, match="disable, basic, extended, all"):
        OrtRunner(_save(tmp_path), graph_optimization_level="fast")


def test_fp16_graph_and_dynamic_layer(tmp_path):
    path = _save(tmp_path, dtype="fp16")
    with OrtRunner(path) as r:
        y = r.infer({"x": X.astype(np.float16)})["y"]
    assert y.dtype == np.float16 and _rel(_emulate(X), y) <= 2e-3
    path = _save(tmp_path, input_scale=None)  # weight-only DQ
    with OrtRunner(path) as r:
        y = r.infer({"x": X})["y"]
    assert _rel(_emulate(X, None), y) <= 1e-6
    assert _rel(_emulate(X), y) > 1e-3  # and it really is different from the static pattern


def test_onnx_reference_agrees(tmp_path):
    path = _save(tmp_path)
    with OnnxReferenceRunner(path) as ref, OrtRunner(path) as ort_runner:
        a, b = ref.infer({"x": X})["y"], ort_runner.infer({"x": X})["y"]
    assert _rel(a, b) <= 1e-6


def test_bf16_graph_refused_on_cpu_but_runs_in_reference(tmp_path):
    path = _save(tmp_path, dtype="bf16", opset=23)
    assert graph_uses_bf16(onnx.load(str(path)))
    runner = OrtRunner(path, providers=["CPUExecutionProvider"])
    with pytest.raises(Fp8ExportError, match=r"--dtype fp16.*build-engine"):
        runner.activate()
    assert not runner.is_active
    with OnnxReferenceRunner(path) as ref:
        y = ref.infer({"x": X.astype(ml_dtypes.bfloat16)})["y"]
    assert _rel(_emulate(X), y.astype(np.float32)) <= 2e-2


def test_lifecycle_and_feed_errors(tmp_path):
    path = _save(tmp_path)
    runner = OrtRunner(path)
    with pytest.raises(Fp8ExportError, match="activated"):
        runner.infer({"x": X})
    with runner:
        with pytest.raises(Fp8ExportError, match=r"needs inputs \['x'\]"):
            runner.infer({"input_ids": X})
    with pytest.raises(Fp8ExportError, match="no such ONNX file"):
        OrtRunner(tmp_path / "missing.onnx").activate()
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(Fp8ExportError, match="not a readable ONNX"):
        OrtRunner(tmp_path / "junk.onnx").activate()
    with pytest.raises(Fp8ExportError, match="not available"):
        OrtRunner(path, providers=["NoSuchExecutionProvider"]).activate()
