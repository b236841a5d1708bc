"""The rewrite on graphs the dynamo exporter does not make: Gemm(transB=1), Transpose(W)->MatMul."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.reader import QuantLayer
from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3
from fp8export.onnx.check import check_model
from fp8export.runners.ort_runner import OrtRunner
from tests.onnx_graphs import rewrite_proto

RNG = np.random.RandomState(0)
W = torch.from_numpy(RNG.uniform(-1, 1, (12, 8)).astype(np.float32))  # [out, in]
WS, XS = float(amax_to_scale(1.0)), float(amax_to_scale(3.0))
LAYER = QuantLayer("fc", quantize_e4m3(W, WS), "out_in", WS, XS)
X = RNG.uniform(-3, 3, (5, 8)).astype(np.float32)


def _deq_w() -> np.ndarray:
    return (LAYER.weight.to(torch.float32) * WS).numpy()  # [out, in]


def _emulated(x) -> np.ndarray:
    q = np.clip(x / np.float32(XS), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float32) * np.float32(XS)) @ _deq_w().T


def _model(nodes, inits):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["n", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 12])],
                          inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10  # what the exporter writes; onnxruntime 1.31 reads IR <= 13
    return model


def _run(model, tmp_path) -> np.ndarray:
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    with OrtRunner(path) as r:
        return r.infer({"x": X})["y"]


def test_gemm_trans_b_keeps_out_in_weight_with_axis0(tmp_path):
    m = _model([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1, name="gemm")],
               [numpy_helper.from_array(_deq_w(), "w")])
    m, result = rewrite_proto(m, {"fc": LAYER}, dtype="fp32", opset=21)
    assert result.bound == {"fc": "content"} and result.static == ["fc"]
    w8 = next(t for t in m.graph.initializer if t.name == "fc.weight")
    assert w8.data_type == TensorProto.FLOAT8E4M3FN and list(w8.dims) == [12, 8]
    dq = next(n for n in m.graph.node if n.name == "fc/weight_dq")
    assert helper.get_attribute_value(dq.attribute[0]) == 0  # axis 0: output channels of [N, K]
    assert "w" not in {t.name for t in m.graph.initializer}
    assert check_model(m).fp8_gemms[0].layer == "fc"
    y = _run(m, tmp_path)
    assert np.linalg.norm(y - _emulated(X)) / np.linalg.norm(_emulated(X)) <= 1e-6


def test_transpose_between_initializer_and_matmul_is_folded(tmp_path):
    m = _model([helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0], name="t"),
                helper.make_node("MatMul", ["x", "wt"], ["y"], name="mm")],
               [numpy_helper.from_array(_deq_w(), "w")])
    m, _ = rewrite_proto(m, {"fc": LAYER}, dtype="fp32", opset=21)
    assert [n.op_type for n in m.graph.node] == ["DequantizeLinear", "QuantizeLinear",
                                                 "DequantizeLinear", "MatMul"]
    w8 = next(t for t in m.graph.initializer if t.name == "fc.weight")
    assert list(w8.dims) == [8, 12]  # pre-transposed for MatMul
    report = check_model(m)
    assert report.ok and len(report.fp8_gemms) == 1
    y = _run(m, tmp_path)
    assert np.linalg.norm(y - _emulated(X)) / np.linalg.norm(_emulated(X)) <= 1e-6


def test_unbound_and_ambiguous_layers_are_errors():
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"])],
               [numpy_helper.from_array(np.ones((8, 12), np.float32), "w")])
    with pytest.raises(Fp8ExportError, match="layer fc: no MatMul/Gemm"):
        rewrite_proto(m, {"fc": LAYER}, dtype="fp32", opset=21)
    wt = np.ascontiguousarray(_deq_w().T)
    m = _model([helper.make_node("MatMul", ["x", "w1"], ["h"]),
                helper.make_node("MatMul", ["x", "w2"], ["h2"]),
                helper.make_node("Add", ["h", "h2"], ["y"])],
               [numpy_helper.from_array(wt, "w1"), numpy_helper.from_array(wt, "w2")])
    with pytest.raises(Fp8ExportError, match="matches 2 different initializers"):
        rewrite_proto(m, {"fc": LAYER}, dtype="fp32", opset=21)


def test_scale_that_underflows_fp16_is_refused():
    tiny = QuantLayer("fc", quantize_e4m3(W * 1e-9, 1e-11), "out_in", 1e-11, XS)
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"])],
               [numpy_helper.from_array(np.ascontiguousarray(
                   (tiny.weight.to(torch.float32) * 1e-11).numpy().T.astype(np.float16)), "w")])
    with pytest.raises(Fp8ExportError, match="--dtype fp32"):
        rewrite_proto(m, {"fc": tiny}, dtype="fp16", opset=21)
