"""Per-output-channel E4M3 weight scales: row amax, scales, quantize with SQNR.

A weight ``[out, in]`` gets one dequantization factor per output row, ``scale[o] =
amax(|W[o, :]|) / 448`` (computed in float64 and rounded once to float32, as
:func:`~fp8export.numerics.fp8.amax_to_scale` does for a tensor). ``in_out`` weights (GPT-2's
Conv1D, ``[in, out]``) have their output channels on axis 1. Work is done in blocks of whole
output channels of about :data:`BLOCK` elements, so no full-size float32 copy of a large weight
is made. The scales of the row amaxes: ``fp8.amax_to_scales`` (an all-zero row takes the
smallest scale of the others).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fp8export.numerics.fp8 import E4M3_MAX
from fp8export.numerics.metrics import sqnr_from_sums

if TYPE_CHECKING:  # torch is imported where a function needs it (lazily: convert's
    import torch  # default path runs without it)

BLOCK = 1 << 22  # elements per block of whole channels


def _channel_axis(layout: str) -> int:
    return 1 if layout == "in_out" else 0


def _blocks(w: torch.Tensor, axis: int):
    """(start, stop, block) over ``w``'s output channels, ``block`` as ``[channels, in]``."""
    n_out = w.shape[axis]
    per = max(1, BLOCK // max(1, w.numel() // max(1, n_out)))
    for start in range(0, n_out, per):
        stop = min(n_out, start + per)
        block = w[start:stop] if axis == 0 else w[:, start:stop].t()
        yield start, stop, block


def channel_amax(w: torch.Tensor, layout: str = "out_in") -> np.ndarray:
    """max|W| of every output channel of a 2-D weight, float64 ``[out]`` (NaN where NaN)."""
    import torch

    if w.dim() != 2:
        raise ValueError(f"per-channel scales need a 2-D weight, got shape {tuple(w.shape)}")
    axis = _channel_axis(layout)
    out = np.empty(w.shape[axis], dtype=np.float64)
    for start, stop, block in _blocks(w, axis):
        lo, hi = torch.aminmax(block.to(torch.float32), dim=1)
        amax = torch.maximum(-lo, hi)
        amax = torch.where(torch.isnan(lo) | torch.isnan(hi), torch.nan, amax)
        out[start:stop] = amax.to(torch.float64).numpy()
    return out


def quantize_channels_sqnr(w: torch.Tensor, scales: np.ndarray, layout: str = "out_in",
                           ) -> tuple[torch.Tensor, float]:
    """E4M3 ``w`` with one scale per output channel (``w``'s shape and layout) and the SQNR (dB)
    of its round trip. Per element the arithmetic of ``quantize_e4m3``: float32 divide, clamp
    to ±448, round-to-nearest-even cast."""
    import torch

    axis = _channel_axis(layout)
    s_all = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32))
    if s_all.numel() != w.shape[axis]:
        raise ValueError(f"{s_all.numel()} scales for {w.shape[axis]} output channels")
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    q_view = q if axis == 0 else q.t()
    signal = noise = 0.0
    for start, stop, block in _blocks(w, axis):
        x = block.to(torch.float32)
        s = s_all[start:stop, None]
        qb = (x / s).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        q_view[start:stop] = qb
        d = qb.to(torch.float32).mul_(s).sub_(x)
        noise += float(torch.sum(d.double() * d.double()))
        signal += float(torch.sum(x.double() * x.double()))
    return q, sqnr_from_sums(signal, noise)


def channels_roundtrip_sqnr(source: torch.Tensor, q: torch.Tensor, scales: np.ndarray,
                            layout: str = "out_in") -> float:
    """SQNR (dB) of ``q * scale[channel]`` (a per-channel FP8 weight as written) against its
    source: the same float :func:`quantize_channels_sqnr` returns for those bytes."""
    import torch

    axis = _channel_axis(layout)
    s_all = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32))
    signal = noise = 0.0
    q_blocks = _blocks(q, axis)
    for (start, stop, block), (_, _, qb) in zip(_blocks(source, axis), q_blocks):
        x = block.to(torch.float32)
        d = qb.to(torch.float32).mul_(s_all[start:stop, None]).sub_(x)
        noise += float(torch.sum(d.double() * d.double()))
        signal += float(torch.sum(x.double() * x.double()))
    return sqnr_from_sums(signal, noise)

