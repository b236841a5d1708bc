"""The structural checker, one rule at a time, on a one-linear graph broken on purpose."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx_graphs import single_linear_model

from fp8export.fp8dir.reader import QuantLayer
from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3
from fp8export.onnx.check import check_model


def _layer(input_scale=0.01) -> QuantLayer:
    w = torch.linspace(-1.0, 1.0, 48).reshape(6, 8)
    ws = float(amax_to_scale(1.0))
    return QuantLayer("lin", quantize_e4m3(w, ws), "out_in", ws, input_scale)


@pytest.fixture()
def model():
    return single_linear_model(_layer())


def _node(m, name):
    return next(n for n in m.graph.node if n.name == name)


def _init(m, name):
    return next(t for t in m.graph.initializer if t.name == name)


def _rules(report, severity="error"):
    return {i.rule for i in report.issues if i.severity == severity}


def test_good_graph_passes_with_one_fp8_gemm(model):
    report = check_model(model)
    assert report.ok and report.issues == []
    assert [(g.layer, g.fp8) for g in report.gemms] == [("lin", True)]
    d = report.to_dict()
    assert d["ok"] and d["fp8_gemm_count"] == 1 and d["fp8_gemms"] == ["lin/MatMul"]
    assert "FP8-eligible GEMMs (TensorRT): 1" in report.to_text()


def test_checks_a_saved_file(model, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert check_model(path).ok


def test_missing_axis_matters_only_per_channel(model):
    dq = _node(model, "lin/weight_dq")
    del dq.attribute[:]
    assert check_model(model).ok  # scalar scale: axis is ignored by ONNX and TensorRT alike
    _init(model, "lin.weight_scale").CopyFrom(
        numpy_helper.from_array(np.full((6,), 0.01, dtype=np.float32), "lin.weight_scale"))
    r = check_model(model)
    assert not r.ok and "axis" in _rules(r)


def test_nonzero_and_wrong_type_zero_points(model):
    zp = _init(model, "fp8_zero_point")
    zp.CopyFrom(numpy_helper.from_array(np.ones((), dtype=ml_dtypes.float8_e4m3fn),
                                        "fp8_zero_point"))
    assert "zero-point" in _rules(check_model(model))
    zp.CopyFrom(helper.make_tensor("fp8_zero_point", TensorProto.FLOAT8E5M2, [], [0.0]))
    r = check_model(model)
    assert "zero-point" in _rules(r) and "E5M2" in r.to_text()


def test_q_without_zero_point_or_output_dtype_is_int8(model):
    q = _node(model, "lin/input_q")
    del q.input[2]
    r = check_model(model)
    assert "zero-point" in _rules(r) and "INT8" in r.to_text()
    q.attribute.append(helper.make_attribute("output_dtype", TensorProto.FLOAT8E4M3FN))
    assert check_model(model).ok


@pytest.mark.parametrize("value", [0.0, -0.5, float("nan")])
def test_scale_must_be_positive_finite(model, value):
    _init(model, "lin.weight_scale").CopyFrom(
        numpy_helper.from_array(np.array(value, dtype=np.float32), "lin.weight_scale"))
    r = check_model(model)
    assert not r.ok and "scale" in _rules(r)


def test_scale_must_be_constant(model):
    model.graph.initializer.remove(_init(model, "lin.input_scale"))
    model.graph.input.append(
        helper.make_tensor_value_info("lin.input_scale", TensorProto.FLOAT, []))
    r = check_model(model)
    assert "scale" in _rules(r) and "not a constant" in r.to_text()


def test_activation_scale_must_be_per_tensor(model):
    _init(model, "lin.input_scale").CopyFrom(
        numpy_helper.from_array(np.full((8,), 0.01, dtype=np.float32), "lin.input_scale"))
    r = check_model(model)
    assert "scale" in _rules(r) and "per-tensor" in r.to_text()


def test_scale_dtype_must_match_activation_dtype():
    m = single_linear_model(_layer(), dtype="fp16")
    _init(m, "lin.input_scale").CopyFrom(
        numpy_helper.from_array(np.array(0.01, dtype=np.float32), "lin.input_scale"))
    assert "scale-dtype" in _rules(check_model(m))


def test_bf16_fp32_scales_allowed_at_opset23_with_warning():
    r = check_model(single_linear_model(_layer(), dtype="bf16", opset=23))
    assert r.ok and "scale-dtype" in _rules(r, "warning")
    assert r.gemms[0].fp8


def test_fp8_initializer_feeding_matmul_directly(model):
    mm = _node(model, "lin/MatMul")
    mm.input[1] = "lin.weight"
    model.graph.node.remove(_node(model, "lin/weight_dq"))
    r = check_model(model)
    assert "quantized-constant" in _rules(r)


def test_cast_between_dq_and_gemm_blocks_fp8(model):
    mm = _node(model, "lin/MatMul")
    cast = helper.make_node("Cast", ["lin.weight_dq"], ["lin.weight_cast"], to=TensorProto.FLOAT,
                            name="cast")
    mm.input[1] = "lin.weight_cast"
    nodes = list(model.graph.node)
    nodes.insert(nodes.index(mm), cast)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    r = check_model(model)
    assert "gemm-inputs" in _rules(r)
    assert r.gemms[0].fp8 is False and "Cast" in r.gemms[0].reason


def test_dynamic_activation_is_a_16bit_warning():
    m = single_linear_model(_layer(input_scale=None))
    r = check_model(m)
    assert r.ok
    assert r.gemms[0].fp8 is False and "16-bit" in r.gemms[0].reason
    assert "gemm-inputs" in _rules(r, "warning")


def test_custom_domain_and_low_opset(model):
    model.graph.node.append(helper.make_node("GemmFloat8", ["x", "x"], ["z"],
                                             domain="com.microsoft", name="custom"))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    assert "custom-domain" in _rules(check_model(model))
    model2 = single_linear_model(_layer())
    model2.opset_import[0].version = 17
    model2.ir_version = 14
    assert {"opset", "ir-version"} <= _rules(check_model(model2))


def test_unquantized_gemm_is_counted_not_listed():
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.ones((4, 3), dtype=np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    r = check_model(m)
    assert r.ok and r.gemms == [] and r.float_gemms == 1


def test_per_channel_weight_scale_length_matches_axis(model):
    # weight [in=8, out=6], axis=1: 6 scales are per-channel; 5 are wrong
    _node(model, "lin/weight_dq").input[2] = "lin.weight_zero_point"
    model.graph.initializer.append(numpy_helper.from_array(
        np.zeros((1,), dtype=ml_dtypes.float8_e4m3fn), "lin.weight_zero_point"))
    zp = _init(model, "lin.weight_zero_point")
    for n, ok in ((6, True), (5, False)):
        _init(model, "lin.weight_scale").CopyFrom(
            numpy_helper.from_array(np.full((n,), 0.01, dtype=np.float32), "lin.weight_scale"))
        zp.CopyFrom(numpy_helper.from_array(np.zeros((n,), dtype=ml_dtypes.float8_e4m3fn),
                                            "lin.weight_zero_point"))
        assert check_model(model).ok is ok
    # the zero point must have the scale's shape (ONNX; onnxruntime refuses the node otherwise)
    _node(model, "lin/weight_dq").input[2] = "fp8_zero_point"
    r = check_model(model)
    assert "zero-point" in _rules(r) and "same shape" in r.to_text()
