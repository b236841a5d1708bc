"""Golden Q/DQ patterns around one linear (tests/golden/qdq_*.json).

The pattern (op sequence, wiring, attributes, initializer dtypes/shapes) is what TensorRT's FP8
fusion depends on; any change to it must be deliberate. Regenerate after a reviewed change with
``FP8EXPORT_UPDATE_GOLDEN=1 pytest tests/onnx/test_golden.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from onnx_graphs import qdq_pattern, single_linear_model

from fp8export.fp8dir.reader import QuantLayer
from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _compare(name: str, pattern: dict) -> None:
    path = GOLDEN / f"{name}.json"
    text = json.dumps(pattern, indent=2, sort_keys=True) + "\n"
    if os.environ.get("FP8EXPORT_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.is_file(), f"missing golden {path}; run with FP8EXPORT_UPDATE_GOLDEN=1"
    assert json.loads(path.read_text()) == pattern


def _gemm_fed_by(model, tensor: str) -> str:
    return next(n.name for n in model.graph.node if n.op_type == "MatMul" and tensor in n.input)


@pytest.mark.parametrize("layer", ["q_proj", "k_proj"])
def test_llama_attention_projection(onnx_fp32, layer):
    """q_proj owns the Q/DQ of the shared attention input; k_proj reuses it (same scale)."""
    import onnx

    model = onnx.load(str(onnx_fp32[1]))
    gemm = _gemm_fed_by(model, f"model.layers.0.self_attn.{layer}.weight_dq")
    # scale values depend on convert's calibration of a random model: pin the pattern only
    _compare(f"qdq_llama_{layer}_fp32", qdq_pattern(model, gemm, values=False))


def _layer() -> QuantLayer:
    w = torch.linspace(-1.0, 1.0, 48).reshape(6, 8)
    ws = float(amax_to_scale(1.0))
    return QuantLayer("lin", quantize_e4m3(w, ws), "out_in", ws, float(amax_to_scale(3.0)))


@pytest.mark.parametrize("dtype,opset", [("fp16", 21), ("bf16", 23), ("bf16", 21)])
def test_single_linear(dtype, opset):
    model = single_linear_model(_layer(), dtype=dtype, opset=opset)
    _compare(f"qdq_single_linear_{dtype}_opset{opset}", qdq_pattern(model, "lin/MatMul"))
