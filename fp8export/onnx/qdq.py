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

The graph is edited as an ``onnx_ir`` model (what ``torch.onnx.export(dynamo=True)`` returns),
before it is serialized; its use lists tell which float weights and Transposes the rewrite
left unread, and only those are dropped (a general dead-code pass would also drop the shared
zero point of a weight-only graph, which the files have always carried).

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
from fp8export.notes import Note, NoteKind

ZERO_POINT = "fp8_zero_point"
_E4M3FN = 17  # onnx.TensorProto.FLOAT8E4M3FN
# onnxruntime's QDQPropagationTransformer moves a Q backwards across these (qdq_propagation.cc)
_Q_PROPAGATES = frozenset({"MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice"})
_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
_WRAPPER_PREFIX = "model."


@dataclass
class Binding:
    layer: str
    node: Any  # onnx_ir.Node (MatMul/Gemm)
    initializer: Any  # onnx_ir.Value: the float weight initializer now feeding it
    transpose_node: Any | None  # a Transpose(initializer) between, left unused by the rewrite
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
    value = node.metadata_props.get(_SCOPES_KEY)
    if value is None:
        return None
    try:
        scopes = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    if len(scopes) < 2:
        return None
    name = scopes[-2]
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


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


def _is_initializer(value) -> bool:
    return value is not None and value.is_initializer() and value.const_value is not None


def _weight_source(node):
    """(initializer value, transpose node or None) feeding the GEMM's B, or None."""
    b = node.inputs[1]
    if _is_initializer(b):
        return b, None
    prod = b.producer() if b is not None else None
    if prod is not None and prod.op_type == "Transpose" and _is_initializer(prod.inputs[0]):
        perm = prod.attributes.get_ints("perm")
        if perm is None or list(perm) == [1, 0]:
            return prod.inputs[0], prod
    return None


def _orientation(node, transposed: bool) -> str:
    """Layout of the initializer behind B: "in_out" ([K, N]) or "out_in" ([N, K])."""
    trans_b = node.attributes.get_int("transB", 0) if node.op_type == "Gemm" else 0
    return "out_in" if bool(trans_b) != transposed else "in_out"


def _shape(init) -> tuple[int, ...]:
    return tuple(init.const_value.shape.numpy())


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
    """Find the MatMul/Gemm of every quantized layer of ``model`` (an ``onnx_ir.Model``).

    Raises naming any layer not found.
    """
    candidates = []  # (node, initializer value, transpose node, orientation)
    for node in model.graph:
        if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        src = _weight_source(node)
        if src is None or len(_shape(src[0])) != 2:
            continue
        candidates.append((node, src[0], src[1], _orientation(node, src[1] is not None)))

    def value(init) -> np.ndarray:  # not cached: a float32 copy of every weight is large
        return init.const_value.numpy().astype(np.float32)

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
    unbound: list[str] = []
    for layer in layers.values():
        if layer.name in bindings:
            continue
        hits = []
        out_f, in_f = layer.weight_out_in.shape
        for i, (node, init, tnode, orient) in enumerate(candidates):
            shape = (in_f, out_f) if orient == "in_out" else (out_f, in_f)
            if i in used or _shape(init) != shape:
                continue
            if _matches(value(init), _expected(layer, orient, dtype)):
                hits.append(i)
        if not hits:
            unbound.append(layer.name)
            continue
        inits_hit = {id(candidates[i][1]) for i in hits}
        if len(inits_hit) > 1:
            raise Fp8ExportError(
                f"layer {layer.name}: its weight matches {len(inits_hit)} different initializers "
                "in the graph, so it cannot be bound by content. Exclude it (--exclude).")
        i = hits[0]
        node, init, tnode, orient = candidates[i]
        bindings[layer.name] = Binding(layer.name, node, init, tnode, orient, "content")
        used.add(i)
    if unbound:
        more = f" (and {len(unbound) - 1} more: {', '.join(unbound[1:4])}" \
            f"{', ...' if len(unbound) > 4 else ''})" if len(unbound) > 1 else ""
        raise Fp8ExportError(
            f"layer {unbound[0]}: no MatMul/Gemm in the exported graph uses its weight (by "
            f"module name or by content){more}. The model is traced on text, so layers that "
            "run only on images or audio (Mllama's cross-attention layers) are not in the "
            f"graph. Exclude them at convert time (--exclude '{unbound[0]}'), serve the FP8 "
            "folder directly (vLLM; verify runs it), or report the architecture.")
    return bindings


def reads_relu(x) -> bool:
    """True when value ``x`` is a Relu's output, directly or through ops Q/DQ propagate across."""
    node = x.producer() if x is not None else None
    while node is not None and node.op_type in _Q_PROPAGATES and node.inputs:
        src = node.inputs[0]
        node = src.producer() if src is not None else None
    return node is not None and node.op_type == "Relu"


def _initializer(graph, name: str, array: np.ndarray):
    """Register ``array`` as initializer ``name``; returns its value."""
    import onnx_ir as ir

    # no type or shape on the value: onnx_ir would write a value_info entry for it
    value = ir.Value(name=name, const_value=ir.Tensor(np.asarray(array)))
    graph.register_initializer(value)
    return value


def _node(op_type: str, inputs: list, output: str, name: str, **attrs):
    import onnx_ir as ir

    # attributes in name order, as onnx.helper.make_node writes them: stable bytes
    return ir.node(op_type, inputs, dict(sorted(attrs.items())),
                   outputs=[ir.Value(name=output)], name=name)


