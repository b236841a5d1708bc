"""Per-output-channel E4M3 weight scales: amax, scales, quantize and SQNR."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics import channel
from fp8export.numerics.channel import (
    channel_amax,
    channels_roundtrip_sqnr,
    quantize_channels_sqnr,
)
from fp8export.numerics.fp8 import amax_to_scale, amax_to_scales, quantize_e4m3


def _weight(out: int = 48, inp: int = 40, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 1, out)[:, None]  # rows spanning four decades
    return (torch.randn(out, inp, generator=g) * rows).to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_bits_equal_per_row_quantize_e4m3(layout, monkeypatch):
    monkeypatch.setattr(channel, "BLOCK", 100)  # several blocks of whole channels
    w = _weight()
    stored = w if layout == "out_in" else w.t().contiguous()
    amax = channel_amax(stored, layout)
    assert np.allclose(amax, w.float().abs().amax(dim=1).double().numpy(), rtol=0)
    scales = amax_to_scales(amax, "w")
    for o in (0, 17, 47):
        assert scales[o] == amax_to_scale(amax[o])  # same rounding as the per-tensor scale
    q, sqnr = quantize_channels_sqnr(stored, scales, layout)
    assert q.shape == stored.shape and q.dtype == torch.float8_e4m3fn
    q_out_in = q if layout == "out_in" else q.t()
    for o in range(w.shape[0]):
        want = quantize_e4m3(w[o], scales[o])
        assert torch.equal(q_out_in[o].view(torch.uint8), want.view(torch.uint8))
    assert sqnr == channels_roundtrip_sqnr(stored, q, scales, layout)
    # rows four decades apart: one scale per tensor flushes the small rows, one per row does not
    per_tensor = quantize_e4m3(w, amax_to_scale(float(amax.max())))
    deq = per_tensor.float() * float(amax_to_scale(float(amax.max())))
    noise = float(((deq - w.float()) ** 2).sum())
    tensor_sqnr = 10 * math.log10(float((w.float() ** 2).sum()) / noise)
    assert sqnr > 25.0 and sqnr > tensor_sqnr + 1.0


def test_zero_row_takes_the_smallest_other_scale():
    w = _weight()
    w[5] = 0
    scales = amax_to_scales(channel_amax(w), "w")
    assert scales[5] == scales[np.arange(48) != 5].min() and np.all(scales > 0)
    q, _ = quantize_channels_sqnr(w, scales)
    assert not q[5].float().any()


def test_bad_rows_are_errors():
    with pytest.raises(Fp8ExportError, match="channel 1 has amax nan"):
        amax_to_scales(np.array([1.0, np.nan]), "m.weight")
    with pytest.raises(Fp8ExportError, match="every output channel is zero"):
        amax_to_scales(np.zeros(3), "m.weight")
    w = _weight()
    w[3, 2] = float("nan")
    assert math.isnan(channel_amax(w)[3])
