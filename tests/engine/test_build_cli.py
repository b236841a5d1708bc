"""build-engine without TensorRT (as on these machines), and its bad-input errors.

The real build is covered by tests marked ``tensorrt``, which skip where TensorRT or a GPU is
missing.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from qdq_graphs import qdq_matmul_graph  # noqa: E402

HAS_TRT = importlib.util.find_spec("tensorrt") is not None


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
def test_without_tensorrt_says_how_to_install(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no trtexec either
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    r = run_cli("build-engine", g)
    assert r.exit_code == 1
    assert "tensorrt" in r.output.lower() and "pip install" in r.output
    assert "trtexec" in r.output and "--print-command" in r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "m.engine").exists()


def test_bad_option_values_are_usage_or_input_errors(run_cli, tmp_path):
    g = qdq_matmul_graph(tmp_path / "m.onnx")
    assert run_cli("build-engine", g, "--opt-level", "9").exit_code == 2
    r = run_cli("build-engine", g, "--shapes", "x:1x16,1x16")
    assert r.exit_code == 2 and "--shapes" in r.output


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
    # values, not cosine (blind to a wrong scale): the same Q/DQ function, fp32 output; only
    # the accumulation order may differ
    assert float(np.linalg.norm(a - b) / np.linalg.norm(b)) < 1e-3
