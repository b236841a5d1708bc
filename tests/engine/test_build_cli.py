"""build-engine without TensorRT (as on these machines), and its bad-input errors.

The real build is covered by tests marked ``tensorrt``, which skip where TensorRT or a GPU is
missing.
"""

import importlib.util

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

HAS_TRT = importlib.util.find_spec("tensorrt") is not None


def qdq_matmul_graph(path, opset=21):
    """x[B,16] -> Q/DQ (FP8) -> MatMul with an FP8 weight initializer -> DQ. fp32 activations."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w_scale = np.float32(np.abs(w).max() / 448)
    w8 = (w / w_scale).astype(ml_dtypes.float8_e4m3fn)
    inits = [
        helper.make_tensor("w_fp8", TensorProto.FLOAT8E4M3FN, w8.shape, w8.view(np.uint8).tobytes(), raw=True),
        numpy_helper.from_array(np.array(w_scale, dtype=np.float32), "w_scale"),
        numpy_helper.from_array(np.array(0.01, dtype=np.float32), "x_scale"),
        helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], b"\x00", raw=True),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "zp"], ["xq"], axis=1, saturate=1),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "zp"], ["xdq"], axis=1),
        helper.make_node("DequantizeLinear", ["w_fp8", "w_scale", "zp"], ["wdq"], axis=1),
        helper.make_node("MatMul", ["xdq", "wdq"], ["y"], name="/fc/MatMul"),
    ]
    graph = helper.make_graph(
        nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.save(model, path)
    return path


def test_missing_onnx_is_exit_1(run_cli, tmp_path):
    r = run_cli("build-engine", tmp_path / "nope.onnx")
    assert r.exit_code == 1
    assert "nope.onnx" in r.output and "export-onnx" in r.output
    assert "Traceback" not in r.output


def test_existing_engine_needs_force(run_cli, tmp_path):
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    (tmp_path / "m.engine").write_bytes(b"old")
    r = run_cli("build-engine", g)
    assert r.exit_code == 1 and "--force" in r.output
    assert (tmp_path / "m.engine").read_bytes() == b"old"


@pytest.mark.skipif(HAS_TRT, reason="checks the message shown when TensorRT is absent")
def test_without_tensorrt_says_how_to_install(run_cli, tmp_path):
    pytest.importorskip("fp8export.onnx.check")
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    r = run_cli("build-engine", g)
    assert r.exit_code == 1
    assert "tensorrt" in r.output.lower() and "pip install" in r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "m.engine").exists()


def test_bad_option_values_are_usage_or_input_errors(run_cli, tmp_path):
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    assert run_cli("build-engine", g, "--opt-level", "9").exit_code == 2
    r = run_cli("build-engine", g, "--shapes", "x:1x16,1x16")
    assert r.exit_code == 1 and "--shapes" in r.output


@pytest.mark.tensorrt
def test_real_build_runs_fp8_gemm(tmp_path):
    """On a GPU with TensorRT: the tiny Q/DQ MatMul builds, runs FP8, and matches onnxruntime."""
    from fp8export.engine.build import BuildEngineConfig, build_engine
    from fp8export.runners.ort_runner import OrtRunner
    from fp8export.runners.trt_runner import TrtRunner

    g = qdq_matmul_graph(tmp_path / "m.onnx")
    res = build_engine(BuildEngineConfig(onnx=g))
    assert res.fp8_gemms + len(res.unattributed_gemms) >= 1 and not res.fallback_gemms
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    with TrtRunner(res.engine) as trt_r, OrtRunner(g) as ort_r:
        a, b = trt_r.infer({"x": x})["y"], ort_r.infer({"x": x})["y"]
    cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    assert cos > 0.999
