"""Per-layer precision of a built engine, from IEngineInspector JSON (TensorRT 10.x and 11.x).

TensorRT never reports a quantized GEMM that fell back to 16-bit kernels; this module does.
Schemas (reference/tensorrt_fp8_onnx.md §3.5): 10.x tensors carry one ``"Format/Datatype"``
string and the top level lists ``"Bindings"``; 11.x splits it into a data type and a format
field and renames ``"Bindings"`` to ``"I/O Tensors"`` (TensorRT docs, "Migrating
IEngineInspector Usage from TensorRT 10.x to 11.x", spell the type key ``DataType``; we accept
either capitalisation). ``trtexec --profilingVerbosity=detailed --exportLayerInfo=F`` writes the
same document (``{"Layers": [...], "Bindings": [...]}``, e.g. NVIDIA/TensorRT#4020). A layer runs
in FP8 when its
tactic name contains ``e4m3`` (e.g. ``sm90_xmma_gemm_e4m3bf16_e4m3f32_f32``) or its GEMM
inputs are FP8. Engines built without DETAILED profiling verbosity list only layer names;
then nothing can be said and the report says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_FP8_WORDS = ("fp8", "float8", "e4m3")
_GEMM_TYPES = ("gemm", "matrixmultiply", "matmul", "fullyconnected")


_DTYPE_KEYS = ("datatype", "format/datatype")


def tensor_dtype(tensor: dict[str, Any]) -> str:
    """Normalised dtype of one inspector tensor entry.

    One of FP8, FP16, BF16, FP32, INT8, INT32, INT64, unknown.
    """
    if not isinstance(tensor, dict):
        return "unknown"
    fields = {str(k).lower(): v for k, v in tensor.items()}
    text = str(next((fields[k] for k in _DTYPE_KEYS if fields.get(k)), "")).lower()
    if any(w in text for w in _FP8_WORDS):
        return "FP8"
    if "bf16" in text or "bfloat16" in text:
        return "BF16"
    if "fp16" in text or "half" in text or "float16" in text:
        return "FP16"
    if "int8" in text:
        return "INT8"
    if "int32" in text:
        return "INT32"
    if "int64" in text:
        return "INT64"
    if "fp32" in text or "float" in text:
        return "FP32"
    return "unknown"


@dataclass(frozen=True)
class LayerPrecision:
    name: str
    layer_type: str
    tactic: str
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    onnx_nodes: tuple[str, ...]  # ONNX node names TensorRT attributes to this layer

    @property
    def is_gemm(self) -> bool:
        lt = self.layer_type.lower()
        return any(t in lt for t in _GEMM_TYPES) or "gemm" in self.tactic.lower()

    @property
    def is_fp8(self) -> bool:
        return "e4m3" in self.tactic.lower() or (self.is_gemm and "FP8" in self.input_dtypes)


@dataclass
class EngineLayerReport:
    schema: str  # "10.x", "11.x" or "names-only"
    layers: list[LayerPrecision] = field(default_factory=list)
    fp8_gemms: list[str] = field(default_factory=list)  # ONNX GEMM nodes that run in FP8
    fallback_gemms: list[str] = field(default_factory=list)  # expected FP8 but are not
    unattributed: list[str] = field(default_factory=list)  # expected, not found in any layer
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "layer_count": len(self.layers),
            "fp8_layers": [layer.name for layer in self.layers if layer.is_fp8],
            "fp8_gemms": self.fp8_gemms,
            "fallback_gemms": self.fallback_gemms,
            "unattributed_gemms": self.unattributed,
            "precision_histogram": precision_histogram(self.layers),
            "notes": self.notes,
        }


def precision_histogram(layers: list[LayerPrecision]) -> dict[str, int]:
    hist: dict[str, int] = {}
    for layer in layers:
        first = layer.input_dtypes[0] if layer.input_dtypes else "unknown"
        key = "FP8" if layer.is_fp8 else first
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items()))


_ONNX_NAME = re.compile(r"\[ONNX Layer: ([^\]]+)\]")


def _onnx_nodes(layer: dict[str, Any]) -> tuple[str, ...]:
    meta = str(layer.get("Metadata", "")) + " " + str(layer.get("Name", ""))
    found = _ONNX_NAME.findall(meta)
    return tuple(dict.fromkeys(n.strip() for n in found))


def parse_engine_information(info: str | dict[str, Any]) -> tuple[str, list[LayerPrecision]]:
    """Parse ``inspector.get_engine_information(JSON)`` output into layers and a schema tag."""
    data = json.loads(info) if isinstance(info, str) else info
    if isinstance(data, list):  # one layer per entry, as get_layer_information concatenated
        data = {"Layers": data}
    if not isinstance(data, dict) or not isinstance(data.get("Layers", []), list):
        raise ValueError("engine information must be an object with a 'Layers' list")
    raw_layers = data.get("Layers", [])
    if raw_layers and all(isinstance(r, str) for r in raw_layers):
        return "names-only", [LayerPrecision(n, "", "", (), (), ()) for n in raw_layers]
    raw_layers = [r for r in raw_layers if isinstance(r, dict)]
    split_fields = any(
        str(k).lower() == "datatype"
        for raw in raw_layers for t in raw.get("Inputs", []) + raw.get("Outputs", [])
        if isinstance(t, dict) for k in t
    )
    schema = "11.x" if "I/O Tensors" in data or split_fields else "10.x"
    layers = []
    for raw in raw_layers:
        layers.append(LayerPrecision(
            name=str(raw.get("Name", "")),
            layer_type=str(raw.get("LayerType", "")),
            tactic=str(raw.get("TacticName", "")),
            input_dtypes=tuple(tensor_dtype(t) for t in raw.get("Inputs", [])),
            output_dtypes=tuple(tensor_dtype(t) for t in raw.get("Outputs", [])),
            onnx_nodes=_onnx_nodes(raw),
        ))
    return schema, layers


def attribute_gemms(info: str | dict[str, Any], expected_fp8: list[str]) -> EngineLayerReport:
    """Say which of the ONNX GEMMs the structural checker called FP8-eligible really run in FP8.

    Args:
        info: the engine inspector's JSON.
        expected_fp8: ONNX node names of the MatMul/Gemm nodes with Q/DQ on both inputs.
    """
    schema, layers = parse_engine_information(info)
    report = EngineLayerReport(schema=schema, layers=layers)
    if schema == "names-only":
        report.notes.append("engine built without DETAILED profiling verbosity: precisions unknown")
        report.unattributed = list(expected_fp8)
        return report
    owner: dict[str, LayerPrecision] = {}
    for layer in layers:
        for node in layer.onnx_nodes:
            owner.setdefault(node, layer)
    for node in expected_fp8:
        layer = owner.get(node)
        if layer is None:
            # Myelin "ForeignNode" regions hide their inner layers; name matching may fail too.
            match = [candidate for candidate in layers if node in candidate.name]
            layer = match[0] if match else None
        if layer is None:
            report.unattributed.append(node)
        elif layer.is_fp8:
            report.fp8_gemms.append(node)
        else:
            report.fallback_gemms.append(node)
    if report.fallback_gemms:
        report.notes.append(
            f"{len(report.fallback_gemms)} quantized GEMM(s) fell back to higher precision: "
            + ", ".join(report.fallback_gemms[:5])
        )
    if report.unattributed:
        report.notes.append(
            f"{len(report.unattributed)} quantized GEMM(s) could not be matched to an engine "
            "layer (fused into an opaque region); their precision is unverified."
        )
    return report
