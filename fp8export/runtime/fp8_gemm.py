"""The FP8 GEMM of the GPU runtime: ``torch._scaled_mm``, and a one-launch kernel for eager.

``fp8_matmul(x, weight, input_scale, weight_scale, bias)`` computes the function the emulated
path computes (DESIGN.md quantize of ``x`` with the static or dynamic per-tensor scale, E4M3
codes multiplied with fp32 accumulation, times both scales, plus bias, rounded once to the
output dtype) in one of two ways:

* ``torch._scaled_mm`` (cuBLASLt FP8) after the one-launch input quantize. This is the path
  under ``torch.compile`` (Inductor fuses the quantize into its producer) and inside CUDA graph
  capture: measured on an H100 in CUDA graphs (``bench/results/gpu_fp8.md``), cuBLASLt's FP8
  GEMM beats bf16 at every M from 1 to 16384 and beat every tile shape we tried of the Triton
  kernel below on device time, so no small-M GEMM is needed there.
* In eager, for at most ``EAGER_M`` rows, a Triton kernel that reads the bf16 activation,
  quantizes it in registers with the same arithmetic and runs the FP8 dot itself. At those
  sizes eager is bound by host time per launch (20-50 us each on the benchmark host), and this
  is one launch where quantize + ``_scaled_mm`` is two, with cuBLASLt's heuristic query on top.
  Its row tiles stay at 16/32 rows, where Triton uses MMA instructions with full fp32
  accumulation (64-row tiles take Hopper's wgmma path, whose FP8 accumulation lost ~1e-3
  relative accuracy in the GPU tests). FP8EXPORT_EAGER_M=0 turns it off.

Both take ``weight`` as stored, ``[N, K]`` row-major, i.e. the column-major ``[K, N]``
operand both cuBLASLt and Hopper's FP8 tensor-core instructions want (K-major B), no copy.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from fp8export.runtime.fp8_quant import Launcher, quantize_input

EAGER_M = (int(os.environ.get("FP8EXPORT_EAGER_M", "128"))
           if importlib.util.find_spec("triton") is not None else 0)
"""Rows up to which eager calls use the one-launch Triton kernel (0: never)."""


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor,
               weight_scale: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype, weight_t: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, K]`` activation (bf16/fp16/fp32, CUDA) times E4M3 ``weight [N, K]`` → ``[M, N]``.

    ``input_scale``/``weight_scale`` are float32 0-d tensors on the same device; ``bias`` is
    ``[N]`` in ``out_dtype`` or None; ``weight_t``: ``weight.t()`` if the caller keeps one.
    """
    if (x.is_cuda and x.shape[0] <= EAGER_M and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()):
        return small_m_matmul(x, weight, input_scale, weight_scale, bias, out_dtype)
    a = quantize_input(x, input_scale)
    return quantized_matmul(a, weight.t() if weight_t is None else weight_t, input_scale,
                            weight_scale, bias, out_dtype)


