"""Fp8Linear: exact emulation on CPU, torch._scaled_mm on a GPU (marked gpu)."""

import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics.fp8 import amax_to_scale, fake_quantize_e4m3, quantize_e4m3
from fp8export.numerics.metrics import cosine
from fp8export.runners.fp8_linear import Fp8Linear, dynamic_scale
from fp8export.runners.fp8_model import resolve_mode


def _layer(out_f=48, in_f=32, static=True, bias=True, mode="auto", dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    ws = float(amax_to_scale(float(w.abs().max())))
    b = torch.randn(out_f, generator=g) * 0.1 if bias else None
    s_in = float(amax_to_scale(3.0)) if static else None
    return Fp8Linear(quantize_e4m3(w, ws), ws, s_in, b, mode=mode, out_dtype=dtype), w, b


def test_emulation_is_the_qdq_function():
    layer, _, b = _layer(dtype=torch.float32)
    x = torch.randn(2, 5, 32) * 1.5
    s_in = layer.input_scale
    expected = fake_quantize_e4m3(x, s_in) @ (layer.weight.float() * layer.weight_scale).T + b
    torch.testing.assert_close(layer.forward_emulated(x), expected, rtol=1e-6, atol=1e-6)


def test_dynamic_scale_uses_per_tensor_amax():
    layer, _, _ = _layer(static=False, bias=False, dtype=torch.float32)
    x = torch.randn(4, 32)
    s = x.abs().max() / 448.0
    assert float(dynamic_scale(x)) == pytest.approx(float(s), rel=1e-7)
    expected = fake_quantize_e4m3(x, s) @ (layer.weight.float() * layer.weight_scale).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    assert float(dynamic_scale(torch.zeros(3))) == 1.0


def test_close_to_the_high_precision_linear():
    layer, w, b = _layer(static=False)
    x = torch.randn(8, 32)
    assert cosine(x @ w.T + b, layer(x.bfloat16())) > 0.999


def test_clipping_with_a_too_small_static_scale_is_visible():
    layer, w, b = _layer(dtype=torch.float32)  # input_scale for amax 3.0
    x = torch.randn(8, 32) * 20  # way beyond 3.0: clipped at ±3
    assert cosine(x @ w.T + b, layer(x)) < 0.99


def test_fallback_reason_when_not_multiple_of_16():
    layer, _, _ = _layer(out_f=40, in_f=24)
    assert "multiples of 16" in layer.fallback_reason
    assert not layer.uses_scaled_mm(torch.device("cpu"))


def test_scaled_mm_mode_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(Fp8ExportError, match="compute capability >= 8.9"):
        resolve_mode("scaled_mm", torch.device("cpu"))
    assert resolve_mode("auto", torch.device("cpu")) == "emulate"


@pytest.mark.gpu
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("tokens", [(3, 7), (4, 128)])
def test_scaled_mm_matches_emulation(static, tokens):
    from fp8export.runners.fp8_linear import scaled_mm_available

    if not scaled_mm_available("cuda"):
        pytest.skip("needs compute capability >= 8.9 for FP8 GEMMs")
    layer, _, _ = _layer(out_f=256, in_f=512, static=static)
    layer = layer.cuda()
    x = (torch.randn(*tokens, 512) * 1.2).to("cuda", torch.bfloat16)
    assert layer.uses_scaled_mm(x.device)
    y_mm = layer.forward_scaled_mm(x)
    y_emu = layer.forward_emulated(x)
    assert y_mm.dtype == torch.bfloat16 and y_mm.shape == (*tokens, 256)
    assert cosine(y_emu, y_mm) >= 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("dynamic", ["tensor", "token"])
def test_rowwise_scaled_mm_matches_emulation(static, dynamic):
    """Per-output-channel weight scales (and per-token inputs): _scaled_mm's row-wise GEMM."""
    from fp8export.runners.fp8_linear import scaled_mm_available

    if not scaled_mm_available("cuda"):
        pytest.skip("needs compute capability >= 8.9 for FP8 GEMMs")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * torch.logspace(-3, -1, 256)[:, None]
    rows = w.abs().amax(dim=1) / 448.0
    q = torch.stack([quantize_e4m3(w[i], float(rows[i])) for i in range(256)])
    s_in = float(amax_to_scale(3.0)) if static else None
    layer = Fp8Linear(q, rows, s_in, torch.randn(256, generator=g) * 0.1,
                      dynamic=dynamic).cuda()
    x = (torch.randn(4, 64, 512) * 1.2).to("cuda", torch.bfloat16)
    assert layer.uses_scaled_mm(x.device)
    y_mm, y_emu = layer.forward_scaled_mm(x), layer.forward_emulated(x)
    assert y_mm.shape == (4, 64, 256)
    assert cosine(y_emu.float(), y_mm.float()) >= 0.999
