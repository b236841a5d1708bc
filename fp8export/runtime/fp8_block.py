"""The GPU path of block-scaled FP8 linears (DeepSeek-V3 / Qwen3-FP8 / FP8_BLOCK folders).

A block-scaled layer holds an E4M3 weight ``[N, K]`` with one scale per ``bn x bk`` tile and
quantizes its input per token and group of ``g`` input elements (``g == bk``, the input's scale
grid lines up with the weight's K blocks). The product is

    y[m, n] = sum over K blocks b of  sa[m, b] * sw[n // bn, b] * (qa[m, b-th block] . qw[n, b-th])

with each block's dot product accumulated in fp32 and scaled before it is added: what vLLM's
``w8a8_block_fp8_matmul``, DeepGEMM and cuBLAS's block-scaled GEMM compute. Two
implementations, picked per weight shape:

* **cuBLAS** through ``torch._scaled_mm`` with ``scale_a`` ``[M, K/128]`` (outer-dim-major, the
  ``BlockWise1x128`` recipe) and ``scale_b`` ``[K/128, N/128]`` (``BlockWise128x128``): torch
  dispatches that pair to cuBLASLt's block-scaled FP8 GEMM, which needs compute capability 9.0
  and a CUDA 12.9+ build, and blocks of exactly 128x128. cuBLAS reads the weight's scale grid
  with a leading dimension of K/128 rounded up to 4 and the input's with M rounded up to 4
  (torch's ``_scaled_mm_v2`` checks say so: ``L4 = round_up(K / 128, 4)``), so only K a
  multiple of 512 and M a multiple of 4 take it: on an H100 (torch 2.11, CUDA 13.0) every such
  shape of 100 tried matched the Triton kernel, and 237 of 330 other shapes gave wrong numbers
  (rel L2 0.25 to 1e16) or CUBLAS_STATUS_NOT_SUPPORTED. The first call of each weight shape is
  still checked against the Triton kernel (relative L2 <= 1e-2: a scale layout misread is off
  by far more); on an error or a mismatch that shape takes the Triton kernel from then on.
* **Triton**: one kernel for any block size whose ``bk`` (= ``g``) is a power of two from 32 to
  256 and any ``bn``; each program computes a 32x64 output tile, one K block per step.

Weight-only layers (``dynamic="none"``: weights FP8, inputs not quantized) multiply the input
with the dequantized weight. ``FP8EXPORT_BLOCK_GEMM=cublas|triton`` forces one implementation
(tests, benchmarks); ``path_used()`` says which ran for each shape.
"""

from __future__ import annotations

import functools
import os

import torch

from fp8export.numerics.block import expand_blocks, group_scales, quantize_groups

_FORCE = os.environ.get("FP8EXPORT_BLOCK_GEMM", "auto")
_CUBLAS: dict[tuple, str] = {}  # (device, N, K) -> "cublas" | reason it is not used


def block_fallback_reason(layer) -> str | None:
    """Why ``layer`` (a block-scaled, group- or weight-only Fp8Linear) cannot take a GPU FP8
    path and is emulated there, or None."""
    if layer.input_scale is None and layer.dynamic == "none":
        return None  # weight-only: the dequantized weight times the input, on any shape
    if layer.block is None:
        return ("per-token-group inputs with per-tensor or per-channel weights have no FP8 GEMM "
                "here (only block-scaled weights do)")
    if layer.input_scale is not None or layer.dynamic != "group":
        return "block-scaled weights run with dynamic per-token-group inputs only"
    bk = layer.block[1]
    if layer.group_size != bk:
        return (f"input group size {layer.group_size} differs from the weight block's "
                f"{bk} columns")
    if bk not in (32, 64, 128, 256):
        return f"block of {bk} input columns (the FP8 kernels take 32, 64, 128 or 256)"
    if layer.in_features % 16:
        return f"{layer.in_features} input features are not a multiple of 16"
    return None


def block_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """``layer`` on a 2-D input ``[M, K]`` on the GPU: the block-scaled FP8 GEMM, or the
    weight-only product."""
    if layer.input_scale is None and layer.dynamic == "none":
        w = layer.weight.to(torch.float32) * layer.weight_scale_rows()
        y = torch.nn.functional.linear(x.to(torch.float32), w)
        if layer.bias is not None:
            y = y + layer.bias.to(torch.float32)
        return y.to(layer.out_dtype)
    return block_matmul(x, layer.weight, layer.weight_scale, layer.block, layer.bias,
                        layer.out_dtype)


