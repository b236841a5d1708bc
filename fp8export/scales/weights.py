"""Weight amax scan, fused-group scales and the chunked E4M3 round trip with its SQNR.

Work is done in flat chunks of :data:`CHUNK` elements so that a large weight never gets a
full-size float32/float64 copy: peak extra memory is the FP8 output (1 byte per element) plus
a few chunk-sized temporaries. The arithmetic per element is that of
:func:`fp8export.numerics.fp8.quantize_e4m3` (a test checks the bits are identical).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fp8export.numerics import lut
from fp8export.numerics.block import block_amax
from fp8export.numerics.channel import channel_amax
from fp8export.numerics.fp8 import E4M3_MAX, amax_to_scale, amax_to_scales
from fp8export.numerics.metrics import sqnr_from_sums
from fp8export.scales.groups import share_max
from fp8export.scales.select import Target

if TYPE_CHECKING:  # torch is imported where a function needs it (lazily: convert's
    import torch  # default path runs without it)

CHUNK = 1 << 22  # elements per chunk: 16 MiB of float32
SUBCHUNK = 1 << 18  # elementwise pieces of a chunk that stay in cache (1 MiB of float32)
MIN_WEIGHT_SQNR_DB = 20.0
"""A weight whose FP8 round trip is worse than this is an error (per-tensor E4M3 of a trained
weight gives ~25-32 dB; below 20 dB the scale is wrong or the tensor has extreme outliers)."""


def chunked_amax(x: torch.Tensor) -> float:
    """max|x| as a Python float (NaN when x holds NaN, inf when it holds ±inf)."""
    import torch

    flat = x.reshape(-1)
    amax = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a max is exact on any thread count; one thread never waits
    try:
        for start in range(0, flat.numel(), CHUNK):
            lo, hi = torch.aminmax(flat[start:start + CHUNK])  # one pass, no |x| temporary
            part_max = max(-float(lo), float(hi))
            if math.isnan(part_max):  # aminmax propagates NaN
                return math.nan
            amax = max(amax, part_max)
    finally:
        torch.set_num_threads(threads)
    return amax


def quantize_weight(w: torch.Tensor, scale: np.float32) -> torch.Tensor:
    """E4M3-quantize ``w`` with dequantization ``scale`` (float8_e4m3fn, ``w``'s shape)."""
    import torch

    flat = w.reshape(-1)
    q = torch.empty(flat.numel(), dtype=torch.float8_e4m3fn)
    s = float(scale)
    for start in range(0, flat.numel(), CHUNK):
        # quantize_e4m3's arithmetic (x/scale in float32, clamp to ±448, RNE cast), done in
        # place so the cast writes straight into the output: one pass fewer per chunk.
        y = flat[start:start + CHUNK].to(torch.float32, copy=True)  # never the source itself
        y.div_(s).clamp_(-E4M3_MAX, E4M3_MAX)
        q[start:start + y.numel()].copy_(y)
    return q.reshape(w.shape)


_RNE_QUANTUM_FACTOR = 1.5 * 2.0**20  # (2^e)*1.5*2^20: float32 ulp 2^(e-3) = E4M3's step at 2^e
_E4M3_MIN_NORMAL_BITS = (127 - 6) << 23  # float32 bits of 2^-6; below it the step is 2^-9


def _round_to_e4m3_grid_(y: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """Round float32 ``y`` (already clamped to ±448) in place to the nearest E4M3 value, ties
    to even, in float32 arithmetic: the value ``y.to(float8_e4m3fn).to(float32)`` has.

    Adding and subtracting M = 1.5 * 2^(e+20), where 2^e is y's binade (at least 2^-6, E4M3's
    smallest normal), puts y into a float32 binade whose ulp, 2^(e-3), is E4M3's step at 2^e;
    float32 addition rounds to nearest even, so ``(y + M) - M`` is y rounded to that step,
    exactly (a test checks it against the real cast over every bf16 input and random floats).
    It replaces an FP8 -> float32 cast that torch does one element at a time.
    """
    import torch

    bits = tmp.view(torch.int32)
    torch.bitwise_and(y.view(torch.int32), 0x7F800000, out=bits)
    bits.clamp_(min=_E4M3_MIN_NORMAL_BITS)
    m = bits.view(torch.float32)
    m.mul_(_RNE_QUANTUM_FACTOR)
    return y.add_(m).sub_(m)


_LUT_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16"}  # str(dtype): no torch import


def _bits(flat: torch.Tensor) -> np.ndarray:
    """A 16-bit tensor's bit patterns as a contiguous uint16 array (no copy when contiguous)."""
    import torch

    return flat.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


_workspace = threading.local()


def _chunk_buffers() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This thread's three float32 piece buffers (1 MiB each), allocated once and small
    enough to stay in cache through all the operations on a piece."""
    import torch

    bufs = getattr(_workspace, "bufs", None)
    if bufs is None:
        bufs = _workspace.bufs = tuple(torch.empty(SUBCHUNK, dtype=torch.float32)
                                       for _ in range(3))
    return bufs


def quantize_weight_sqnr(w: torch.Tensor, scale: np.float32, out: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, float]:
    """:func:`quantize_weight` and :func:`roundtrip_sqnr` of its result, in one pass.

    bf16 / fp16 weights go through the E4M3 lookup table (``numerics/lut.py``: the same bytes,
    and the SQNR summed exactly from the histogram of bit patterns); the float32 path below
    serves float32 / float64 weights.

    Same bytes as ``quantize_weight(w, scale)`` and the same float as
    ``roundtrip_sqnr(w, q, scale)`` (same pieces, same float32 operations, same dot products),
    computed while each piece is in cache instead of reading the source twice. ``out``: a
    uint8 buffer of at least ``w.numel()`` bytes to hold the result (else one is allocated).
    """
    import torch

    flat = w.reshape(-1)
    n = flat.numel()
    q = (torch.empty(n, dtype=torch.uint8) if out is None else out[:n]).view(torch.float8_e4m3fn)
    dtype = _LUT_DTYPES.get(str(w.dtype))
    if dtype is not None:  # 16-bit: the table lookup, bit-identical, and the exact SQNR
        table = lut.e4m3_table(scale, dtype)
        hist = lut.new_histogram()
        lut.quantize_into(_bits(flat), table, q.view(torch.uint8).numpy(), hist)
        return q.reshape(w.shape), lut.sqnr_from_histogram(hist, table, scale, dtype)
    s = float(scale)
    x, y, tmp = _chunk_buffers()
    signal = noise = 0.0
    threads = torch.get_num_threads()
    # Everything on one thread, in cache-sized pieces: the elementwise work is memory-bound,
    # and a team of OpenMP threads waits at every op for its slowest member (badly so on a
    # busy machine); parallelism comes from converting several tensors at once. The dot
    # products stay single-threaded too: a float32 dot's blocking follows the thread count,
    # and the SQNR lands in the manifest, which must be byte-identical on any machine.
    torch.set_num_threads(1)
    try:
        for a in range(0, n, SUBCHUNK):
            b = min(a + SUBCHUNK, n)
            xs, ys = x[:b - a], y[:b - a]
            xs.copy_(flat[a:b])  # the source in float32
            torch.div(xs, s, out=ys).clamp_(-E4M3_MAX, E4M3_MAX)
            q[a:b].copy_(ys)  # RNE cast: the written bytes
            _round_to_e4m3_grid_(ys, tmp[:b - a])  # == q[a:b].to(float32), exactly
            ys.mul_(s).sub_(xs)
            noise += float(torch.dot(ys, ys))
            signal += float(torch.dot(xs, xs))
    finally:
        torch.set_num_threads(threads)
    return q.reshape(w.shape), sqnr_from_sums(signal, noise)


def roundtrip_sqnr(source: torch.Tensor, q: torch.Tensor, scale: float) -> float:
    """SQNR (dB) of ``q * scale`` (an FP8 weight as written) against its source, chunked.

    Sums per :data:`SUBCHUNK` are single-threaded float32 dot products (blocked accumulation,
    ample for 256K elements; one thread so the float does not depend on the core count) added
    up in float64, the pieces :func:`quantize_weight_sqnr` sums.
    """
    import torch

    ref = source.reshape(-1)
    got = q.reshape(-1)
    dtype = _LUT_DTYPES.get(str(source.dtype))
    if dtype is not None:
        # 16-bit sources: when q holds the table's bytes, its SQNR is the histogram's, exactly
        # the value quantize_weight_sqnr recorded; other bytes fall through to the sums below.
        table = lut.e4m3_table(scale, dtype)
        want, hist = np.empty(ref.numel(), np.uint8), lut.new_histogram()
        lut.quantize_into(_bits(ref), table, want, hist)
        if np.array_equal(want, got.view(torch.uint8).numpy()):
            return lut.sqnr_from_histogram(hist, table, scale, dtype)
    s = float(scale)
    signal = noise = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same single-threaded dots as quantize_weight_sqnr: same float
    try:
        for start in range(0, ref.numel(), SUBCHUNK):
            x = ref[start:start + SUBCHUNK].to(torch.float32)
            d = got[start:start + SUBCHUNK].to(torch.float32)
            d.mul_(s).sub_(x)
            noise += float(torch.dot(d, d))
            signal += float(torch.dot(x, x))
    finally:
        torch.set_num_threads(threads)
    return sqnr_from_sums(signal, noise)


@dataclass(frozen=True)
class WeightScan:
    """Per-module weight amax, the scale each module will use, and the problems found."""

    amax: dict[str, float]
    scale_amax: dict[str, float]  # the amax the scale is built from (group max when fused)
    scale: dict[str, np.float32 | np.ndarray]  # float32 [out] per channel, [gr, gc] per block
    nonfinite: list[str]  # tensor names holding NaN/Inf
    all_zero: list[str]  # modules whose scale amax is 0 (kept in high precision)


def scan_weights(targets: Sequence[Target], load: Callable[[str], torch.Tensor],
                 groups: dict[str, list[str]], *, on_step: Callable[[], None] | None = None,
                 per_channel: bool = False, block: tuple[int, int] | None = None
                 ) -> WeightScan:
    """Read every target weight once: amax, NaN/Inf offenders, and the per-module scale.

    Fused groups use the max amax of their members (DESIGN.md: what vLLM/TensorRT run).
    A module whose (group) amax is 0 has no scale: it is reported in ``all_zero``.
    ``per_channel``: one scale per output channel instead (float32 ``[out]``); fused members
    keep their own rows' scales, which vLLM concatenates without re-quantizing.
    ``block``: one scale per ``(bn, bk)`` tile of the ``[out, in]`` weight (float32
    ``[ceil(out/bn), ceil(in/bk)]``); fused members keep their own grids, as vLLM loads them.
    """
    amax: dict[str, float] = {}
    rows: dict[str, np.ndarray] = {}
    for t in targets:
        w = load(t.weight)
        a = chunked_amax(w)
        amax[t.weight] = a
        if math.isfinite(a) and a > 0.0:
            if block is not None:
                rows[t.module] = block_amax(w, block)
            elif per_channel:
                rows[t.module] = channel_amax(w, t.layout)
        del w
        if on_step is not None:
            on_step()
    return weight_scan(targets, amax, groups,
                       rows=rows if per_channel or block is not None else None)


def weight_scan(targets: Sequence[Target], amax_by_weight: dict[str, float],
                groups: dict[str, list[str]], rows: dict[str, np.ndarray] | None = None
                ) -> WeightScan:
    """:class:`WeightScan` from each target weight's max|x| (however it was read).

    ``rows``: per-output-channel amaxes ``[out]``, or per-block amax grids ``[gr, gc]``; then
    each module gets one scale per row (or block); fused members keep their own scales, which
    vLLM concatenates without re-quantizing.
    """
    amax = {t.module: amax_by_weight[t.weight] for t in targets}
    nonfinite = [t.weight for t in targets if not math.isfinite(amax[t.module])]
    scale_amax = dict(amax) if rows is not None else share_max(amax, groups)
    all_zero = [m for m, a in scale_amax.items() if a == 0.0]
    scale = {m: (amax_to_scale(a, f"{m}.weight") if rows is None
                 else amax_to_scales(rows[m], f"{m}.weight"))
             for m, a in scale_amax.items() if math.isfinite(a) and a > 0.0}
    return WeightScan(amax=amax, scale_amax=scale_amax, scale=scale, nonfinite=nonfinite,
                      all_zero=all_zero)
