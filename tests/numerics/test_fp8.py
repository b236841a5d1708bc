"""E4M3 numerics against an independent implementation (ml_dtypes), exhaustively."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics.fp8 import (
    E4M3_DTYPE,
    E4M3_MAX,
    E5M2_DTYPE,
    amax_to_scale,
    dequantize,
    fake_quantize_e4m3,
    multiplier_to_scale,
    quantize_e4m3,
)
from fp8export.numerics.metrics import cosine, rel_l2, sqnr_db

ALL_CODES = np.arange(256, dtype=np.uint8)


def _decode(raw: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """uint8 codes read as ``dtype`` (how every reader decodes FP8 bytes), as float32."""
    return torch.from_numpy(raw).view(dtype).to(torch.float32).numpy()


def test_decode_all_256_e4m3_codes_matches_ml_dtypes():
    ours = _decode(ALL_CODES, E4M3_DTYPE)
    ref = ALL_CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    finite = ~np.isnan(ref)
    np.testing.assert_array_equal(ours[finite], ref[finite])
    assert np.isnan(ours).sum() == 2  # 0x7F and 0xFF only; E4M3FN has no infinities
    assert np.nanmax(ours) == E4M3_MAX


def test_decode_all_256_e5m2_codes_matches_ml_dtypes():
    ours = _decode(ALL_CODES, E5M2_DTYPE)
    ref = ALL_CODES.view(ml_dtypes.float8_e5m2).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    finite = ~np.isnan(ref)
    np.testing.assert_array_equal(ours[finite], ref[finite])


def _finite_grid() -> np.ndarray:
    vals = _decode(ALL_CODES, E4M3_DTYPE)
    return np.unique(vals[np.isfinite(vals)]).astype(np.float64)


def test_quantize_every_code_and_every_rounding_midpoint_matches_ml_dtypes():
    grid = _finite_grid()  # sorted, includes -448..448 and ±0 collapsed
    mids = (grid[:-1] + grid[1:]) / 2
    nudges = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    xs = np.concatenate([grid, nudges, [500.0, -500.0, 1e6, -1e6, 449.0, 464.0, 480.0]])
    xs32 = xs.astype(np.float32)
    ours = quantize_e4m3(torch.from_numpy(xs32), 1.0).view(torch.uint8).numpy()
    # Independent path: clamp, then ml_dtypes' round-to-nearest-even cast.
    ref = np.clip(xs32, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    mism = np.nonzero(ours != ref)[0]
    # +0/-0 may differ in sign bit only for exact zeros of different sign; none else may differ.
    assert all(xs32[i] == 0 for i in mism), [(xs32[i], ours[i], ref[i]) for i in mism[:5]]


def test_ties_round_to_even():
    # 1.0 = 0x38, next 1.125 = 0x39: midpoint 1.0625 rounds to even mantissa (1.0).
    q = quantize_e4m3(torch.tensor([1.0625, 1.1875]), 1.0).to(torch.float32)
    assert q.tolist() == [1.0, 1.25]


def test_saturates_instead_of_nan():
    q = quantize_e4m3(torch.tensor([1e9, -1e9, 448.0, 460.0]), 1.0).to(torch.float32)
    assert q.tolist() == [448.0, -448.0, 448.0, 448.0]


@pytest.mark.parametrize("shape", [(64, 32), (256, 512), (7, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_sqnr(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float32).to(dtype)
    scale = amax_to_scale(float(x.float().abs().max()), "x")
    y = fake_quantize_e4m3(x, scale)
    assert y.dtype == dtype
    # E4M3 has 3 mantissa bits: ~ 30 dB on Gaussian data at a max scale.
    assert sqnr_db(x.float(), y.float()) > 25.0


def test_scale_convention_is_amax_over_448_float32():
    s = amax_to_scale(3.5, "w")
    assert isinstance(s, np.float32)
    assert s == np.float32(3.5 / 448.0)
    x = torch.tensor([3.5, -3.5])
    q = quantize_e4m3(x, s)
    assert q.to(torch.float32).abs().max().item() == 448.0
    assert torch.allclose(dequantize(q, s), x)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_bad_amax_rejected_with_tensor_name(bad):
    with pytest.raises(Fp8ExportError, match="layers.3.mlp.up_proj"):
        amax_to_scale(bad, "layers.3.mlp.up_proj")


def test_multiplier_conversion():
    assert multiplier_to_scale(448.0 / 2.0) == np.float32(2.0 / 448.0)
    with pytest.raises(Fp8ExportError):
        multiplier_to_scale(0.0)


def test_metrics():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert sqnr_db(a, a) == math.inf
    assert cosine(a, 2 * a) == pytest.approx(1.0)
    assert rel_l2(a, a) == 0.0
    assert sqnr_db(a, a * 1.1) == pytest.approx(20.0, abs=1e-4)
