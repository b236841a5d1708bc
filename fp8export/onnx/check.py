"""Structural checker: does an ONNX graph follow the FP8 profile TensorRT fuses? (DESIGN.md)

``check_model(path_or_model) -> CheckReport``. Rules, each with its TensorRT/ONNX source (see
docs/onnx.md and ``shared/reference/tensorrt_fp8_onnx.md`` sections 1, 2, 5):

``opset``            default-domain opset >= 19 (FP8 Q/DQ types, ONNX Changelog); 21 is the profile.
``ir-version``       IR version <= 13, the newest onnxruntime 1.31 loads (export writes 10, or 11
                     at opset 23).
``custom-domain``    no custom-domain ops: TensorRT would need a plugin (onnx-tensorrt importer).
``op``               only the standard ops export-onnx emits for transformer models (:data:`OPS`):
                     no control flow (``Loop``/``Scan``/``If``: a graph from elsewhere could loop
                     for ever), sequences or random ops. Checked before anything runs a graph.
``axis``             every per-channel Q/DQ writes ``axis`` (TRT 10.1 parser defaulted a missing
                     axis to 0, later parsers to 1); a scalar scale makes ``axis`` meaningless, so
                     per-tensor Q/DQ may omit it (ModelOpt does).
``scale``            scales are constants, positive and finite, FP32/FP16/BF16 (NvInfer.h
                     IQuantizeLayer; TRT #4817), per-tensor for activations ("activations cannot be
                     quantized per-channel"); only a DQ rooted at a constant (an initializer, or a Q
                     of one) may be per-channel.
``scale-dtype``      a Q's scale dtype equals its input dtype (TRT <= 10.12 strongly typed rule;
                     opset < 23 ONNX rule); an fp32 scale with 16-bit input is allowed from opset
                     23 and TRT 10.13 (warning).
``zero-point``       the quantized type is FLOAT8E4M3FN, taken from a zero point (else
                     ``output_dtype``, which exists only from opset 21, else TRT reads INT8:
                     onnx-tensorrt QuantDequantLinearHelper); zero points are constant, 0 and
                     shaped like the scale (ONNX rule);
                     E5M2/FNUZ are rejected (TRT: E4M3FN only).
``quantized-constant`` FP8 initializers feed only DequantizeLinear ("Quantized constant is only
                     allowed before DQ or PLUGIN_V2 node", TRT #3919).
``gemm-inputs``      a GEMM fed by a DQ has both inputs straight from DQs, nothing between (a Cast
                     between DQ and GEMM blocks the fusion, ModelOpt PR #1289); both DQs emit the
                     same dtype ("IMatrixMultiplyLayer must have same input types").

Each MatMul/Gemm with a DQ input is listed as FP8-eligible or not, with the reason. A GEMM whose
weight is FP8 but whose activation is not quantized (dynamic activations) is legal but runs in
16-bit in TensorRT ("quantize every input of a weighted op", TensorRT explicit-quantization doc):
a warning, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_FLOAT_SCALES = {1: "FLOAT", 10: "FLOAT16", 16: "BFLOAT16"}
_E4M3FN = 17
_FP8_TYPES = {17: "FLOAT8E4M3FN", 18: "FLOAT8E4M3FNUZ", 19: "FLOAT8E5M2", 20: "FLOAT8E5M2FNUZ"}
_PASS_THROUGH = {"Cast", "Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"}
_GEMMS = {"MatMul", "Gemm"}
_STANDARD_DOMAINS = {"", "ai.onnx"}
# Standard ops of the graphs torch.onnx (dynamo) emits for transformers models — measured on
# Llama, Qwen2, Mistral, Phi-3, Gemma, GPT-2, OPT and BERT exports, and TopK of the MoE routers
# of Mixtral and Qwen3-MoE — plus the Q/DQ rewrite, the opset-23 transformer ops and the
# elementwise/normalisation ops of Keras exports. Anything else (control flow, sequences,
# random numbers) is not a graph fp8export wrote.
OPS = frozenset("""
    Abs Add And ArgMax Attention AveragePool BatchNormalization Cast CastLike Ceil Clip Concat
    Constant ConstantOfShape Conv Cos CumSum DequantizeLinear Div Dropout Einsum Elu Equal Erf
    Exp Expand Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool Greater
    GreaterOrEqual GroupNormalization HardSigmoid HardSwish Identity InstanceNormalization IsInf
    IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax MatMul Max MaxPool Mean
    Min Mod Mul Neg Not Or Pad Pow QuantizeLinear Range Reciprocal ReduceL2 ReduceMax ReduceMean
    ReduceMin ReduceProd ReduceSum Relu Reshape RMSNormalization RotaryEmbedding Round
    ScatterElements ScatterND Selu Shape Sigmoid Sign Sin Size Slice Softmax Softplus Split
    Sqrt Squeeze Sub Sum Tanh Tile TopK Transpose Trilu Unsqueeze Where Xor