def _drop_unused(graph, value) -> None:
    """Remove ``value`` if nothing reads it any more: a Transpose's output (then its input), or
    an initializer."""
    if value is None or value.uses() or value.is_graph_output():
        return
    node = value.producer()
    if node is not None and node.op_type == "Transpose":
        source = node.inputs[0]
        graph.remove(node, safe=True)
        _drop_unused(graph, source)
    elif node is None and value.is_initializer():
        del graph.initializers[value.name]


def _bias_as_row(graph, gemm, name: str) -> None:
    """Store a quantized Gemm's 1-D bias initializer as ``[1, N]`` (same values, same result).

    onnxruntime's WeightBiasQuantization rewrites the 1-D bias ``C`` of a Gemm fed by a DQ into
    ``DQ(int32(round(C / (input_scale * weight_scale))))``, which overflows int32 (or, in a
    float16 graph, the float16 division) for ordinary FP8 scales; it leaves a 2-D ``C`` alone.
    """
    if gemm.op_type != "Gemm" or len(gemm.inputs) < 3:
        return
    old = gemm.inputs[2]
    if not _is_initializer(old) or len(_shape(old)) != 1:
        return
    import onnx_ir as ir

    row = ir.Value(name=f"{name}.bias",
                   const_value=ir.Tensor(old.const_value.numpy().reshape(1, -1)))
    gemm.replace_input_with(2, row)
    _drop_unused(graph, old)  # before registering the row: it may have had the same name
    graph.register_initializer(row)


def _scale_array(value, sdtype: str, layer: str, result: RewriteResult) -> np.ndarray:
    """A scalar scale, a 1-D per-channel one, or a 2-D block one, cast to ``sdtype``."""
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
    return np.asarray(cast)


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
    """Rewrite ``model`` (an ``onnx_ir.Model``, in place) so every layer in ``layers`` uses the
    FP8 Q/DQ pattern.

    ``layers`` maps module names to :class:`~fp8export.fp8dir.reader.QuantLayer`. ``dtype`` is
    the activation dtype ("fp32"|"fp16"|"bf16"), ``opset`` the graph's opset.
    """
    import ml_dtypes
    import torch

    sdtype = scale_dtype_for(dtype, opset)
    result = RewriteResult()
    bindings = bind_layers(model, layers, dtype)
    graph = model.graph
    layer_of = {id(b.node): name for name, b in bindings.items()}

    fp8 = ml_dtypes.float8_e4m3fn
    zp = _initializer(graph, ZERO_POINT, np.zeros((), dtype=fp8))
    out_dtype_attr = {}
    if sdtype != dtype:  # opset 23: DQ emits the activation dtype from an fp32 scale
        out_dtype_attr = {"output_dtype": onnx_dtype(dtype)}
    act_dq: dict[tuple[Any, float], Any] = {}  # (activation, scale) -> its DQ output

    # graph order: a shared activation Q/DQ is created before its first consumer
    for gemm in [n for n in graph if id(n) in layer_of]:
        name = layer_of[id(gemm)]
        b = bindings[name]
        layer = layers[name]
        raw = layer.weight_out_in.contiguous().view(torch.uint8).numpy()  # [out, in] float8
        raw = raw.T if b.read_as == "in_out" else raw
        w = _initializer(graph, f"{name}.weight", np.ascontiguousarray(raw).view(fp8))
        scale, axis, blocked = _weight_scale_for(layer, b.read_as)
        s = _initializer(graph, f"{name}.weight_scale",
                         _scale_array(scale, sdtype, name, result))
        w_zp = zp
        if np.ndim(scale):  # per channel or block: the zero point has the scale's shape
            w_zp = _initializer(graph, f"{name}.weight_zero_point",
                                np.zeros(np.shape(scale), dtype=fp8))
        nodes = [_node("DequantizeLinear", [w, s, w_zp], f"{name}.weight_dq",
                       f"{name}/weight_dq", axis=axis, **blocked, **out_dtype_attr)]
        # activation
        if layer.input_scale is not None:
            x = gemm.inputs[0]
            key = (x, float(layer.input_scale))
            if key not in act_dq:
                i_s = _initializer(graph, f"{name}.input_scale",
                                   _scale_array(layer.input_scale, sdtype, name, result))
                q_inputs, q_type = [x, i_s, zp], {}
                if opset >= 21 and reads_relu(x):  # output_dtype exists from 21
                    q_inputs, q_type = [x, i_s], {"output_dtype": _E4M3FN}
                q = _node("QuantizeLinear", q_inputs, f"{name}.input_q", f"{name}/input_q",
                          axis=1, saturate=1, **q_type)
                dq = _node("DequantizeLinear", [q.outputs[0], i_s, zp], f"{name}.input_dq",
                           f"{name}/input_dq", axis=1, **out_dtype_attr)
                nodes += [q, dq]
                act_dq[key] = dq.outputs[0]
            gemm.replace_input_with(0, act_dq[key])
            result.static.append(name)
        else:
            result.dynamic.append(name)
        _bias_as_row(graph, gemm, name)
        old = gemm.inputs[1]
        gemm.replace_input_with(1, nodes[0].outputs[0])
        _drop_unused(graph, old)  # the float weight (and its Transpose) once no GEMM reads it
        gemm.name = f"{name}/{gemm.op_type}"  # readable TensorRT layer names
        graph.insert_before(gemm, nodes)
        result.bound[name] = b.how

    if result.dynamic:
        result.notes.append(Note(
            f"{len(result.dynamic)} layer(s) have no static input scale (dynamic activations): "
            "weight-only DQ, TensorRT will run these in 16-bit: " + ", ".join(result.dynamic),
            NoteKind.DYNAMIC_LAYERS))
    if result.max_scale_rounding > 0:
        result.notes.append(
            f"scales stored as {sdtype}: largest relative rounding {result.max_scale_rounding:.2e}")
    return result
