"""Weight amax scan, fused-group scales and the chunked E4M3 round trip with its SQNR.

Work is done in flat chunks of :data:`CHUNK` elements so that a large weight never gets a
full-size float32/float64 copy: peak extra memory is the FP8 output (1 byte per element) plus
a few chunk-sized temporaries. The arithmetic per element is that of
:func:`fp8export.numerics.fp8.quantize_e4m3` (a test checks the bits are identical).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fp8export.checkpoint.select import Target
from fp8export.numerics.fp8 import E4M3_DTYPE, E4M3_MAX, amax_to_scale

CHUNK = 1 << 22  # elements per chunk: 16 MiB of float32
MIN_WEIGHT_SQNR_DB = 20.0
"""A weight whose FP8 round trip is worse than this is an error (per-tensor E4M3 of a trained
weight gives ~25-32 dB; below 20 dB the scale is wrong or the tensor has extreme outliers)."""


def chunked_amax(x: torch.Tensor) -> float:
    """max|x| as a Python float (NaN when x holds NaN, inf when it holds ±inf)."""
    flat = x.reshape(-1)
    amax = 0.0
    for start in range(0, flat.numel(), CHUNK):
        lo, hi = torch.aminmax(flat[start:start + CHUNK])  # one pass, no |x| temporary
        part_max = max(-float(lo), float(hi))
        if math.isnan(part_max):  # aminmax propagates NaN
            return math.nan
        amax = max(amax, part_max)
    return amax


def sqnr_from_sums(signal: float, noise: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def quantize_weight(w: torch.Tensor, scale: np.float32) -> torch.Tensor:
    """E4M3-quantize ``w`` with dequantization ``scale`` (float8_e4m3fn, ``w``'s shape)."""
    flat = w.reshape(-1)
    q = torch.empty(flat.numel(), dtype=E4M3_DTYPE)
    s = float(scale)
    for start in range(0, flat.numel(), CHUNK):
        # quantize_e4m3's arithmetic (x/scale in float32, clamp to ±448, RNE cast), done in
        # place so the cast writes straight into the output: one pass fewer per chunk.
        y = flat[start:start + CHUNK].to(torch.float32)
        y.div_(s).clamp_(-E4M3_MAX, E4M3_MAX)
        q[start:start + y.numel()].copy_(y)
    return q.reshape(w.shape)


def roundtrip_sqnr(source: torch.Tensor, q: torch.Tensor, scale: float) -> float:
    """SQNR (dB) of ``q * scale`` (an FP8 weight as written) against its source, chunked.

    Chunk sums are float32 dot products (blocked accumulation, ample for 4M elements) added
    up in float64; this is the hot loop of read-back, so it avoids float64 copies.
    """
    ref = source.reshape(-1)
    got = q.reshape(-1)
    s = float(scale)
    signal = noise = 0.0
    for start in range(0, ref.numel(), CHUNK):
        x = ref[start:start + CHUNK].to(torch.float32)
        d = got[start:start + CHUNK].to(torch.float32)
        d.mul_(s).sub_(x)
        noise += float(torch.dot(d, d))
        signal += float(torch.dot(x, x))
    return sqnr_from_sums(signal, noise)


@dataclass(frozen=True)
class WeightScan:
    """Per-module weight amax, the scale each module will use, and the problems found."""

    amax: dict[str, float]
    scale_amax: dict[str, float]  # the amax the scale is built from (group max when fused)
    scale: dict[str, np.float32]
    nonfinite: list[str]  # tensor names holding NaN/Inf
    all_zero: list[str]  # modules whose scale amax is 0 (kept in high precision)


def scan_weights(targets: Sequence[Target], load: Callable[[str], torch.Tensor],
                 groups: dict[str, list[str]], *, on_step: Callable[[], None] | None = None,
                 ) -> WeightScan:
    """Read every target weight once: amax, NaN/Inf offenders, and the per-module scale.

    Fused groups use the max amax of their members (DESIGN.md: what vLLM/TensorRT run).
    A module whose (group) amax is 0 has no scale: it is reported in ``all_zero``.
    """
    amax: dict[str, float] = {}
    nonfinite: list[str] = []
    for t in targets:
        w = load(t.weight)
        a = chunked_amax(w)
        del w
        if not math.isfinite(a):
            nonfinite.append(t.weight)
        amax[t.module] = a
        if on_step is not None:
            on_step()
    scale_amax = dict(amax)
    for members in groups.values():
        vals = [amax[m] for m in members if m in amax]
        if vals and all(math.isfinite(v) for v in vals):
            gmax = max(vals)
            for m in members:
                scale_amax[m] = gmax
    all_zero = [m for m, a in scale_amax.items() if a == 0.0]
    scale = {m: amax_to_scale(a, f"{m}.weight") for m, a in scale_amax.items()
             if math.isfinite(a) and a > 0.0}
    return WeightScan(amax=amax, scale_amax=scale_amax, scale=scale, nonfinite=nonfinite,
                      all_zero=all_zero)
