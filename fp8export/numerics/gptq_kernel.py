"""GPTQ's column loop on the GPU as one Triton kernel per block of columns.

In torch, GPTQ's inner loop launches about ten tiny kernels per column (round, error, update),
so on a GPU it is bound by launches: about 0.36 ms a column on an H200, minutes per layer of a
large model. The rows of ``W`` are independent in that loop (a column's error only updates the
same row's later columns), so each program here keeps a tile of rows × the block's columns in
registers and walks the block's columns itself; the update of the columns after the block stays
one matrix product in torch. Hand-written because no library has GPTQ on the E4M3 grid.

The arithmetic is the torch loop's, step for step: float32 division correctly rounded
(``div_rn``; Triton's ``/`` is approximate), the clamp to ±448, the round-to-nearest-even cast
to E4M3 (``cvt.rn.satfinite`` on sm_89+), the error divided by the diagonal, and the update as a
product then a difference (fp contraction off, so no fused multiply-add). A GPU test checks the
codes are bit-identical to the torch loop's. FP8EXPORT_GPTQ_KERNEL=0 selects the torch loop.
"""

from __future__ import annotations

import functools
import os

import torch

from fp8export.numerics.fp8 import E4M3_MAX

ROWS = 16  # rows per program: the tile (16 × 128 float32) stays in registers


def enabled(t: torch.Tensor) -> bool:
    """True where the kernel runs ``t``'s loop: a CUDA tensor on a GPU with E4M3 casts
    (sm_89+), Triton installed, not disabled."""
    return (t.is_cuda and os.environ.get("FP8EXPORT_GPTQ_KERNEL", "1") != "0"
            and _has_e4m3(t.device.index if t.device.index is not None
                          else torch.cuda.current_device())
            and _kernel() is not None)


@functools.cache
def _has_e4m3(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


@functools.cache
def _kernel():
    """The Triton kernel, or None where Triton is not installed (CPU-only machines)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _gptq_block(w_ptr, s_ptr, h_ptr, q_ptr, e_ptr, rows, sw, ss, sh, shc, sq, se,
                    NC: tl.constexpr, LIMIT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        c = tl.arange(0, BC)
        rm = r < rows
        w = tl.load(w_ptr + r[:, None] * sw + c[None, :],
                    mask=rm[:, None] & (c[None, :] < NC), other=0.0)
        for i in range(NC):
            # column i of the tile: -0.0 is the exact identity of a sum (keeps a -0.0 weight)
            col = tl.sum(tl.where(c[None, :] == i, w, -0.0), axis=1)
            s = tl.load(s_ptr + r * ss + i, mask=rm, other=1.0)
            x = tl.clamp(tl.math.div_rn(col, s), -LIMIT, LIMIT)
            q = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32) * s
            e = tl.math.div_rn(col - q, tl.load(h_ptr + i * sh + i * shc))
            # H⁻¹'s factor is upper triangular: the columns before i get zero updates
            h = tl.load(h_ptr + i * sh + c * shc, mask=c < NC, other=0.0)
            w = w - e[:, None] * h[None, :]
            tl.store(q_ptr + r * sq + i, q, mask=rm)
            tl.store(e_ptr + r * se + i, e, mask=rm)

    return _gptq_block


def round_block(cols: torch.Tensor, scales: torch.Tensor, hinv_block: torch.Tensor,
                out: torch.Tensor, err: torch.Tensor) -> None:
    """One block of GPTQ's column loop: ``cols`` ``[rows, b]`` rounded column by column on the
    E4M3 grid of ``scales`` (same shape), each column's error compensated in the later columns
    of the block along ``hinv_block`` (``[b, b]``, the upper Cholesky factor of H⁻¹ there).
    Writes the rounded values to ``out`` and the scaled errors to ``err`` (both ``[rows, b]``);
    ``cols`` is left as it was. Every tensor float32 on one CUDA device; all but
    ``hinv_block`` (LAPACK gives it column-major) with contiguous columns."""
    rows, b = cols.shape
    for t in (cols, scales, hinv_block, out, err):
        if t.dtype != torch.float32 or t.device != cols.device or (
                t is not hinv_block and t.stride(1) != 1):
            raise ValueError("round_block needs float32 tensors on one device, their columns "
                             "contiguous (H⁻¹'s factor may be in either order)")
    width = max(16, 1 << (b - 1).bit_length())
    _kernel()[(-(-rows // ROWS),)](
        cols, scales, hinv_block, out, err, rows, cols.stride(0), scales.stride(0),
        hinv_block.stride(0), hinv_block.stride(1), out.stride(0), err.stride(0), NC=b,
        LIMIT=E4M3_MAX, BR=ROWS, BC=width, num_warps=4, enable_fp_fusion=False)
