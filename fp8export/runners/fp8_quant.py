"""Fused activation quantization for the FP8 GPU runtime.

Eager ``quantize_e4m3`` runs as four kernels (upcast to fp32, divide, clamp, cast) and writes an
fp32 copy of the activation; on an H200 that cost more than the FP8 GEMM saved (eager FP8
prefill measured 0.55-0.77x bf16, bench/results/gpu_fp8.json). A ``torch.compile``'d version
fuses it but pays ~150 us of guard overhead per call with dynamic shapes, worse still at small
batches. So this is a hand-written Triton kernel (FP8-specific, no library has it): one pass
that reads the activation and writes E4M3, with the same arithmetic — fp32 divide by the scale,
clamp to ±448, round-to-nearest-even cast (Triton lowers the fp32→e4m3 cast to the hardware's
``cvt.rn.satfinite`` on sm_89+). A GPU test checks the result is bit-identical to the eager
path. Inside a model that is itself being compiled, the plain expression is returned and
Inductor fuses it into its producer. FP8EXPORT_FUSED_QUANT=0 selects the eager path.
"""

from __future__ import annotations

import functools
import os

import torch

from fp8export.numerics.fp8 import E4M3_DTYPE, E4M3_MAX

_BLOCK = 2048


def quantize_eager(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``cast_rne(clamp(x / scale, ±448))`` — the DESIGN.md quantize, as plain torch ops."""
    return (x.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE)


def fused_enabled() -> bool:
    return os.environ.get("FP8EXPORT_FUSED_QUANT", "1") != "0" and _kernel() is not None


@functools.cache
def _kernel():
    """The Triton kernel, or None where Triton is not installed (CPU-only machines)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _quant_e4m3(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(scale_ptr)
        y = tl.clamp(x / s, -448.0, 448.0)
        tl.store(out_ptr + offs, y.to(tl.float8e4nv), mask=mask)

    return _quant_e4m3, triton.cdiv


def quantize_input(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize an activation to E4M3 with a float32 scalar ``scale`` (one kernel on CUDA)."""
    if not x.is_cuda or torch.compiler.is_compiling() or not fused_enabled():
        return quantize_eager(x, scale)
    kernel, cdiv = _kernel()
    x = x.contiguous()
    s = scale.reshape(1).to(device=x.device, dtype=torch.float32)
    out = torch.empty(x.shape, device=x.device, dtype=E4M3_DTYPE)
    n = x.numel()
    if n:
        kernel[(cdiv(n, _BLOCK),)](x, s, out, n, BLOCK=_BLOCK)
    return out
