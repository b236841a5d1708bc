"""export-onnx of a folder with per-output-channel weight scales: per-axis weight DQ with an
explicit axis and a zero point of the scale's shape, checked, run by onnxruntime, and equal to
the torch FP8 runtime on the same scales."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from fp8_folder_maker import token_feed
from onnx import numpy_helper

from fp8export.numerics.metrics import cosine, rel_l2
from fp8export.onnx.check import check_model
from fp8export.runners.ort_runner import OrtRunner


@pytest.fixture(scope="module")
def channel_export(channel_fp8, onnx_channel_fp32):
    result, out = onnx_channel_fp32
    return channel_fp8, out, result


def test_weight_dq_is_per_axis_and_passes_the_checkers(channel_export):
    folder, path, result = channel_export
    assert result.check["ok"] is True and len(result.fp8_gemms) == 14
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer}
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"
           and n.input[0].endswith(".weight")]
    assert len(dqs) == 14
    for node in dqs:
        w, s, zp = (inits[n] for n in node.input)
        axis = next(a.i for a in node.attribute if a.name == "axis")
        assert list(s.dims) == [w.dims[axis]] and list(zp.dims) == list(s.dims)
        assert not numpy_helper.to_array(zp).astype(np.float32).any()
    assert check_model(path).ok


def test_logits_match_the_torch_fp8_runtime(channel_export):
    from fp8export.runtime.fp8_model import load_fp8_model

    folder, path, _ = channel_export
    fp8_model = load_fp8_model(folder, dtype=torch.float32, mode="emulate")[0]
    feed = token_feed(2, 11, seed=5)
    with OrtRunner(path, providers=["CPUExecutionProvider"]) as runner:
        got = torch.from_numpy(np.asarray(runner.infer(feed)["logits"], dtype=np.float32))
    with torch.no_grad():
        ref = fp8_model(input_ids=torch.from_numpy(feed["input_ids"]),
                        attention_mask=torch.from_numpy(feed["attention_mask"])).logits
    assert rel_l2(ref, got) <= 1e-3 and cosine(ref, got) >= 0.99999


def test_checker_flags_a_scalar_zero_point_on_a_per_channel_scale(channel_export):
    _, path, _ = channel_export
    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear"
                and n.input[0].endswith("k_proj.weight"))
    node.input[2] = "fp8_zero_point"  # the shared scalar one: onnxruntime refuses this node
    errors = [i for i in check_model(model).errors if i.rule == "zero-point"]
    assert errors and "same shape" in errors[0].message
