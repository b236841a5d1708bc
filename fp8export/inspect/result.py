"""What ``inspect`` found: one row per tensor plus a summary, JSON-serialisable."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TensorRow:
    """One stored tensor.

    ``amax`` is max|x| of the values the tensor stands for: for an FP8 weight, the dequantized
    values (``max|q| * weight_scale``). ``scale`` is the weight's dequantization factor: read
    from ``<m>.weight_scale`` in an FP8 folder, or the one convert would give it (amax / 448)
    for a 2-D float weight of a checkpoint. ``sqnr_db`` is the weight round-trip SQNR: from the
    manifest for an FP8 folder, computed (quantize, dequantize, compare) for a checkpoint.
    """

    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    role: str  # "quantized" | "candidate" | "scale" | "float" | "other"
    amax: float | None = None
    scale: float | None = None
    input_scale: float | None = None
    sqnr_db: float | None = None
    scale_source: str | None = None  # "weights" | "history" | "calibration" | "computed" ...
    input_scale_source: str | None = None
    note: str | None = None
    fused_group: str | None = None  # siblings sharing one scale: "model.layers.0.self_attn.qkv"


@dataclass
class InspectResult:
    """The result of :func:`fp8export.inspect.inspect`; ``to_dict`` is JSON-safe."""

    path: str
    kind: str  # "checkpoint" | "fp8-folder" | "onnx"
    reader: str | None = None  # the checkpoint reader's kind ("hf-folder", "safetensors", ...)
    tensors: list[TensorRow] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plot: str | None = None  # the plot written (.svg or .png), if any
    training_state: dict[str, Any] | None = None  # framework, version, histories (checkpoints)
    ok: bool = True  # False when an ONNX check failed
    report_text: str | None = None  # the ONNX checker's own text, for kind == "onnx"
    report: Any = None  # the ONNX checker's JSON-safe dict, when it offers one

    def to_dict(self) -> dict[str, Any]:
        """Plain data; non-finite floats become the strings "inf", "-inf", "nan" (strict JSON)."""
        return _json_safe(asdict(self))

    def to_text(self) -> str:
        from fp8export.inspect.render import render_text

        return render_text(self)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
