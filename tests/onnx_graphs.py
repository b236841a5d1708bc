"""Test graphs: a one-linear FP8 model, and the Q/DQ pattern around a GEMM as data.

``single_linear_model`` builds ``y = x @ W.T`` as a plain float graph and runs the same rewrite
export-onnx uses (binding by content, since the graph has no exporter metadata). It is the
smallest graph in the profile: the checker, golden, bad-input and runner tests build on it.
``qdq_pattern`` describes the nodes feeding one GEMM (op types, wiring, attributes, initializer
dtypes and shapes) as JSON-able data — what the golden tests compare.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def single_linear_model(layer, *, dtype: str = "fp32", opset: int = 21):
    """One quantized linear as an ONNX model: input ``x`` [batch, seq, in], output ``y``.

    ``layer`` is a :class:`~fp8export.fp8dir.reader.QuantLayer`. Returns the ModelProto.
    """
    import onnx
    import torch
    from onnx import helper, numpy_helper

    from fp8export.onnx.qdq import np_dtype, onnx_dtype

    w = layer.weight_out_in.to(torch.float32) * layer.weight_scale_out_in  # [out, in]
    out_f, in_f = w.shape
    wt = np.ascontiguousarray(w.numpy().T).astype(np_dtype(dtype))  # [in, out], as exported
    et = onnx_dtype(dtype)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name=f"{layer.name}/MatMul")],
        "single_linear",
        [helper.make_tensor_value_info("x", et, ["batch", "seq", in_f])],
        [helper.make_tensor_value_info("y", et, ["batch", "seq", out_f])],
        [numpy_helper.from_array(wt, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = max(10, onnx.helper.find_min_ir_version_for(list(model.opset_import)))
    return rewrite_proto(model, {layer.name: layer}, dtype=dtype, opset=opset)[0]


def rewrite_proto(model, layers, **kwargs):
    """``rewrite_qdq`` on a ModelProto: returns ``(rewritten ModelProto, RewriteResult)``."""
    import onnx_ir as ir

    from fp8export.onnx.qdq import rewrite_qdq

    graph = ir.from_proto(model)
    result = rewrite_qdq(graph, layers, **kwargs)
    return ir.to_proto(graph), result


def _attrs(node) -> dict[str, Any]:
    import onnx

    out = {}
    for a in sorted(node.attribute, key=lambda a: a.name):
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, (list, tuple)):
            v = list(v)
        out[a.name] = v
    return out


def qdq_pattern(model, gemm_name: str, *, values: bool = True) -> dict[str, Any]:
    """The Q/DQ subgraph feeding GEMM node ``gemm_name``, as plain data.

    Tensor names are kept when they are initializers (``<m>.weight``, ``<m>.weight_scale``,
    ...), and graph-internal inputs not produced by the pattern are written ``<activation>``.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    gemm = next((n for n in g.node if n.name == gemm_name), None)
    if gemm is None:
        raise KeyError(gemm_name)
    chosen, stack = [], [gemm]
    while stack:
        n = stack.pop()
        if n in chosen:
            continue
        chosen.append(n)
        for i in n.input:
            p = producer.get(i)
            if p is not None and p.op_type in ("QuantizeLinear", "DequantizeLinear"):
                stack.append(p)
    order = {id(n): k for k, n in enumerate(g.node)}
    chosen.sort(key=lambda n: order[id(n)])
    names = {o for n in chosen for o in n.output}
    nodes = []
    for n in chosen:
        ins = [i if (i in inits or i in names) else "<activation>" for i in n.input]
        nodes.append({"op": n.op_type, "inputs": ins, "outputs": list(n.output) if n is not gemm
                      else ["<output>"], "attributes": _attrs(n)})
    used = sorted({i for n in chosen for i in n.input if i in inits})
    from onnx import TensorProto, numpy_helper

    initializers = {}
    for k in used:
        t = inits[k]
        entry = {"dtype": TensorProto.DataType.Name(t.data_type), "dims": list(t.dims)}
        if values and not t.dims:  # scales and zero points: pin the value (as float32) too
            entry["value"] = float(numpy_helper.to_array(t).astype(np.float32))
        initializers[k] = entry
    return {"nodes": nodes, "initializers": initializers}
