"""NVIDIA ModelOpt's ONNX FP8 quantizer as a reference, and a node-by-node Q/DQ comparison.

``modelopt_fp8`` runs ``modelopt.onnx.quantization.quantize(quantize_mode="fp8",
calibration_eps=["cpu"])`` on a plain graph (no Q/DQ) at test time. ``describe`` reduces a graph to
what TensorRT's FP8 fusion depends on, per GEMM input: is it quantized, is it a weight, how the
weight is stored, per-tensor or per-channel, scale dtype, zero point, which attributes are
written, what sits between the DequantizeLinear and the GEMM. ``differences`` lines two
descriptions up GEMM by GEMM (keyed by the GEMM's output tensor, which both tools keep from the
plain graph) and returns every field that differs, with both values.

Why generated at test time rather than stored: the comparison is only meaningful against the
graph our exporter produces *now* (a stored ModelOpt graph goes stale whenever torch,
transformers or our exporter change the traced structure, and its node names then stop lining
up), ModelOpt runs on CPU in seconds, and the pinned version (``MODELOPT_VERSION``) installs
without its GPU extras (see pyproject's dev extras and docs/onnx.md).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MODELOPT_VERSION = "0.47.0"
GEMMS = ("MatMul", "Gemm")
E4M3FN = 17
# ModelOpt converts ORT's INT8 scale (amax / 127) with "* 448 / 127" (modelopt/onnx/quantization/
# fp8.py, int8_to_fp8; NVIDIA/Model-Optimizer#215): its FP8 scale is amax * 448 / 127**2.
MODELOPT_SCALE_FACTOR = (448.0 / 127.0) ** 2


def modelopt_fp8(plain: Path, out: Path, feed: dict[str, np.ndarray], **options):
    """Quantize ``plain`` with ModelOpt's ONNX FP8 PTQ on CPU; returns the loaded ModelProto."""
    import onnx
    from modelopt.onnx.quantization import quantize

    args = dict(calibration_eps=["cpu"], log_level="ERROR")
    args.update(options)
    quiet = logging.getLogger("modelopt")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            quantize(onnx_path=str(plain), quantize_mode="fp8", calibration_data=feed,
                     output_path=str(out), **args)
    finally:
        quiet.setLevel(level)
    return onnx.load(str(out))


@dataclass(frozen=True)
class InputQuant:
    """How one GEMM input reaches the GEMM."""

    quantized: bool
    weight: bool = False  # rooted at a constant
    storage: str = ""  # "fp8-initializer" | "float-initializer+Q" | "activation"
    granularity: str = ""  # "per-tensor" | "per-channel"
    scale_dtype: str = ""
    zero_point: str = ""  # dtype and whether all zero
    axis: str = ""  # "written" | "omitted"
    saturate: str = ""  # Q's saturate attribute: "1" | "0" | "default (1)"; weights: "-"
    between: tuple[str, ...] = ()  # ops between DQ and GEMM
    dq_output: str = ""


@dataclass
class GraphQuant:
    opset: int
    gemms: dict[str, tuple[str, InputQuant, InputQuant]]  # key -> (op, input A, input B)
    other_dq_consumers: Counter = field(default_factory=Counter)  # op types fed by a DQ
    weight_scale_max: dict[str, float] = field(default_factory=dict)  # gemm key -> max scale
    act_scale: dict[str, float] = field(default_factory=dict)  # gemm key -> activation scale
    act_source: dict[str, str] = field(default_factory=dict)  # gemm key -> activation DQ output

    @property
    def quantized(self) -> set[str]:
        return {k for k, (_, a, b) in self.gemms.items() if a.quantized and b.quantized}


def _attr(node, name):
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return None


def _dtype_name(code: int) -> str:
    from onnx import TensorProto

    return TensorProto.DataType.Name(code)


