"""Block-wise E4M3 weights and per-token-group activations, element by element against an
independent reference: each tile (or group) sliced out and quantized on its own with
``quantize_e4m3`` and the scale ``amax(tile) / 448`` computed from that slice."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8export.convert.config import parse_block_size
from fp8export.errors import Fp8ExportError
from fp8export.numerics import block as blk
from fp8export.numerics.block import (
    block_amax,
    blocks_roundtrip_sqnr,
    expand_blocks,
    fake_quantize_groups,
    grid_shape,
    group_scales,
    quantize_blocks_sqnr,
    quantize_groups,
)
from fp8export.numerics.fp8 import amax_to_scale, amax_to_scales, quantize_e4m3


def _weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 1, out)[:, None]  # rows spanning four decades
    return (torch.randn(out, inp, generator=g) * rows).to(torch.bfloat16)


def _reference(w: torch.Tensor, block: tuple[int, int]):
    """Tile by tile, by slicing: (scales [gr, gc] float32, codes [out, in] E4M3)."""
    bn, bk = block
    out, inp = w.shape
    gr, gc = -(-out // bn), -(-inp // bk)
    scales = np.zeros((gr, gc), np.float32)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scales[i, j] = amax_to_scale(float(tile.float().abs().max()))
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = quantize_e4m3(tile, scales[i, j])
    return scales, q


@pytest.mark.parametrize(("shape", "block"), [
    ((256, 384), (128, 128)),  # exact multiples
    ((200, 300), (128, 128)),  # ragged on both edges: partial last row and column of tiles
    ((96, 40), (16, 32)),  # small blocks, ragged input edge (40 = 32 + 8)
    ((5, 7), (128, 128)),  # smaller than one block: one partial tile
])
def test_codes_and_scales_equal_a_tile_by_tile_reference(shape, block, monkeypatch):
    monkeypatch.setattr(blk, "BAND", 1000)  # several bands of whole block rows
    w = _weight(*shape)
    want_scales, want_q = _reference(w, block)
    amax = block_amax(w, block)
    assert amax.shape == grid_shape(shape, block) == want_scales.shape
    scales = amax_to_scales(amax, "w")
    assert np.array_equal(scales, want_scales)  # each edge tile from its own elements
    q, sqnr = quantize_blocks_sqnr(w, scales, block)
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # SQNR of exactly these codes, from the same sums as read-back recomputes it
    deq = q.float() * expand_blocks(torch.from_numpy(scales), shape, block)
    direct = 10 * math.log10(float((w.double() ** 2).sum()) /
                             float(((deq.double() - w.double()) ** 2).sum()))
    assert abs(sqnr - direct) < 1e-6
    assert sqnr == blocks_roundtrip_sqnr(w, q, scales, block)


def test_small_blocks_keep_their_own_range():
    """Rows seven decades apart: one scale per tensor pushes the small rows into E4M3's
    subnormals (few steps, or zero), their own block scales keep them at full resolution."""
    w = _weight(256, 256)
    small = slice(0, 64)  # rows 1e-7 .. 1e-6 of the largest
    w[small] *= 1e-4
    q, _ = quantize_blocks_sqnr(w, amax_to_scales(block_amax(w, (64, 128)), "w"), (64, 128))
    s = amax_to_scale(float(w.float().abs().max()))
    per_tensor = quantize_e4m3(w, s).float() * float(s)
    per_block = q.float() * expand_blocks(
        torch.from_numpy(amax_to_scales(block_amax(w, (64, 128)), "w")), (256, 256), (64, 128))

    def sqnr(deq):
        ref = w[small].double()
        return 10 * math.log10(float((ref ** 2).sum()) / float(((deq[small] - ref) ** 2).sum()))

    assert sqnr(per_block) > 25.0 and sqnr(per_block) > sqnr(per_tensor) + 10.0


def test_a_zero_tile_takes_the_smallest_other_scale_and_stays_zero():
    w = _weight(64, 64)
    w[:32, 32:] = 0
    scales = amax_to_scales(block_amax(w, (32, 32)), "w")
    assert scales[0, 1] == scales[[0, 1, 1], [0, 0, 1]].min() and np.all(scales > 0)
    q, _ = quantize_blocks_sqnr(w, scales, (32, 32))
    assert not q[:32, 32:].float().any()


def test_nan_and_all_zero_are_refused_naming_the_block():
    w = _weight(64, 64).float()
    w[40, 3] = float("nan")
    with pytest.raises(Fp8ExportError, match=r"w: block \(1, 0\) has amax nan"):
        amax_to_scales(block_amax(w, (32, 32)), "w")
    with pytest.raises(Fp8ExportError, match="every block is zero"):
        amax_to_scales(block_amax(torch.zeros(8, 8), (4, 4)), "w")
    with pytest.raises(ValueError, match="does not fit"):
        quantize_blocks_sqnr(torch.ones(8, 8), np.ones((2, 3), np.float32), (4, 4))


def test_grid_helpers():
    assert grid_shape((576, 7168), (128, 128)) == (5, 56)  # DeepSeek-V3 kv_a_proj_with_mqa
    full = expand_blocks(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), (3, 5), (2, 3))
    assert full.tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 2, 2], [3, 3, 3, 4, 4]]


@pytest.mark.parametrize("value,want", [("128", (128, 128)), ("128x64", (128, 64)),
                                        ("64,32", (64, 32)), (16, (16, 16)), ((8, 4), (8, 4)),
                                        (None, None)])
def test_parse_block_size(value, want):
    assert parse_block_size(value) == want


@pytest.mark.parametrize("value", ["0", "x", "128x", "1x2x3", -4, (1, 0), True])
def test_parse_block_size_refuses(value):
    with pytest.raises(ValueError):
        parse_block_size(value)


@pytest.mark.parametrize("k,group", [(256, 128), (300, 128), (40, 16)])
def test_group_quantization_equals_a_group_by_group_reference(k, group):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, k, generator=g) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    x[0, 0, :group] = 0  # an all-zero group: scale 1
    s = group_scales(x, group)
    q = quantize_groups(x, s, group)
    assert s.shape == (3, 5, -(-k // group)) and s.dtype == torch.float32
    assert float(s[0, 0, 0]) == 1.0
    for b in range(3):
        for t in range(5):
            for j in range(s.shape[-1]):
                piece = x[b, t, j * group:(j + 1) * group]
                amax = float(piece.float().abs().max())
                want_s = np.float32(amax / 448) if amax > 0 else np.float32(1.0)
                assert float(s[b, t, j]) == float(want_s)
                want = quantize_e4m3(piece, want_s)
                got = q[b, t, j * group:(j + 1) * group]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    fq = fake_quantize_groups(x, group)
    expanded = s.repeat_interleave(group, dim=-1)[..., :k]
    assert torch.equal(fq, q.float() * expanded)