def block_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 block: tuple[int, int], bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, K]`` activation (CUDA) times the E4M3 ``weight [N, K]`` with its scale grid
    ``[ceil(N/bn), ceil(K/bk)]``; the activation is quantized per token group of ``bk``."""
    m, k = x.shape
    n = weight.shape[0]
    scales = group_scales(x, block[1])  # [M, ceil(K/bk)] float32
    a = quantize_groups(x, scales, block[1])
    key = (x.get_device(), n, k, block)
    if _cublas_eligible(x, weight, block, key):
        try:
            y = _cublas(a, weight, scales, weight_scale)
        except RuntimeError as exc:
            _CUBLAS[key] = f"torch._scaled_mm refused it: {str(exc).splitlines()[0][:200]}"
        else:
            if key not in _CUBLAS:  # first call of this shape: check it against the kernel
                want = triton_block_matmul(a, weight, scales, weight_scale, block,
                                           torch.bfloat16)
                err = float((y.float() - want.float()).norm() / want.float().norm().clamp_min(
                    1e-30))
                _CUBLAS[key] = "cublas" if err <= 1e-2 else (
                    f"torch._scaled_mm differs from the Triton kernel (rel L2 {err:.2e})")
            if _CUBLAS[key] == "cublas":
                return _finish(y, bias, out_dtype)
    y = triton_block_matmul(a, weight, scales, weight_scale, block, torch.float32)
    return _finish(y, bias, out_dtype)


def path_used() -> dict[str, str]:
    """Per weight shape seen so far: "cublas", or why the Triton kernel ran instead."""
    return {f"{n}x{k} blocks {b[0]}x{b[1]}": v for (_, n, k, b), v in _CUBLAS.items()}


def _finish(y: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y.to(torch.float32) + bias.to(torch.float32)
    return y.to(out_dtype)


def cublas_shape_ok(m: int, n: int, k: int) -> bool:
    """Shapes cuBLAS's block-scaled GEMM computes right through ``torch._scaled_mm`` (its scale
    grids are read with leading dimensions rounded up to 4: module docstring)."""
    return k % 512 == 0 and m % 4 == 0 and n % 16 == 0


def _cublas_eligible(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int],
                     key: tuple) -> bool:
    if _FORCE == "triton" or block != (128, 128):
        return False
    if not cublas_shape_ok(x.shape[0], weight.shape[0], weight.shape[1]):
        return False  # this call only: another M of the same weight may qualify
    if _FORCE != "cublas" and _CUBLAS.get(key, "cublas") != "cublas":
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        _CUBLAS.setdefault(key, "cuBLAS block-scaled FP8 GEMMs need compute capability 9.0")
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return _CUBLAS.get(key) == "cublas"  # never probe inside a graph
    return True


def _cublas(a: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
            weight_scale: torch.Tensor) -> torch.Tensor:
    # BlockWise1x128 wants scale_a [M, K/128] with stride (1, M) (outer-dim-major);
    # BlockWise128x128 checks scale_b.t() = our [N/128, K/128] grid, row-major.
    scale_a = scales.t().contiguous().t()
    return torch._scaled_mm(a, weight.t(), scale_a=scale_a, scale_b=weight_scale.t(),
                            out_dtype=torch.bfloat16)


# --------------------------------------------------------------------------- Triton kernel
@functools.cache
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _block_fp8_gemm(a_ptr, w_ptr, out_ptr, sa_ptr, sw_ptr, M, N, K, stride_am, stride_wn,
                        stride_om, stride_sam, stride_swn, BN: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        sa_rows = sa_ptr + rm.to(tl.int64) * stride_sam
        sw_rows = sw_ptr + (rn // BN).to(tl.int64) * stride_swn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k = kb * BLOCK_K + rk
            k_ok = (k < K)[None, :]
            a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
            sa = tl.load(sa_rows + kb, mask=m_ok, other=0.0)
            sw = tl.load(sw_rows + kb, mask=n_ok, other=0.0)
            # each K block's product in fp32 on its own, scaled, then added (as DeepGEMM does)
            acc += tl.dot(a, tl.trans(w)) * sa[:, None] * sw[None, :]
        out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return _block_fp8_gemm


def triton_block_matmul(a: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                        weight_scale: torch.Tensor, block: tuple[int, int],
                        out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel on an already quantized ``a`` ``[M, K]`` (E4M3) with its group scales
    ``[M, ceil(K/bk)]``; without Triton (no GPU build), the same sum in torch."""
    m, k = a.shape
    n = weight.shape[0]
    kernel = _kernel()
    if kernel is None or not a.is_cuda:
        xa = a.to(torch.float32) * scales.repeat_interleave(block[1], dim=1)[:, :k]
        w = weight.to(torch.float32) * expand_blocks(weight_scale, (n, k), block)
        return (xa @ w.t()).to(out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    a = a.contiguous()
    scales = scales.contiguous()
    ws = weight_scale.contiguous()
    block_m, block_n = 32, 64
    grid = (-(-n // block_n), -(-m // block_m))
    kernel[grid](a, weight, out, scales, ws, m, n, k, a.stride(0), weight.stride(0),
                 out.stride(0), scales.stride(0), ws.stride(0), BN=block[0], BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_K=block[1], num_warps=4, num_stages=3)
    return out
