"""Rewrite an exported graph into the FP8 Q/DQ pattern TensorRT fuses (DESIGN.md "ONNX profile").

For each quantized linear ``<m>`` of the FP8 folder, around its MatMul (or Gemm)::

    <m>.weight FLOAT8E4M3FN [in, out] -> DequantizeLinear(<m>.weight_scale, zp, axis=1) --+
    x -> QuantizeLinear(<m>.input_scale, zp, axis=1, saturate=1)                          +-> MatMul
      -> DequantizeLinear(<m>.input_scale, zp, axis=1) -----------------------------------+

  (zp: one all-zero FLOAT8E4M3FN scalar, ``fp8_zero_point``)

* the weight is the folder's E4M3 bytes, pre-transposed to the orientation the GEMM reads, so no
  Transpose sits between the DQ and the GEMM (ModelOpt's ``fp8_exporter.py`` does the same);
* per-tensor (scalar) scales, for block weights a blocked DQ (``block_size`` along the input
  axis, see ``_weight_scale_for``), or for per-channel weights a 1-D scale along the stored weight's
  output-channel axis with an all-zero zero point of the same shape (ONNX requires the zero
  point to match the scale's shape; TensorRT takes per-channel weight DQ), ``axis`` always
  written (TensorRT 10.1 defaulted a missing axis to 0, later parsers to 1), an all-zero
  FLOAT8E4M3FN zero point on every Q and DQ (the onnx-tensorrt importer takes the quantized
  type from the zero point, else ``output_dtype``, else INT8);
* scale dtype = activation dtype; at opset >= 23 with bf16 activations the scales stay float32
  and the DQs carry ``output_dtype`` = bf16 (needs TensorRT >= 10.13);
* layers without a static ``input_scale`` (dynamic activations) get the weight DQ only: the
  GEMM then runs in 16-bit in TensorRT, and the checker says so.

Two shapes keep onnxruntime's graph optimizations from changing the answer (docs/onnx.md,
"onnxruntime optimization levels"):

* an activation Q that reads a Relu (directly, or through ops onnxruntime moves Q/DQ across)
  names FP8 by ``output_dtype`` and has no zero point: onnxruntime's Relu->QuantizeLinear fusion
  drops a Relu before any Q whose zero point is not int8/uint8, FP8 included;
* a quantized Gemm's bias is stored as ``[1, N]``: onnxruntime re-quantizes a 1-D bias of a
  Q/DQ Gemm to int32 at ``input_scale * weight_scale``, which overflows (fp16 at once).

Binding a manifest layer to its GEMM: by provenance first (the dynamo exporter records the module
path in the node's ``pkg.torch.onnx.name_scopes``), confirmed by content; else by content alone
(the dequantized weight equals an initializer up to transpose) — the path the Keras export uses.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fp8export.errors import Fp8ExportError

ZERO_POINT = "fp8_zero_point"
_E4M3FN = 17  # onnx.TensorProto.FLOAT8E4M3FN
# onnxruntime's QDQPropagationTransformer moves a Q backwards across these (qdq_propagation.cc)
_Q_PROPAGATES = frozenset({"MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice"})
_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
_WRAPPER_PREFIX = "model."


@dataclass
class Binding:
    layer: str
    node: object  # onnx.NodeProto (MatMul/Gemm)
    initializer: str  # name of the float weight initializer now feeding it
    transpose_node: object | None  # a Transpose(initializer) between, to remove
    orientation: str  # the float initializer's layout: "in_out" ([K, N]) or "out_in" ([N, K])
    how: str  # "provenance" | "content"

    @property
    def read_as(self) -> str:
        """The layout the GEMM reads B in (the FP8 initializer is stored so, no Transpose)."""
        if self.transpose_node is None:
            return self.orientation
        return "out_in" if self.orientation == "in_out" else "in_out"


@dataclass
class RewriteResult:
    bound: dict[str, str] = field(default_factory=dict)  # layer -> "provenance" | "content"
    static: list[str] = field(default_factory=list)  # layers with activation Q/DQ
    dynamic: list[str] = field(default_factory=list)  # weight-only DQ (16-bit in TensorRT)
    max_scale_rounding: float = 0.0  # largest relative change from casting scales to the dtype
    notes: list[str] = field(default_factory=list)


def module_of(node, prefix: str = _WRAPPER_PREFIX) -> str | None:
    """Module path that produced ``node`` (from the dynamo exporter's name scopes), or None."""
    for prop in node.metadata_props:
        if prop.key == _SCOPES_KEY:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            if len(scopes) < 2:
                return None
            name = scopes[-2]
            return name[len(prefix):] if prefix and name.startswith(prefix) else name
    return None


def np_dtype(name: str):
    import ml_dtypes

    return {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}[name]


def onnx_dtype(name: str) -> int:
    from onnx import TensorProto

    return {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16,
            "bf16": TensorProto.BFLOAT16}[name]


def scale_dtype_for(dtype: str, opset: int) -> str:
    """Scale dtype of the profile: the activation dtype, except fp32 for bf16 at opset >= 23."""
    return "fp32" if dtype == "bf16" and opset >= 23 else dtype


def _weight_source(node, inits: Mapping, producers: Mapping):
    """(initializer name, transpose node or None) feeding the GEMM's B, or None."""
    name = node.input[1]
    if name in inits:
        return name, None
    prod = producers.get(name)
    if prod is not None and prod.op_type == "Transpose" and prod.input[0] in inits:
        perm = [a.ints for a in prod.attribute if a.name == "perm"]
        if not perm or list(perm[0]) == [1, 0]:
            return prod.input[0], prod
    return None


def _orientation(node, transposed: bool) -> str:
    """Layout of the initializer behind B: "in_out" ([K, N]) or "out_in" ([N, K])."""
    trans_b = 0
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
    return "out_in" if bool(trans_b) != transposed else "in_out"


def _expected(layer, orientation: str, dtype: str) -> np.ndarray:
    import torch

    w = layer.weight_out_in.to(torch.float32) * layer.weight_scale_out_in  # [out, in]
    arr = w.numpy().astype(np_dtype(dtype)).astype(np.float32)
    return arr.T if orientation == "in_out" else arr


def _matches(value: np.ndarray, expected: np.ndarray) -> bool:
    if value.shape != expected.shape:
        return False
    # the initializer is the model parameter itself: equal up to the dtype's rounding
    atol = 1e-6 * float(np.abs(expected).max() or 1.0)
    return bool(np.allclose(value.astype(np.float32), expected, rtol=1e-3, atol=atol))


def bind_layers(model, layers: Mapping, dtype: str) -> dict[str, Binding]:
    """Find the MatMul/Gemm of every quantized layer. Raises naming any layer not found."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    candidates = []  # (node, init name, transpose node, orientation)
    for node in graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        src = _weight_source(node, inits, producers)
        if src is None or len(inits[src[0]].dims) != 2:
            continue
        candidates.append((node, src[0], src[1], _orientation(node, src[1] is not None)))

    def value(name: str) -> np.ndarray:  # not cached: a float32 copy of every weight is large
        return numpy_helper.to_array(inits[name]).astype(np.float32)

    bindings: dict[str, Binding] = {}
    used: set[int] = set()
    # 1) provenance, confirmed by content
    for i, (node, init, tnode, orient) in enumerate(candidates):
        layer = layers.get(module_of(node) or "")
        if layer is None or layer.name in bindings:
            continue
        if _matches(value(init), _expected(layer, orient, dtype)):
            bindings[layer.name] = Binding(layer.name, node, init, tnode, orient, "provenance")
            used.add(i)
    # 2) content, for the rest (shape first, then values; ambiguity is an error)
    for layer in layers.values():
        if layer.name in bindings:
            continue
        hits = []
        out_f, in_f = layer.weight_out_in.shape
        for i, (node, init, tnode, orient) in enumerate(candidates):
            shape = (in_f, out_f) if orient == "in_out" else (out_f, in_f)
            if i in used or tuple(inits[init].dims) != shape:
                continue
            if _matches(value(init), _expected(layer, orient, dtype)):
                hits.append(i)
        if not hits:
            raise Fp8ExportError(
                f"layer {layer.name}: no MatMul/Gemm in the exported graph uses its weight (by "
                "module name or by content). Exclude it at convert time (--exclude "
                f"'{layer.name}') or report the architecture.")
        inits_hit = {candidates[i][1] for i in hits}
        if len(inits_hit) > 1:
            raise Fp8ExportError(
                f"layer {layer.name}: its weight matches {len(inits_hit)} different initializers "
                "in the graph, so it cannot be bound by content. Exclude it (--exclude).")
        i = hits[0]
        node, init, tnode, orient = candidates[i]
        bindings[layer.name] = Binding(layer.name, node, init, tnode, orient, "content")
        used.add(i)
    return bindings


def reads_relu(x: str, producers: Mapping) -> bool:
    """True when tensor ``x`` is a Relu's output, directly or through ops Q/DQ propagate across."""
    node = producers.get(x)
    while node is not None and node.op_type in _Q_PROPAGATES and node.input:
        node = producers.get(node.input[0])
    return node is not None and node.op_type == "Relu"


def _bias_as_row(gemm, inits: Mapping, consumers: dict, name: str, new_inits: list) -> str | None:
    """Store a quantized Gemm's 1-D bias initializer as ``[1, N]`` (same values, same result).

    onnxruntime's WeightBiasQuantization rewrites the 1-D bias ``C`` of a Gemm fed by a DQ into
    ``DQ(int32(round(C / (input_scale * weight_scale))))``, which overflows int32 (or, in a
    float16 graph, the float16 division) for ordinary FP8 scales; it leaves a 2-D ``C`` alone.
    Returns the 1-D initializer's name when it was replaced.
    """
    from onnx import numpy_helper

    if gemm.op_type != "Gemm" or len(gemm.input) < 3 or not gemm.input[2]:
        return None
    old = gemm.input[2]
    bias = inits.get(old)
    if bias is None or len(bias.dims) != 1:
        return None
    row = numpy_helper.from_array(numpy_helper.to_array(bias).reshape(1, -1), f"{name}.bias")
    new_inits.append(row)
    consumers[old] -= 1
    gemm.input[2] = row.name
    return old


def _scale_tensor(name: str, value, sdtype: str, layer: str, result: RewriteResult):
    """A scalar scale, a 1-D per-channel one, or a 2-D block one (float32 values)."""
    from onnx import numpy_helper

    want = np.asarray(value, dtype=np.float32)
    cast = want.astype(np_dtype(sdtype))
    back = cast.astype(np.float32)
    if not np.all(np.isfinite(back)) or not np.all(back > 0.0):
        shown = value if want.ndim == 0 else "a per-channel or block scale"
        raise Fp8ExportError(
            f"layer {layer}: scale {shown!r} is not representable as a positive {sdtype} "
            f"(TensorRT needs positive scales of the activation dtype). Export with --dtype fp32, "
            "or exclude the layer at convert time.")
    rounding = float(np.max(np.abs(back - want) / want))
    result.max_scale_rounding = max(result.max_scale_rounding, rounding)
    return numpy_helper.from_array(np.asarray(cast), name)


def _weight_scale_for(layer, read_as: str) -> tuple[Any, int, dict[str, int]]:
    """(scale, axis, extra DQ attributes) of a layer's weight DequantizeLinear.

    Per tensor: a scalar; per channel: 1-D along the stored weight's output-channel axis. Per
    ``bn x bk`` block: ONNX blocks run along one axis (``block_size``, opset 21), so the weight
    is blocked along its input axis (K) in blocks of ``bk`` and each block scale is repeated over
    the ``bn`` output channels of its tile: ``[ceil(K/bk), N]`` for a MatMul weight ``[K, N]``
    (``axis=0``), ``[N, ceil(K/bk)]`` for ``Gemm(transB=1)`` ``[N, K]`` (``axis=1``). The same
    values, so the same dequantized weight.
    """
    if layer.block is None:
        axis = 1 if read_as == "in_out" else 0  # output-channel axis of the stored weight
        return layer.weight_scale, axis, {}
    bn, bk = layer.block
    out = layer.weight_out_in.shape[0]
    per_row = layer.weight_scale.repeat_interleave(bn, dim=0)[:out].numpy()  # [N, ceil(K/bk)]
    if read_as == "in_out":
        return np.ascontiguousarray(per_row.T), 0, {"block_size": bk}
    return per_row, 1, {"block_size": bk}


def rewrite_qdq(model, layers: Mapping, *, dtype: str, opset: int) -> RewriteResult:
    """Rewrite ``model`` (in place) so every layer in ``layers`` uses the FP8 Q/DQ pattern.

    ``layers`` maps module names to :class:`~fp8export.fp8dir.reader.QuantLayer`. ``dtype`` is
    the activation dtype ("fp32"|"fp16"|"bf16"), ``opset`` the graph's opset.
    """
    import ml_dtypes
    import torch
    from onnx import helper, numpy_helper

    sdtype = scale_dtype_for(dtype, opset)
    result = RewriteResult()
    bindings = bind_layers(model, layers, dtype)
    graph = model.graph
    consumers: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    outputs = {o.name for o in graph.output}
    producers = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}

    zp = numpy_helper.from_array(np.zeros((), dtype=ml_dtypes.float8_e4m3fn), ZERO_POINT)
    new_inits = [zp]
    out_dtype_attr = {}
    if sdtype != dtype:  # opset 23: DQ emits the activation dtype from an fp32 scale
        out_dtype_attr = {"output_dtype": onnx_dtype(dtype)}
    remove_inits: set[str] = set()
    remove_nodes: set[int] = set()
    insert_before: dict[int, list] = {}
    act_dq: dict[tuple[str, float], str] = {}

    position = {id(n): i for i, n in enumerate(graph.node)}
    # graph order: a shared activation Q/DQ is created before its first consumer
    for name in sorted(layers, key=lambda k: position[id(bindings[k].node)]):
        b = bindings[name]
        layer = layers[name]
        gemm = b.node
        q = layer.weight_out_in.contiguous()  # [out, in] float8
        raw = q.view(torch.uint8).numpy()
        raw = raw.T if b.read_as == "in_out" else raw
        w8 = np.ascontiguousarray(raw).view(ml_dtypes.float8_e4m3fn)
        w_name, s_name = f"{name}.weight", f"{name}.weight_scale"
        new_inits.append(numpy_helper.from_array(w8, w_name))
        scale, axis, blocked = _weight_scale_for(layer, b.read_as)
        new_inits.append(_scale_tensor(s_name, scale, sdtype, name, result))
        w_zp = ZERO_POINT
        if np.ndim(scale):  # per channel or block: the zero point has the scale's shape
            w_zp = f"{name}.weight_zero_point"
            new_inits.append(numpy_helper.from_array(
                np.zeros(np.shape(scale), dtype=ml_dtypes.float8_e4m3fn), w_zp))
        nodes = [helper.make_node("DequantizeLinear", [w_name, s_name, w_zp],
                                  [f"{name}.weight_dq"], name=f"{name}/weight_dq", axis=axis,
                                  **blocked, **out_dtype_attr)]
        # activation
        if layer.input_scale is not None:
            x = gemm.input[0]
            key = (x, float(layer.input_scale))
            if key in act_dq:
                gemm.input[0] = act_dq[key]
            else:
                i_name = f"{name}.input_scale"
                new_inits.append(_scale_tensor(i_name, layer.input_scale, sdtype, name, result))
                q_inputs, q_type = [x, i_name, ZERO_POINT], {}
                if opset >= 21 and reads_relu(x, producers):  # output_dtype exists from 21
                    q_inputs, q_type = [x, i_name], {"output_dtype": _E4M3FN}
                nodes.append(helper.make_node(
                    "QuantizeLinear", q_inputs, [f"{name}.input_q"],
                    name=f"{name}/input_q", axis=1, saturate=1, **q_type))
                nodes.append(helper.make_node(
                    "DequantizeLinear", [f"{name}.input_q", i_name, ZERO_POINT],
                    [f"{name}.input_dq"], name=f"{name}/input_dq", axis=1, **out_dtype_attr))
                act_dq[key] = f"{name}.input_dq"
                gemm.input[0] = f"{name}.input_dq"
            result.static.append(name)
        else:
            result.dynamic.append(name)
        old_bias = _bias_as_row(gemm, inits, consumers, name, new_inits)
        # weight
        old = gemm.input[1]
        gemm.input[1] = f"{name}.weight_dq"
        consumers[old] -= 1
        if b.transpose_node is not None and consumers[old] == 0 and old not in outputs:
            remove_nodes.add(id(b.transpose_node))
            consumers[b.initializer] -= 1
        for init in (b.initializer, old_bias):  # old_bias: replaced by its [1, N] row
            if init and consumers.get(init, 0) == 0 and init not in outputs:
                remove_inits.add(init)
        gemm.name = f"{name}/{gemm.op_type}"  # readable TensorRT layer names
        insert_before.setdefault(position[id(gemm)], []).extend(nodes)
        result.bound[name] = b.how

    new_nodes = []
    for i, n in enumerate(graph.node):
        new_nodes.extend(insert_before.get(i, []))
        if id(n) not in remove_nodes:
            new_nodes.append(n)
    del graph.node[:]
    graph.node.extend(new_nodes)
    kept = [t for t in graph.initializer if t.name not in remove_inits]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    # value_info for removed tensors would dangle; shape inference rebuilds what is needed
    vi = [v for v in graph.value_info if v.name not in remove_inits]
    del graph.value_info[:]
    graph.value_info.extend(vi)
    if result.dynamic:
        result.notes.append(
            f"{len(result.dynamic)} layer(s) have no static input scale (dynamic activations): "
            "weight-only DQ, TensorRT will run these in 16-bit: " + ", ".join(result.dynamic))
    if result.max_scale_rounding > 0:
        result.notes.append(
            f"scales stored as {sdtype}: largest relative rounding {result.max_scale_rounding:.2e}")
    return result