def describe(model) -> GraphQuant:
    """The Q/DQ facts of ``model`` that TensorRT's FP8 GEMM fusion depends on."""
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant":
            inits[n.output[0]] = n.attribute[0].t
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in g.output}
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))

    def value(name):
        return numpy_helper.to_array(inits[name]).astype(np.float32)

    def key_of(gemm) -> str:
        # ModelOpt keeps fp32 graph outputs behind a Cast; key the GEMM by the graph output then
        out = gemm.output[0]
        cs = consumers.get(out, [])
        if len(cs) == 1 and cs[0].op_type == "Cast" and cs[0].output[0] in outputs:
            return cs[0].output[0]
        return out

    def dq_of(name: str) -> str:
        while name in producer and producer[name].op_type in ("Cast", "Transpose", "Reshape"):
            name = producer[name].input[0]
        return name

    def input_quant(name: str) -> tuple[InputQuant, np.ndarray | None]:
        between = []
        cur = name
        while cur in producer and producer[cur].op_type in ("Cast", "Transpose", "Reshape"):
            between.append(producer[cur].op_type)
            cur = producer[cur].input[0]
        dq = producer.get(cur)
        if dq is None or dq.op_type != "DequantizeLinear":
            return InputQuant(False), None
        x, scale_name = dq.input[0], dq.input[1]
        zp = dq.input[2] if len(dq.input) > 2 else ""
        q = producer.get(x)
        if x in inits:
            weight, storage = True, "fp8-initializer"
        elif q is not None and q.op_type == "QuantizeLinear" and q.input[0] in inits:
            weight, storage = True, "float-initializer+Q"
        else:
            weight, storage = False, "activation"
        scale = value(scale_name)
        zp_desc = "none"
        if zp:
            zp_desc = f"{_dtype_name(inits[zp].data_type)}, " + \
                ("all zero" if not np.any(value(zp)) else "nonzero")
        sat = "-"
        if not weight and q is not None and q.op_type == "QuantizeLinear":
            s = _attr(q, "saturate")
            sat = "default (1)" if s is None else str(s)
        axes = {_attr(n, "axis") is not None for n in (dq, q) if n is not None
                and n.op_type in ("QuantizeLinear", "DequantizeLinear")}
        out_dtype = _attr(dq, "output_dtype") or inits[scale_name].data_type
        return InputQuant(
            quantized=True, weight=weight, storage=storage,
            granularity="per-tensor" if scale.size == 1 else "per-channel",
            scale_dtype=_dtype_name(inits[scale_name].data_type), zero_point=zp_desc,
            axis="written" if axes == {True} else "omitted" if axes == {False} else "mixed",
            saturate=sat, between=tuple(between), dq_output=_dtype_name(out_dtype)), scale

    desc = GraphQuant(opset=int(opset), gemms={})
    gemm_inputs = set()
    for n in g.node:
        if n.op_type not in GEMMS:
            continue
        (a, sa), (b, sb) = input_quant(n.input[0]), input_quant(n.input[1])
        key = key_of(n)
        desc.gemms[key] = (n.op_type, a, b)
        if sb is not None and b.weight:
            desc.weight_scale_max[key] = float(sb.max())
        if sa is not None and not a.weight and sa.size == 1:
            desc.act_scale[key] = float(sa.reshape(()))
            desc.act_source[key] = dq_of(n.input[0])
        gemm_inputs.update(n.input[:2])
    for n in g.node:
        if n.op_type == "DequantizeLinear":
            for c in consumers.get(n.output[0], []):
                if c.op_type not in GEMMS and c.op_type not in ("Cast", "Transpose", "Reshape"):
                    desc.other_dq_consumers[c.op_type] += 1
    return desc


def differences(ours: GraphQuant, ref: GraphQuant) -> dict[tuple[str, str], set[tuple]]:
    """Field-by-field differences on the GEMMs both graphs quantize.

    Keys are ``(side, field)`` with side "activation" or "weight" (an attention BMM has two
    activation sides), values the set of ``(ours, reference)`` pairs seen.
    """
    out: dict[tuple[str, str], set[tuple]] = {}
    for key in sorted(ours.quantized & ref.quantized):
        _, oa, ob = ours.gemms[key]
        _, ra, rb = ref.gemms[key]
        for mine, theirs in ((oa, ra), (ob, rb)):
            side = "weight" if mine.weight else "activation"
            for f in InputQuant.__dataclass_fields__:
                a, b = getattr(mine, f), getattr(theirs, f)
                if a != b:
                    out.setdefault((side, f), set()).add((a, b))
    return out