def quantized_matmul(a: torch.Tensor, weight_t: torch.Tensor, input_scale: torch.Tensor,
                     weight_scale: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` of an already quantized ``[M, K]`` E4M3 activation and
    ``weight_t`` (``weight.t()``, a view ``[K, N]``; a view of some of the weight's rows works)."""
    if bias is not None and bias.dtype == out_dtype == torch.bfloat16:
        # bias in the epilogue: added to the fp32 result before the one rounding, as emulated
        return torch._scaled_mm(a, weight_t, scale_a=input_scale, scale_b=weight_scale,
                                bias=bias, out_dtype=out_dtype)
    y = torch._scaled_mm(a, weight_t, scale_a=input_scale, scale_b=weight_scale,
                         out_dtype=out_dtype)
    return y if bias is None else y + bias.to(y.dtype)


def rowwise_matmul(x: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor,
                   weight_scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8_matmul`` with a per-row input scale (``[M, 1]`` or scalar) and/or a per-output-
    channel weight scale (``[N]`` or scalar): ``torch._scaled_mm``'s row-wise scaling, which
    takes ``scale_a [M, 1]`` and ``scale_b [1, N]`` in float32 and a bf16 output (cuBLASLt's
    row-wise FP8 GEMM needs compute capability 9.0); the gpu-marked tests compare it with the
    emulation.
    """
    m, n = x.shape[0], weight.shape[0]
    a = quantize_input(x, input_scale) if input_scale.dim() == 0 else \
        (x.to(torch.float32) / input_scale).clamp(-448.0, 448.0).to(weight.dtype)
    scale_a = input_scale.to(torch.float32).reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = weight_scale.to(torch.float32).reshape(1, -1).expand(1, n).contiguous()
    y = torch._scaled_mm(a, weight.t(), scale_a=scale_a, scale_b=scale_b,
                         out_dtype=torch.bfloat16)
    if bias is not None:
        y = y.to(torch.float32) + bias.to(torch.float32)
    return y.to(out_dtype)


# --------------------------------------------------------------------------- small-M kernel
@functools.cache
def _small_m_kernel():
    """The Triton kernel, or None without Triton (CPU-only machines)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _fp8_gemm_small_m(x_ptr, w_ptr, out_ptr, bias_ptr, sx_ptr, sw_ptr, M, N, K,
                          stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        sx = tl.load(sx_ptr)
        sw = tl.load(sw_ptr)
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        m_ok = rm[:, None] < M
        n_ok = rn[:, None] < N  # rows of the weight tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk)[None, :] < K
            x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok & k_ok, other=0.0)
            # the DESIGN.md quantize, bit for bit: fp32 divide (correctly rounded: Triton's
            # ``/`` is approximate), clamp, RNE cast
            xq = tl.clamp(tl.math.div_rn(x.to(tl.float32), sx), -448.0, 448.0).to(tl.float8e4nv)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok & k_ok, other=0.0)
            acc = tl.dot(xq, tl.trans(w), acc)
        y = acc * (sx * sw)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok & (rn[None, :] < N))

    return _fp8_gemm_small_m


@functools.cache
def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device ``index`` (tile choices size their grids by it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def small_m_config(m: int, n: int, k: int, sms: int) -> dict[str, int]:
    """Tile sizes for ``m`` rows, from the H100 tile sweep (``bench/gpu_fp8.py --parts sweep``).

    Row tiles of 16/32 (full-precision MMA accumulation, see the module docstring); column
    tiles of 32, or 64 for wide weights, which the sweep found fastest at 1-32 rows; 256 E4M3
    bytes of K per step.
    """
    block_m = 16 if m <= 16 else 32
    block_n = 64 if n >= 8 * sms * 8 else 32
    block_k = 256 if k % 256 == 0 else 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "num_warps": 4, "num_stages": 4}


_CONFIGS: dict[tuple[int, int, int, int], dict[str, int]] = {}


def small_m_matmul(x: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor,
                   weight_scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype, config: dict[str, int] | None = None) -> torch.Tensor:
    """The fused quantize + FP8 GEMM kernel (any M; meant for M <= ``EAGER_M`` in eager)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty((m, n), dtype=out_dtype)
    if m == 0:
        return out
    if config is None:
        key = (m, n, k, x.get_device())
        config = _CONFIGS.get(key)
        if config is None:
            config = _CONFIGS[key] = small_m_config(m, n, k, sm_count(key[3]))
    cfg = config
    grid = (-(-n // cfg["BLOCK_N"]), -(-m // cfg["BLOCK_M"]))
    _launcher()(grid, (x, weight, out, bias if bias is not None else out, input_scale,
                       weight_scale, m, n, k, x.stride(0), weight.stride(0), out.stride(0)),
                {"HAS_BIAS": bias is not None, "BLOCK_M": cfg["BLOCK_M"],
                 "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]},
                {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    return out


@functools.cache
def _launcher() -> Launcher:
    return Launcher(_small_m_kernel(), out_arg=2)

