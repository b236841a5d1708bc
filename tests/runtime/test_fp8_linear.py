"""Fp8Linear: the exact emulation, and the FP8 GEMM path compared with it value for value (on
CPU through torch's CPU ``_scaled_mm`` kernel; marked gpu: cuBLASLt and the Triton kernels)."""

import functools

import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics.fp8 import amax_to_scale, fake_quantize_e4m3, quantize_e4m3
from fp8export.numerics.metrics import cosine, rel_l2
from fp8export.runtime.fp8_linear import Fp8Linear, dynamic_scale
from fp8export.runtime.fp8_model import resolve_mode


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
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    # two E4M3 roundings (input and weight, each about 3.5% rel-L2): measured 0.031-0.036
    assert rel_l2(x @ w.T + b, layer(x.bfloat16())) < 0.06


def test_clipping_with_a_too_small_static_scale_is_visible():
    layer, w, b = _layer(dtype=torch.float32)  # input_scale for amax 3.0
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)) * 20  # clipped at ±3
    assert rel_l2(x @ w.T + b, layer(x)) > 0.5


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


# ------------------------------------------------- the FP8 GEMM path against the emulation
# These compare values, never cosine alone: an input scale applied twice, dropped or inverted
# multiplies the output by a constant, which cosine cannot see (rel-L2 sees it as ~1).
# Each runs on CPU (torch._scaled_mm has a CPU kernel: fp8_gemm's scale handling, bias and
# row-wise paths run for real) and, marked gpu, on CUDA (cuBLASLt, the Triton kernels).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

REL_L2_ROUNDING = 2.0 ** -7
"""Random data: the paths may round an output element to a neighbouring bf16 value (one ulp
is at most 2**-7 of it): accumulation order differs, and the row-wise path adds its bias after
a first bf16 rounding (measured 3e-3 on CPU). A scale off by 2x gives ~1; off by 2%, 0.02."""


@functools.cache
def _cpu_scaled_mm() -> bool:
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _device(name: str) -> torch.device:
    if name == "cuda":
        from fp8export.runtime.fp8_linear import scaled_mm_available

        if not scaled_mm_available("cuda"):
            pytest.skip("needs compute capability >= 8.9 for FP8 GEMMs")
    elif not _cpu_scaled_mm():
        pytest.skip(f"torch {torch.__version__} has no CPU torch._scaled_mm")
    return torch.device(name)


