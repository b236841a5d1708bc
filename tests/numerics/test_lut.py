"""The E4M3 lookup table against the torch quantizer, bit for bit, on every 16-bit input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8export.numerics import lut
from fp8export.numerics.fp8 import quantize_e4m3
from fp8export.numerics.metrics import sqnr_db
from fp8export.scales.weights import quantize_weight_sqnr

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16}
# tiny and huge scales too: everything flushes to ±0 / saturates at ±448
SCALES = [1e-30, 1e-8, 1.2e-3, 1 / 448, 0.37, 1.0, 3.7e5, 3e38]
PATHS = [pytest.param(True, id="c"), pytest.param(False, id="numpy")]


def _every_pattern(dtype: str) -> tuple[np.ndarray, torch.Tensor]:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    return bits, torch.from_numpy(bits.view(np.int16).copy()).view(DTYPES[dtype])


@pytest.mark.parametrize("use_c", PATHS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("scale", SCALES)
def test_every_input_matches_the_torch_quantizer(dtype, scale, use_c):
    if use_c and not lut.compiled():
        pytest.skip("the C helper is not built here")
    bits, x = _every_pattern(dtype)
    s = np.float32(scale)
    want = quantize_e4m3(x, s).view(torch.uint8).numpy()  # NaN, -0, subnormals, saturation
    table = lut.e4m3_table(s, dtype)
    out, hist = np.empty_like(want), lut.new_histogram()
    lut.quantize_into(bits, table, out, hist, use_c=use_c)
    assert np.array_equal(out, want)
    assert np.array_equal(hist, np.ones(1 << 16, dtype=np.uint64))
    # the chunked writer's own quantizer agrees too
    q, _ = quantize_weight_sqnr(x, s)
    assert np.array_equal(q.view(torch.uint8).numpy(), want)


@pytest.mark.parametrize("use_c", PATHS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_sqnr_from_the_histogram_is_the_direct_one(dtype, use_c):
    if use_c and not lut.compiled():
        pytest.skip("the C helper is not built here")
    torch.manual_seed(0)
    w = (torch.randn(3000, 700) * 0.02).to(DTYPES[dtype])
    w[0, :5] = torch.tensor([0.0, -0.0, 1e-6, -3.0, 3.0])  # zeros, a tiny value, outliers
    s = np.float32(float(w.float().abs().max()) / 448 * 0.9)  # some values saturate
    table = lut.e4m3_table(s, dtype)
    src = w.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    out, hist = np.empty(src.size, np.uint8), lut.new_histogram()
    lut.quantize_into(src, table, out, hist, use_c=use_c)
    got = lut.sqnr_from_histogram(hist, table, s, dtype)
    deq = torch.from_numpy(out).view(torch.float8_e4m3fn).float() * float(s)
    direct = sqnr_db(w.float().reshape(-1), deq)  # float64, one element at a time
    assert math.isfinite(got) and abs(got - direct) < 1e-9
    _, chunked = quantize_weight_sqnr(w, s)  # the float32 chunked sums of the torch path
    assert abs(got - chunked) < 1e-4


def test_quantize_into_refuses_mismatched_buffers():
    table, hist = lut.e4m3_table(np.float32(1.0), "BF16"), lut.new_histogram()
    with pytest.raises(ValueError):
        lut.quantize_into(np.zeros(4, np.uint16), table, np.empty(3, np.uint8), hist)
    with pytest.raises(ValueError):
        lut.quantize_into(np.zeros(4, np.int32), table, np.empty(4, np.uint8), hist)
