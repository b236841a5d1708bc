"""Fused activation quantization for the FP8 GPU runtime.

Eager ``quantize_e4m3`` runs as four kernels (upcast to fp32, divide, clamp, cast) and writes an
fp32 copy of the activation; on an H200 that cost more than the FP8 GEMM saved. So this is a
hand-written Triton kernel (FP8-specific, no library has it): one pass that reads the activation
and writes E4M3, with the same arithmetic — fp32 divide by the scale, clamp to ±448,
round-to-nearest-even cast (Triton lowers the fp32→e4m3 cast to the hardware's
``cvt.rn.satfinite`` on sm_89+). A GPU test checks the result is bit-identical to the eager path.

Inside a model that is itself being compiled, the plain expression is returned and Inductor fuses
it into its producer (RMSNorm, SiLU·mul, the attention output copy), so the quantize costs no
launch of its own there. In eager it is one launch, made through :class:`Launcher`, which skips
the JIT's per-call argument binding (host time paid by every layer). FP8EXPORT_FUSED_QUANT=0
selects the eager torch path.
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


@functools.cache
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
        # correctly rounded, as torch divides (Triton's ``/`` on float32 is approximate)
        y = tl.clamp(tl.math.div_rn(x, s), -448.0, 448.0)
        tl.store(out_ptr + offs, y.to(tl.float8e4nv), mask=mask)

    return _quant_e4m3


class Launcher:
    """Launch a Triton kernel through its compiled entry point once the JIT has built it.

    The JIT's ``kernel[grid](...)`` binds and specializes every argument on every call; for a
    kernel launched once per linear layer that binding is most of its host cost. This keys the
    compiled kernel on what the JIT specializes (tensor dtypes and 16-byte alignment, integers
    equal to 1, divisible by 16 or beyond int32, the constexprs, the device) and calls it
    directly. Each new key is launched once through the JIT, then the direct call is checked
    against it (bit-identical output on the same inputs); on any difference or error this
    launcher uses the JIT from then on. ``out_arg``: index of the output tensor argument.
    """

    def __init__(self, kernel, out_arg: int):
        self.kernel = kernel
        self.out_arg = out_arg
        self.compiled: dict = {}  # key -> launch(grid, args)
        self.direct = os.environ.get("FP8EXPORT_DIRECT_LAUNCH", "1") != "0"
        self.error: str | None = None  # why the direct path was given up, for benchmarks

    def key(self, args, constexprs: dict, options: dict) -> tuple:
        parts = [args[self.out_arg].get_device()]
        for a in args:
            if isinstance(a, torch.Tensor):
                parts += (a.dtype, a.data_ptr() & 15 == 0)
            elif isinstance(a, int):
                parts += (a == 1, a & 15 == 0, a >= 2**31)
            else:
                parts.append(a)
        parts += constexprs.values()
        parts += options.values()
        return tuple(parts)

    def __call__(self, grid, args, constexprs: dict, options: dict | None = None) -> None:
        options = options or {}
        if not self.direct:
            self.kernel[grid](*args, **constexprs, **options)
            return
        key = self.key(args, constexprs, options)
        entry = self.compiled.get(key)
        if entry is not None:
            entry(grid, args)
            return
        self.kernel[grid](*args, **constexprs, **options)
        if not torch.cuda.is_current_stream_capturing():  # the check syncs: not in a capture
            self._adopt(key, grid, args, constexprs, options)

    def _adopt(self, key, grid, args, constexprs, options) -> None:
        out = args[self.out_arg]
        want = out.clone()
        try:
            compiled = self.kernel.warmup(*args, **constexprs, **options, grid=grid)
        except Exception as exc:  # a Triton API difference: keep the JIT path, which is correct
            self.direct, self.error = False, f"warmup: {type(exc).__name__}: {exc}"[:300]
            return
        errors = []
        for launch in _entries(compiled, tuple(constexprs.values())):
            try:
                out.view(torch.uint8).fill_(0x7F)  # poison: NaN in E4M3, huge in bf16
                launch(grid, args)
                same = torch.equal(want.view(torch.uint8), out.view(torch.uint8))
                if not same:
                    errors.append("output differs")
            except Exception as exc:
                same = False
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
            if same:
                self.compiled[key] = launch
                return
        out.copy_(want)
        self.direct, self.error = False, "; ".join(errors)


def _entries(compiled, constexprs: tuple):
    """Direct launches of a compiled Triton kernel to try: versions differ in whether its
    ``[grid]`` entry takes the constexprs too."""
    for extra in (constexprs, ()):
        def launch(grid, args, extra=extra):
            compiled[(*grid, 1, 1)[:3]](*args, *extra)
        yield launch


@functools.cache
def _launcher():
    return Launcher(_kernel(), out_arg=2)


def quantize_input(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize an activation to E4M3 with a float32 scalar ``scale`` (one kernel on CUDA).

    ``scale`` must be a float32 tensor on ``x``'s device (the runtime keeps its scales so).
    """
    if not x.is_cuda or torch.compiler.is_compiling() or not fused_enabled():
        return quantize_eager(x, scale)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x, dtype=E4M3_DTYPE)  # x is contiguous: same layout
    n = x.numel()
    if n:
        _launcher()((triton_cdiv(n, _BLOCK),), (x, scale, out, n), {"BLOCK": _BLOCK})
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