def _fp8_path(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's FP8 GEMM path. On CUDA ``forward`` takes it too (through the prepared fast
    path for per-tensor layers): both entry points must give the same bits."""
    y = layer.forward_scaled_mm(x)
    if x.is_cuda:
        assert layer.uses_scaled_mm(x.device)
        assert torch.equal(layer(x), y)
    return y


# Exact data: E4M3 codes that are small integers (at most 448 once per row, else |c| <= 4)
# and power-of-two scales. Every dequantized value, product and partial sum is then exact in
# fp32 in any order (sums stay below 2**13 in code units), so any correct path holds the same
# fp32 value before its single rounding to bf16: bit-identical outputs. Row-wise layers have no
# bias here: that path adds it after a first rounding (the random-data tests cover it).
EXACT_CASES = [  # weight scales, static input scale, dynamic granularity, bias
    pytest.param("tensor", True, "tensor", True, id="tensor-static"),
    pytest.param("tensor", False, "tensor", True, id="tensor-dynamic"),
    pytest.param("tensor", False, "token", False, id="tensor-dynamic-token"),
    pytest.param("channel", True, "tensor", False, id="channel-static"),
    pytest.param("channel", False, "token", False, id="channel-dynamic-token"),
]


def _exact_layer(weights: str, static: bool, dynamic: str, bias: bool, out_f=96, in_f=256):
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-4, 5, (out_f, in_f), generator=g).float()
    # per channel: a different power of two per output row, so a row mix-up shows
    w_scale = (2.0 ** -(2 + torch.arange(out_f) % 4)) if weights == "channel" else 0.25
    b = torch.randint(-8, 9, (out_f,), generator=g).float() if bias else None
    return Fp8Linear(codes.to(torch.float8_e4m3fn), w_scale, 2.0 ** -7 if static else None, b,
                     dynamic=dynamic)


def _exact_input(rows: int, in_f: int, per_row_amax: bool, seed: int = 0) -> torch.Tensor:
    """Rows whose amax is 448 * 2**-7 (3.5; with ``per_row_amax`` also 1.75 and 0.875 on
    alternate rows, so a per-token scale applied to the wrong row shows): the dynamic scale
    amax / 448 is that power of two, and every other element is a small multiple of it."""
    g = torch.Generator().manual_seed(seed)
    exp = 7 + (torch.arange(rows) % 3 if per_row_amax else torch.zeros(rows, dtype=torch.long))
    codes = torch.randint(-4, 5, (rows, in_f), generator=g).float()
    sign = torch.randint(0, 2, (rows,), generator=g).float() * 2 - 1
    codes[torch.arange(rows), torch.randint(0, in_f, (rows,), generator=g)] = 448.0 * sign
    return (codes * 2.0 ** -exp[:, None].float()).to(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [5, 300])  # on CUDA: the small-M Triton kernel, _scaled_mm
@pytest.mark.parametrize(("weights", "static", "dynamic", "bias"), EXACT_CASES)
def test_fp8_gemm_is_bit_identical_to_emulation_on_exact_data(weights, static, dynamic, bias,
                                                               rows, device):
    dev = _device(device)
    layer = _exact_layer(weights, static, dynamic, bias).to(dev)
    assert layer.rowwise == (weights == "channel" or (not static and dynamic == "token"))
    x = _exact_input(rows, 256, per_row_amax=dynamic == "token" and not static).to(dev)
    want = layer.forward_emulated(x)
    got = _fp8_path(layer, x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {want.numel()} differ"
    # the data really are exact: the emulation equals the float64 product
    s_in = layer.input_scale_for(x)
    ref = (quantize_e4m3(x, s_in).double() * s_in.double()) @ \
        (layer.weight.double() * layer.weight_scale_rows().double()).t()
    if layer.bias is not None:
        ref = ref + layer.bias.double()
    assert torch.equal(want, ref.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("tokens", [(3, 7), (4, 128)])  # on CUDA: Triton kernel, _scaled_mm
def test_scaled_mm_matches_emulation(static, tokens, device):
    dev = _device(device)
    layer, _, _ = _layer(out_f=256, in_f=512, static=static)
    layer = layer.to(dev)
    x = (torch.randn(*tokens, 512, generator=torch.Generator().manual_seed(5)) * 1.2).to(
        dev, torch.bfloat16)
    y_mm = _fp8_path(layer, x)
    y_emu = layer.forward_emulated(x)
    assert y_mm.dtype == torch.bfloat16 and y_mm.shape == (*tokens, 256)
    assert rel_l2(y_emu, y_mm) <= REL_L2_ROUNDING


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("dynamic", ["tensor", "token"])
def test_rowwise_scaled_mm_matches_emulation(static, dynamic, device):
    """Per-output-channel weight scales (and per-token inputs): _scaled_mm's row-wise GEMM."""
    dev = _device(device)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * torch.logspace(-3, -1, 256)[:, None]
    rows = w.abs().amax(dim=1) / 448.0
    q = torch.stack([quantize_e4m3(w[i], float(rows[i])) for i in range(256)])
    s_in = float(amax_to_scale(3.0)) if static else None
    layer = Fp8Linear(q, rows, s_in, torch.randn(256, generator=g) * 0.1,
                      dynamic=dynamic).to(dev)
    assert layer.rowwise
    x = (torch.randn(4, 64, 512, generator=g) * 1.2).to(dev, torch.bfloat16)
    y_mm, y_emu = _fp8_path(layer, x), layer.forward_emulated(x)
    assert y_mm.shape == (4, 64, 256)
    assert rel_l2(y_emu, y_mm) <= REL_L2_ROUNDING


def test_a_doubled_input_scale_passes_cosine_and_fails_rel_l2():
    """Why the checks above compare values: the GEMM given twice the input scale it quantized
    with returns twice the answer, which cosine calls perfect."""
    _device("cpu")
    from fp8export.runtime.fp8_gemm import quantized_matmul
    from fp8export.runtime.fp8_quant import quantize_input

    layer, _, _ = _layer(out_f=64, in_f=128, bias=False, dtype=torch.float32)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    a = quantize_input(x, layer.input_scale)
    good = quantized_matmul(a, layer.weight.t(), layer.input_scale, layer.weight_scale, None,
                            torch.float32)
    bad = quantized_matmul(a, layer.weight.t(), layer.input_scale * 2, layer.weight_scale,
                           None, torch.float32)
    want = layer.forward_emulated(x)
    assert rel_l2(want, good) <= 1e-6
    assert cosine(want, bad) > 0.99999 and rel_l2(want, bad) > 0.99