""".split())
# onnxruntime 1.31: "Unsupported model IR version: 14, max supported IR version: 13"
ORT_MAX_IR = 13


@dataclass(frozen=True)
class Issue:
    severity: str  # "error" | "warning"
    rule: str
    where: str  # node or tensor name
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"severity": self.severity, "rule": self.rule, "where": self.where,
                "message": self.message}


@dataclass(frozen=True)
class GemmInfo:
    node: str
    op_type: str
    layer: str  # the linear's name (weight initializer without ".weight"), else the node name
    fp8: bool  # TensorRT can fuse it into an FP8 GEMM
    reason: str  # why not (empty when fp8)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "layer": self.layer, "fp8": self.fp8,
                "reason": self.reason}


@dataclass
class CheckReport:
    source: str
    opset: int
    ir_version: int
    issues: list[Issue] = field(default_factory=list)
    gemms: list[GemmInfo] = field(default_factory=list)  # GEMMs with at least one DQ input
    float_gemms: int = 0  # GEMMs with no DQ input at all (attention BMMs, lm_head, ...)
    metadata: dict[str, str] = field(default_factory=dict)  # the model's metadata_props

    @property
    def ok(self) -> bool:
        return not any(i.severity == "error" for i in self.issues)

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.severity == "error"]

    @property
    def fp8_gemms(self) -> list[GemmInfo]:
        return [g for g in self.gemms if g.fp8]

    @property
    def sixteen_bit_gemms(self) -> list[GemmInfo]:
        return [g for g in self.gemms if not g.fp8]

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "ok": self.ok, "opset": self.opset,
                "ir_version": self.ir_version, "issues": [i.to_dict() for i in self.issues],
                "gemms": [g.to_dict() for g in self.gemms],
                "fp8_gemms": [g.node for g in self.fp8_gemms],  # ONNX node names (engine build)
                "sixteen_bit_gemms": [g.to_dict() for g in self.sixteen_bit_gemms],
                "fp8_gemm_count": len(self.fp8_gemms),
                "sixteen_bit_gemm_count": len(self.sixteen_bit_gemms),
                "float_gemm_count": self.float_gemms}

    def to_text(self, errors_only: bool = False) -> str:
        lines = []
        if not errors_only:
            lines.append(f"{self.source}: opset {self.opset}, IR {self.ir_version}: "
                         f"{'OK' if self.ok else 'FAILS the FP8 profile'}")
            lines.append(f"  FP8-eligible GEMMs (TensorRT): {len(self.fp8_gemms)}")
            for g in self.sixteen_bit_gemms:
                lines.append(f"  16-bit GEMM {g.layer} ({g.op_type}): {g.reason}")
            lines.append(f"  unquantized GEMMs (no Q/DQ, by design or exclusion): "
                         f"{self.float_gemms}")
        for i in self.issues:
            if errors_only and i.severity != "error":
                continue
            lines.append(f"  {i.severity.upper()} [{i.rule}] {i.where}: {i.message}")
        return "\n".join(lines)


class _Graph:
    """Lookups over one graph: constants, producers, consumers, value types."""

    def __init__(self, model, base_dir: str | None):
        import onnx

        self.model = model
        self.base_dir = base_dir
        g = model.graph
        self.inits = {t.name: t for t in g.initializer}
        self.constants = {}  # Constant node outputs -> TensorProto
        for n in g.node:
            if n.op_type == "Constant" and n.domain in _STANDARD_DOMAINS:
                for a in n.attribute:
                    if a.name == "value":
                        self.constants[n.output[0]] = a.t
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.types: dict[str, int] = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # shape inference is best effort; onnx.checker reports the cause
            inferred = model
        for v in (*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info):
            if v.type.HasField("tensor_type"):
                self.types[v.name] = v.type.tensor_type.elem_type
        for name, t in {**self.inits, **self.constants}.items():
            self.types[name] = t.data_type

    def const(self, name: str):
        return self.inits.get(name) or self.constants.get(name)

    def value(self, name: str) -> np.ndarray:
        from onnx import numpy_helper

        t = self.const(name)
        return numpy_helper.to_array(t, self.base_dir or "").astype(np.float32)


def _attr(node, name: str):
    for a in node.attribute:
        if a.name == name:
            import onnx

            return onnx.helper.get_attribute_value(a)
    return None


def _weight_root(g: _Graph, name: str):
    """The constant a Q/DQ input is rooted at: itself, or the constant behind a Q; else None.

    TensorRT quantizes per-channel only along a constant (a weight): an FP8 initializer -> DQ
    (our export) or a float initializer -> Q -> DQ (ModelOpt's ONNX quantizer).
    """
    t = g.const(name)
    if t is not None:
        return t
    p = g.producer.get(name)
    if p is not None and p.op_type == "QuantizeLinear" and p.domain in _STANDARD_DOMAINS:
        return g.const(p.input[0])
    return None


def _check_scale(g: _Graph, node, issues: list[Issue], *, activation: bool) -> None:
    name = node.input[1] if len(node.input) > 1 else ""
    where = node.name or node.output[0]
    t = g.const(name)
    if t is None:
        src = g.producer.get(name)
        made = f" (computed by {src.op_type} {src.name or src.output[0]!r})" if src else \
            " (a graph input)"
        issues.append(Issue("error", "scale", where, f"scale {name!r} is not a constant "
                            f"initializer{made}; TensorRT needs build-time constant scales."))
        return
    if t.data_type not in _FLOAT_SCALES:
        issues.append(Issue("error", "scale", where, f"scale {name} has ONNX type "
                            f"{t.data_type}; TensorRT takes FP32, FP16 or BF16 scales."))
        return
    v = g.value(name)
    if v.size == 0 or not np.all(np.isfinite(v)) or not np.all(v > 0):
        issues.append(Issue("error", "scale", where, f"scale {name} must be positive and finite "
                            f"(min {float(v.min()) if v.size else 'empty'})."))
    if activation and v.size != 1:
        issues.append(Issue("error", "scale", where, f"activation scale {name} has {v.size} "
                            "values; TensorRT quantizes activations per-tensor only."))
    elif v.ndim > 1 and _attr(node, "block_size") in (None, 0):
        issues.append(Issue("error", "scale", where, f"scale {name} has rank {v.ndim}; use a "
                            "scalar (per-tensor) or 1-D (per-channel) scale."))
    elif v.ndim == 1 and v.size > 1:  # per-channel weight: one scale per slice along axis
        w = _weight_root(g, node.input[0])
        axis = _attr(node, "axis")
        if axis is None:
            issues.append(Issue("error", "axis", where, f"per-channel {node.op_type} has no "
                                "explicit axis; TensorRT 10.1 defaulted it to 0, later parsers "
                                "to 1. Write axis."))
            return
        if w is not None and len(w.dims) > 0 and w.dims[axis % len(w.dims)] != v.size:
            issues.append(Issue("error", "scale", where, f"per-channel scale {name} has "
                                f"{v.size} values but the weight has {w.dims[axis % len(w.dims)]} "
                                f"along axis {axis}."))


def _check_zero_point(g: _Graph, node, issues: list[Issue], opset: int) -> None:
    where = node.name or node.output[0]
    zp = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if zp is None:
        if node.op_type == "QuantizeLinear":
            od = _attr(node, "output_dtype")
            if od == _E4M3FN and opset >= 21:
                return
            if od is not None and opset < 21:
                issues.append(Issue(
                    "error", "zero-point", where,
                    f"QuantizeLinear has no zero point, and output_dtype does not exist before "
                    f"opset 21 (this graph: {opset}); at opset 19/20 only an FLOAT8E4M3FN zero "
                    "point makes the output FP8, else TensorRT's parser quantizes to INT8. Add "
                    "the zero point."))
                return
            issues.append(Issue(
                "error", "zero-point", where,
                "QuantizeLinear has neither an FP8 zero point nor output_dtype=FLOAT8E4M3FN; "
                "TensorRT's parser then quantizes to INT8 (and onnxruntime to uint8). Add an "
                "all-zero FLOAT8E4M3FN zero point."))
        return
    t = g.const(zp)
    if t is None:
        issues.append(Issue("error", "zero-point", where, f"zero point {zp} is not a constant."))
        return
    if t.data_type != _E4M3FN:
        kind = _FP8_TYPES.get(t.data_type, f"ONNX type {t.data_type}")
        issues.append(Issue("error", "zero-point", where, f"zero point {zp} is {kind}; the "
                            "profile (and TensorRT) use FLOAT8E4M3FN."))
        return
    if np.any(g.value(zp) != 0):
        issues.append(Issue("error", "zero-point", where, f"zero point {zp} is not 0; TensorRT "
                            "supports symmetric quantization only."))
    s = g.const(node.input[1])
    if s is not None and tuple(s.dims) != tuple(t.dims):
        issues.append(Issue("error", "zero-point", where, f"zero point {zp} has shape "
                            f"{list(t.dims)} but the scale has {list(s.dims)}; ONNX requires the "
                            "same shape (onnxruntime refuses the node)."))


def _scale_dtype(g: _Graph, node) -> int | None:
    t = g.const(node.input[1]) if len(node.input) > 1 else None
    return t.data_type if t is not None else None


def _dq_out_dtype(g: _Graph, node) -> int | None:
    return _attr(node, "output_dtype") or _scale_dtype(g, node)


def _layer_name(g: _Graph, node, dq_b) -> str:
    if dq_b is not None:
        src = dq_b.input[0]
        p = g.producer.get(src)
        if p is not None and p.op_type == "QuantizeLinear":  # float weight -> Q -> DQ
            src = p.input[0]
        if src in g.inits or src in g.constants:
            return src[: -len(".weight")] if src.endswith(".weight") else src
    return node.name or node.output[0]


def _trace(g: _Graph, name: str):
    """(DQ node or None, ops between) for a GEMM input."""
    between = []
    cur = name
    for _ in range(8):
        p = g.producer.get(cur)
        if p is None:
            return None, between
        if p.op_type == "DequantizeLinear":
            return p, between
        if p.op_type not in _PASS_THROUGH:
            return None, between
        between.append(p.op_type)
        cur = p.input[0]
    return None, between


def check_ops(model) -> list[Issue]:
    """The ``custom-domain`` and ``op`` rules alone: what must hold before a graph is run."""
    issues = []
    for o in model.opset_import:
        if o.domain not in _STANDARD_DOMAINS:
            issues.append(Issue("error", "custom-domain", "model", f"opset import of custom "
                                f"domain {o.domain!r}: not in the standard profile."))
    for node in model.graph.node:
        where = node.name or (node.output[0] if node.output else node.op_type)
        if node.domain not in _STANDARD_DOMAINS:
            issues.append(Issue("error", "custom-domain", where, f"{node.domain}::{node.op_type} "
                                "is a custom op; TensorRT needs a plugin and onnxruntime a "
                                "contrib kernel. Use standard ops only."))
        elif node.op_type not in OPS:
            issues.append(Issue("error", "op", where, f"{node.op_type} is not an op "
                                "export-onnx emits (no control flow, sequences or random ops); "
                                "fp8export checks and runs only graphs of its own profile."))
    return issues


def check_model(path_or_model, *, source: str | None = None) -> CheckReport:
    """Check a model (path or ``onnx.ModelProto``) against the FP8 profile."""
    from fp8export.onnx.load import load_onnx

    base_dir = None
    if isinstance(path_or_model, (str, Path)):
        path = Path(path_or_model)
        model = load_onnx(path)
        base_dir = str(path.parent)
        source = source or str(path)
    else:
        model = path_or_model
        source = source or (model.graph.name or "model")
    g = _Graph(model, base_dir)
    opset = next((o.version for o in model.opset_import if o.domain in _STANDARD_DOMAINS), 0)
    report = CheckReport(source=source, opset=int(opset), ir_version=int(model.ir_version),
                         metadata={p.key: p.value for p in model.metadata_props})
    issues = report.issues
    if opset < 19:
        issues.append(Issue("error", "opset", "model", f"opset {opset}: FP8 Q/DQ needs >= 19 "
                            "(the profile uses 21). Re-export with --opset 21."))
    if model.ir_version > ORT_MAX_IR:
        issues.append(Issue("error", "ir-version", "model", f"IR version {model.ir_version}: "
                            f"onnxruntime 1.31 loads IR <= {ORT_MAX_IR}. Set model.ir_version to "
                            "the minimum its opset needs (onnx.helper.find_min_ir_version_for)."))
    issues.extend(check_ops(model))
    for node in model.graph.node:
        where = node.name or (node.output[0] if node.output else node.op_type)
        if node.domain not in _STANDARD_DOMAINS:
            continue
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            for i, name in enumerate(node.input):
                if g.types.get(name) in _FP8_TYPES and name in g.inits:
                    issues.append(Issue(
                        "error", "quantized-constant", where,
                        f"FP8 initializer {name} feeds {node.op_type} (input {i}); a quantized "
                        "constant may only feed DequantizeLinear (TensorRT #3919)."))
            continue
        is_q = node.op_type == "QuantizeLinear"
        x = node.input[0]
        _check_zero_point(g, node, issues, opset)
        if is_q:
            _check_scale(g, node, issues, activation=g.const(x) is None)
            xt, st = g.types.get(x), _scale_dtype(g, node)
            if xt and st and xt != st:
                if opset >= 23 and st == 1:
                    issues.append(Issue("warning", "scale-dtype", where,
                                        "fp32 scale with a 16-bit input: needs opset 23 and "
                                        "TensorRT >= 10.13."))
                else:
                    issues.append(Issue("error", "scale-dtype", where, f"scale type {st} differs "
                                        f"from the input type {xt}; make the scale dtype the "
                                        "activation dtype."))
        else:
            xt = g.types.get(x)
            if xt is not None and xt != _E4M3FN:
                kind = _FP8_TYPES.get(xt, f"ONNX type {xt}")
                issues.append(Issue("error", "zero-point", where, f"DequantizeLinear input {x} "
                                    f"is {kind}; TensorRT's FP8 type is FLOAT8E4M3FN."))
            _check_scale(g, node, issues, activation=_weight_root(g, x) is None)
    _check_gemms(g, report)
    return report


def _check_gemms(g: _Graph, report: CheckReport) -> None:
    for node in g.model.graph.node:
        if node.op_type not in _GEMMS or node.domain not in _STANDARD_DOMAINS:
            continue
        where = node.name or node.output[0]
        (dq_a, via_a), (dq_b, via_b) = _trace(g, node.input[0]), _trace(g, node.input[1])
        if dq_a is None and dq_b is None:
            report.float_gemms += 1
            continue
        layer = _layer_name(g, node, dq_b)
        reason = ""
        for side, dq, via in (("activation", dq_a, via_a), ("weight", dq_b, via_b)):
            if dq is not None and via:
                sev = "error" if "Cast" in via else "warning"
                msg = (f"{'/'.join(via)} between the {side} DequantizeLinear and the "
                       f"{node.op_type}; the DQ must feed the GEMM directly")
                report.issues.append(Issue(sev, "gemm-inputs", where, msg + "."))
                reason = reason or msg
        if not reason and dq_b is None:
            reason = "the weight input is not from a DequantizeLinear"
            report.issues.append(Issue("warning", "gemm-inputs", where, reason + "."))
        if not reason and dq_a is None:
            reason = ("the activation input is not quantized (no static input scale): TensorRT "
                      "runs this GEMM in 16-bit with the dequantized weight")
            report.issues.append(Issue("warning", "gemm-inputs", layer, reason + "."))
        if not reason:
            ta, tb = _dq_out_dtype(g, dq_a), _dq_out_dtype(g, dq_b)
            if ta != tb:
                reason = f"its two DequantizeLinear outputs differ in dtype ({ta} vs {tb})"
                report.issues.append(Issue("error", "gemm-inputs", where, reason + "; "
                                           "TensorRT needs equal GEMM input types."))
        report.gemms.append(GemmInfo(where, node.op_type, layer, not reason, reason))
