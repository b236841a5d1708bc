"""fp8_gemm on CPU: torch._scaled_mm has a CPU kernel, so the scale, bias, slice and row-wise
handling around it runs for real here; the CUDA kernels are compared in the gpu-marked tests
(test_fp8_linear.py, test_fp8_fused.py)."""

import pytest
import torch

from fp8export.numerics.fp8 import quantize_e4m3
from fp8export.numerics.metrics import rel_l2
from fp8export.runtime.fp8_gemm import (
    fp8_matmul,
    quantized_matmul,
    rowwise_matmul,
    small_m_config,
    small_m_matmul,
)
from fp8export.runtime.fp8_quant import quantize_input


def _exact(n=48, k=64, m=6, seed=0):
    """Small integer codes, power-of-two scales: every path is exact before its one rounding."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-4, 5, (n, k), generator=g).float().to(torch.float8_e4m3fn)
    x = torch.randint(-6, 7, (m, k), generator=g).float() * 0.5
    bias = torch.randint(-8, 9, (n,), generator=g).float()
    return x, w, torch.tensor(0.5), torch.tensor(0.25), bias


def _reference(x, w, s_in, s_w, bias=None):
    y = (quantize_e4m3(x, s_in).double() * s_in.double()) @ (w.double() * s_w.double()).t()
    return y if bias is None else y + bias.double()


@pytest.fixture(autouse=True)
def _cpu_scaled_mm():
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        pytest.skip(f"torch {torch.__version__} has no CPU torch._scaled_mm")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantized_matmul_scales_and_bias(out_dtype):
    x, w, s_in, s_w, bias = _exact()
    a = quantize_input(x, s_in)
    want = _reference(x, w, s_in, s_w, bias).to(out_dtype)
    # bf16: the bias goes into the GEMM's epilogue; other dtypes add it to the result
    got = quantized_matmul(a, w.t(), s_in, s_w, bias.to(out_dtype), out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
    no_bias = quantized_matmul(a, w.t(), s_in, s_w, None, out_dtype)
    assert torch.equal(no_bias, _reference(x, w, s_in, s_w).to(out_dtype))


def test_quantized_matmul_on_a_column_slice_of_the_fused_weight():
    """What a fused group does from SPLIT_M rows: one quantize, one GEMM per member on a
    view of its rows of the concatenated weight."""
    x, w, s_in, s_w, bias = _exact(n=96)
    a = quantize_input(x, s_in)
    wt = w.t()
    for start, n in ((0, 48), (48, 32), (80, 16)):
        got = quantized_matmul(a, wt[:, start:start + n], s_in, s_w,
                               bias[start:start + n].bfloat16(), torch.bfloat16)
        want = _reference(x, w[start:start + n], s_in, s_w, bias[start:start + n])
        assert torch.equal(got, want.to(torch.bfloat16)), start


def test_fp8_matmul_with_and_without_a_kept_transpose(monkeypatch):
    from fp8export.runtime import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "EAGER_M", 0)  # the _scaled_mm branch (no Triton on CPU)
    x, w, s_in, s_w, bias = _exact(m=9)
    want = _reference(x, w, s_in, s_w, bias).to(torch.bfloat16)
    for weight_t in (None, w.t()):
        got = fp8_matmul(x.bfloat16(), w, s_in, s_w, bias.bfloat16(), torch.bfloat16,
                         weight_t=weight_t)
        assert torch.equal(got, want)


def test_rowwise_matmul_per_token_and_per_channel_scales():
    x, w, _, _, bias = _exact(m=8)
    s_rows = 2.0 ** -(1 + torch.arange(8) % 3)[:, None].float()  # [M, 1], exact
    s_cols = 2.0 ** -(2 + torch.arange(48) % 4).float()  # [N]
    got = rowwise_matmul(x.bfloat16(), w, s_rows, s_cols, None, torch.bfloat16)
    want = (quantize_e4m3(x, s_rows).double() * s_rows.double()) @ \
        (w.double() * s_cols.double()[:, None]).t()
    assert torch.equal(got, want.to(torch.bfloat16))
    # a scalar input scale is broadcast over the rows; fp32 output with a bias
    got = rowwise_matmul(x, w, torch.tensor(0.5), s_cols, bias, torch.float32)
    want = _reference(x, w, torch.tensor(0.5), s_cols[:, None], bias)
    assert got.dtype == torch.float32
    # the bias is added after _scaled_mm's bf16 output: one rounding more than the emulation
    assert rel_l2(want, got) <= 2.0 ** -8


def test_small_m_config_from_the_tile_sweep():
    assert small_m_config(1, 2048, 2048, 132) == {
        "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
    assert small_m_config(17, 8448, 8192, 132)["BLOCK_M"] == 32  # > 16 rows: 32-row tiles
    assert small_m_config(128, 8448, 8192, 132)["BLOCK_N"] == 64  # >= 64 x SMs columns
    assert small_m_config(128, 8447, 8192, 132)["BLOCK_N"] == 32
    assert [small_m_config(8, 64, k, 132)["BLOCK_K"] for k in (512, 384, 320, 48)] == \
        [256, 128, 64, 32]


def test_small_m_matmul_of_no_rows_launches_nothing():
    w = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    out = small_m_matmul(torch.zeros(0, 64), w, torch.tensor(1.0), torch.tensor(1.0), None,
                         torch.bfloat16)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
