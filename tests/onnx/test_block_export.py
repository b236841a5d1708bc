"""export-onnx of block-scaled weights: one blocked DequantizeLinear per weight (opset 21
``block_size`` along the input axis, each block scale repeated over its tile's output channels),
accepted by onnx.checker, fp8export's checker and onnxruntime, and computing exactly the
folder's dequantized weights (activations stay 16/32-bit: ONNX has no FP8 per-token-group
quantize, so block layers are weight-only DQ, as dynamic layers are)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from fp8_folder_maker import make_fp8_folder, token_feed
from onnx import numpy_helper

from fp8export.fp8dir.reader import read_fp8_folder
from fp8export.numerics.metrics import rel_l2
from fp8export.onnx.check import check_model
from fp8export.runners.ort_runner import OrtRunner


def _weight_dqs(model):
    inits = {t.name: t for t in model.graph.initializer}
    return inits, [n for n in model.graph.node if n.op_type == "DequantizeLinear"
                   and n.input[0].endswith(".weight")]


def test_blocked_weight_dq_passes_the_checkers(block_fp8, onnx_block_fp32):
    result, path = onnx_block_fp32
    onnx.checker.check_model(str(path), full_check=True)
    assert result.check["ok"] is True and check_model(path).ok
    assert len(result.sixteen_bit) == 14  # weight-only: no FP8 activation quantize in ONNX
    model = onnx.load(str(path))
    inits, dqs = _weight_dqs(model)
    assert len(dqs) == 14
    with read_fp8_folder(block_fp8) as folder:
        for node in dqs:
            attrs = {a.name: a.i for a in node.attribute}
            w, s, zp = (inits[n] for n in node.input)
            assert attrs["block_size"] == 16 and attrs["axis"] == 0  # MatMul weight [K, N]
            k, n = w.dims
            assert list(s.dims) == [-(-k // 16), n] and list(zp.dims) == list(s.dims)
            assert not numpy_helper.to_array(zp).astype(np.float32).any()
            layer = folder.layers[node.input[0][: -len(".weight")]]
            # the expanded scale, dequantized: exactly the folder's weight
            deq = numpy_helper.to_array(w).astype(np.float32) * np.repeat(
                numpy_helper.to_array(s), 16, axis=0)[:k]
            assert np.array_equal(deq, layer.dequantized().numpy().T)


def test_logits_equal_the_dequantized_model(block_fp8, onnx_block_fp32):
    """The graph computes the folder's weights with unquantized activations: equal to
    transformers' model with the weights as the reader dequantizes them."""
    from fp8export.models import empty_model

    _, path = onnx_block_fp32
    feed = token_feed(2, 11, seed=5)
    with read_fp8_folder(block_fp8) as folder:
        model = empty_model(folder.config, block_fp8, dtype=torch.float32)
        model.load_state_dict(folder.model_state(torch.float32), strict=False)
    with OrtRunner(path, providers=["CPUExecutionProvider"]) as runner:
        got = torch.from_numpy(np.asarray(runner.infer(feed)["logits"], dtype=np.float32))
    with torch.no_grad():
        ref = model.eval()(input_ids=torch.from_numpy(feed["input_ids"]),
                           attention_mask=torch.from_numpy(feed["attention_mask"])).logits
    assert rel_l2(ref, got) <= 1e-5


def test_ragged_blocks_export(tmp_path):
    """Blocks that do not divide the weights (48x48 on 64/128-wide layers): the last block along
    K is partial, which ONNX's blocked quantization allows (ceil(K / block_size) scales)."""
    folder = make_fp8_folder(tmp_path / "fp8", scales="weights", weight_granularity="block",
                             block_size="48")
    from fp8export.onnx.export import ExportOnnxConfig, export_onnx

    result = export_onnx(ExportOnnxConfig(fp8_dir=folder, output=tmp_path / "m.onnx",
                                          dtype="fp32"))
    assert result.check["ok"] and result.ort_levels["wrong"] == []
    inits, dqs = _weight_dqs(onnx.load(str(tmp_path / "m.onnx")))
    down = next(n for n in dqs if "down_proj" in n.input[0])
    assert list(inits[down.input[1]].dims) == [3, 64]  # K = 128 = 48 + 48 + 32


@pytest.mark.parametrize("dtype", ["fp16"])
def test_fp16_scales_are_exact_and_say_nothing(onnx_block_fp16, block_fp8, dtype):
    """compressed-tensors block scales are bf16 values (as transformers holds them), which fp16
    holds exactly in its range: no rounding, so no rounding note."""
    import torch
    from safetensors.torch import load_file

    result, _ = onnx_block_fp16
    assert result.dtype == dtype
    scales = [t for f in block_fp8.glob("*.safetensors")
              for n, t in load_file(str(f)).items() if n.endswith("weight_scale")]
    assert scales and all(torch.equal(t.to(torch.float16).float(), t.float()) for t in scales)
    assert not any("scales stored as" in n for n in result.notes)
