"""A tiny FP8 Q/DQ graph for the build-engine tests."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def qdq_matmul_graph(path, opset=21):
    """x[B,16] -> Q/DQ (FP8) -> MatMul with an FP8 weight initializer -> DQ. fp32 activations."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w_scale = np.float32(np.abs(w).max() / 448)
    w8 = (w / w_scale).astype(ml_dtypes.float8_e4m3fn)
    inits = [
        helper.make_tensor("w_fp8", TensorProto.FLOAT8E4M3FN, w8.shape,
                           w8.view(np.uint8).tobytes(), raw=True),
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
