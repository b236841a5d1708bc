"""Block-wise E4M3 weights (one scale per ``bn x bk`` tile) and per-token-group activations.

The format DeepSeek-V3 and the Qwen3 "-FP8" releases ship, and compressed-tensors' FP8_BLOCK:
a weight ``[out, in]`` gets a scale grid ``[ceil(out/bn), ceil(in/bk)]``, ``scale[i, j] =
amax(|W[i*bn:(i+1)*bn, j*bk:(j+1)*bk]|) / 448``. Where a dimension is not a multiple of the
block, the last tile is partial and its amax comes from its own elements only (the grid is
``ceil``, as vLLM's ``weight_scale_inv``, transformers' ``FP8Linear`` and compressed-tensors'
``block`` strategy allocate it). A tile that is all zero has no range: it takes the smallest
scale of the other tiles (``fp8.amax_to_scales``, one rule for channels and blocks). Per element
the arithmetic is ``quantize_e4m3``'s: float32 divide, clamp to ±448, round-to-nearest-even
cast.

Activations of such layers are quantized dynamically per token in groups of ``bk`` along the
input dimension (``per_token_group_quant_fp8`` in vLLM/SGLang, ``act_quant`` in DeepSeek's
inference code): one scale ``amax / 448`` per (token, group); an all-zero group gets scale 1.

Work on weights goes in bands of whole block rows, so no full-size float32 copy of a large
weight is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fp8export.numerics.fp8 import E4M3_MAX
from fp8export.numerics.metrics import sqnr_from_sums

if TYPE_CHECKING:  # torch is imported where a function needs it (lazily: convert's
    import torch  # default path runs without it)

BAND = 1 << 22  # elements per band of whole block rows
# The largest block side an FP8 folder may record (real ones: 128); convert refuses larger ones
# before reading anything, and the folder reader refuses a manifest that records one.
MAX_BLOCK = 1 << 16


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a ``[out, in]`` weight: ``(ceil(out/bn), ceil(in/bk))``."""
    out, inp = shape
    bn, bk = block
    return -(-out // bn), -(-inp // bk)


def _bands(w: torch.Tensor, block: tuple[int, int]):
    """(block-row start, stop, rows of ``w``) in bands of whole block rows."""
    bn = block[0]
    n_rows = -(-w.shape[0] // bn)
    per = max(1, BAND // max(1, bn * w.shape[1]))
    for start in range(0, n_rows, per):
        stop = min(n_rows, start + per)
        yield start, stop, w[start * bn:stop * bn]


def _group_amax(a: torch.Tensor, group: int) -> torch.Tensor:
    """max over consecutive groups of ``group`` elements of the last dimension of ``a``
    ``[..., n]``: ``[..., ceil(n/group)]``, the last group partial where ``n`` is ragged (NaN
    propagates). Nothing is padded: a group far larger than ``n`` (a block of 65536 on a 64-wide
    weight) costs no more memory than ``a`` itself."""
    import torch

    n = a.shape[-1]
    full = n - n % group
    parts = []
    if full:
        parts.append(a[..., :full].reshape(*a.shape[:-1], full // group, group).amax(dim=-1))
    if full < n:
        parts.append(a[..., full:].amax(dim=-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _tile_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max|x| of every ``bn x bk`` tile of ``x`` ``[rows, in]``: ``[ceil(rows/bn),
    ceil(in/bk)]``, ragged edge tiles from their own elements."""
    bn, bk = block
    return _group_amax(_group_amax(x.abs(), bk).t(), bn).t()


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> np.ndarray:
    """max|W| of every tile of a 2-D ``[out, in]`` weight, float64 ``[gr, gc]`` (NaN where a
    tile holds NaN)."""
    import torch

    if w.dim() != 2:
        raise ValueError(f"block scales need a 2-D weight, got shape {tuple(w.shape)}")
    out = np.empty(grid_shape(tuple(w.shape), block), dtype=np.float64)
    for start, stop, band in _bands(w, block):
        amax = _tile_amax(band.to(torch.float32), block)  # NaN propagates
        out[start:stop] = amax.to(torch.float64).numpy()
    return out


def expand_blocks(grid: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]
                  ) -> torch.Tensor:
    """The grid ``[gr, gc]`` repeated over its tiles, ``shape`` ``[out, in]`` (edge tiles
    cropped). Gathered by index, so a block larger than the weight allocates only ``shape``."""
    import torch

    bn, bk = block
    rows = torch.div(torch.arange(shape[0], device=grid.device), bn, rounding_mode="floor")
    cols = torch.div(torch.arange(shape[1], device=grid.device), bk, rounding_mode="floor")
    return grid.index_select(0, rows).index_select(1, cols)


def quantize_blocks_sqnr(w: torch.Tensor, scales: np.ndarray, block: tuple[int, int],
                         ) -> tuple[torch.Tensor, float]:
    """E4M3 ``w`` ``[out, in]`` with one scale per tile, and the SQNR (dB) of its round trip."""
    import torch

    s_all = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32))
    if tuple(s_all.shape) != grid_shape(tuple(w.shape), block):
        raise ValueError(f"scale grid {tuple(s_all.shape)} does not fit weight "
                         f"{tuple(w.shape)} in blocks of {block}")
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    signal = noise = 0.0
    bn = block[0]
    for start, stop, band in _bands(w, block):
        x = band.to(torch.float32)
        s = expand_blocks(s_all[start:stop], tuple(x.shape), block)
        qb = (x / s).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        q[start * bn:start * bn + x.shape[0]] = qb
        d = qb.to(torch.float32).mul_(s).sub_(x)
        noise += float(torch.sum(d.double() * d.double()))
        signal += float(torch.sum(x.double() * x.double()))
    return q, sqnr_from_sums(signal, noise)


def blocks_roundtrip_sqnr(source: torch.Tensor, q: torch.Tensor, scales: np.ndarray,
                          block: tuple[int, int]) -> float:
    """SQNR (dB) of ``q * scale[tile]`` (a block-scaled weight as written) against its source:
    the same float :func:`quantize_blocks_sqnr` returns for those bytes."""
    import torch

    s_all = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32))
    signal = noise = 0.0
    for (start, stop, band), (_, _, qb) in zip(_bands(source, block), _bands(q, block)):
        x = band.to(torch.float32)
        s = expand_blocks(s_all[start:stop], tuple(x.shape), block)
        d = qb.to(torch.float32).mul_(s).sub_(x)
        noise += float(torch.sum(d.double() * d.double()))
        signal += float(torch.sum(x.double() * x.double()))
    return sqnr_from_sums(signal, noise)


# --------------------------------------------------------------------------- activations
def _group_index(k: int, group: int, device) -> torch.Tensor:
    """For each of ``k`` elements, the index of its group of ``group``."""
    import torch

    return torch.div(torch.arange(k, device=device), group, rounding_mode="floor")


def group_scales(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per-token-group dequantization scales of ``x`` ``[..., K]``: float32 ``[..., ceil(K/g)]``,
    ``amax / 448`` of each group of ``group`` consecutive elements of the last dimension (the
    last group may be partial); an all-zero group gets 1."""
    import torch

    amax = _group_amax(x.detach().to(torch.float32).abs(), group)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_groups(x: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """E4M3 codes of ``x`` ``[..., K]`` with the group scales ``[..., ceil(K/g)]``."""
    import torch

    s = scales.index_select(-1, _group_index(x.shape[-1], group, scales.device))
    return (x.to(torch.float32) / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fake_quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` quantized per token group and dequantized again, in float32: what a layer with
    dynamic group activations multiplies its weight with."""
    import torch

    group = min(group, x.shape[-1])
    s = group_scales(x, group)
    q = quantize_groups(x, s, group)
    return q.to(torch.float32) * s.index_select(-1, _group_index(x.shape[-1], group, s.device))

