"""FP8 attention and the FP8 KV-cache write on the GPU: two Triton kernels.

``fp8_attention`` computes ``attention_math``'s function (E4M3 queries per row, E4M3 keys and
values with per-KV-head static scales, fp32 online softmax, P in E4M3 or bf16, fp32
accumulation) in one launch: one program per block of ``BLOCK_M`` query rows of one KV head,
where the rows are the ``(query head of the group, token)`` pairs of that KV head, so a GQA
group reads each key and value block once (decode: the group's heads are the rows). Causal,
sliding-window and padded-key masks are computed in the kernel from the queries' positions in
the key buffer (``MaskInfo``), so no mask is materialized and blocks every row of the block
would mask are not visited. Keys and values arrive either as E4M3 (from ``Fp8StaticCache``:
keys ``[B, Hkv, T, D]``, values stored transposed ``[B, Hkv, D, T]`` so that both FP8 operands
are K-major for Hopper's tensor cores) or in 16 bits (no cache: prefill), which the kernel
quantizes with the layer's scales as it loads them, exactly as the cache would store them.

``kv_write`` quantizes new keys and values into the FP8 cache at its write position (a device
tensor, so the decode step can be captured in a CUDA graph) in one launch.

Both are hand-written (no library has E4M3 attention with these scales on this stack). Under
``torch.compile`` they are custom ops (opaque to Inductor, captured by CUDA graphs); in eager
the attention launches through ``fp8_quant.Launcher``. Elsewhere (CPU, a GPU below compute
capability 8.9, a mask the kernel does not describe) ``attention_math`` computes the same
function in torch. ``FP8EXPORT_ATTN_CONFIG=BLOCK_M,num_warps,num_stages`` forces the prefill
tiling (benchmarks).
"""

from __future__ import annotations

import contextlib
import os

import torch

from fp8export.numerics.fp8 import E4M3_DTYPE
from fp8export.runtime.attention_math import (
    KEY_BLOCK,
    LOG2E,
    P_SCALE,
    MaskInfo,
    fp8_attention_reference,
    quantize_heads,
)
from fp8export.runtime.fp8_gemm import sm_count
from fp8export.runtime.fp8_quant import Launcher

# The interpreter (TRITON_INTERPRET=1, CPU tests of the kernel logic) rounds fp32 -> E4M3
# casts wrongly for some values (triton 3.6); there the kernels round to the E4M3 grid first.
_EXACT_CAST = os.environ.get("TRITON_INTERPRET", "0") == "1"


_KERNELS: list = []  # [(attention kernel, KV write kernel) or None], filled on first use


def _kernels():
    """(attention kernel, KV write kernel), or None without Triton (a plain global, not
    functools.cache: torch.compile traces this module's calls)."""
    if not _KERNELS:
        try:
            from fp8export.runtime import _attention_kernels as k
        except ImportError:
            _KERNELS.append(None)
        else:
            _KERNELS.append((k.fp8_attention_kernel, k.kv_write_kernel))
    return _KERNELS[0]


_EMULATE = [False]


@contextlib.contextmanager
def emulated():
    """Inside the block the GPU runs ``attention_math`` too (the kernels' reference, tests)."""
    _EMULATE.append(True)
    try:
        yield
    finally:
        _EMULATE.pop()


def kernel_available(device: torch.device) -> bool:
    """Triton is installed and ``device`` is a GPU with FP8 tensor cores (CC >= 8.9)."""
    if device.type != "cuda" or _kernels() is None or _EMULATE[-1]:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index] >= (8, 9)


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _head_pad(d: int) -> int:
    return max(32, 1 << (d - 1).bit_length())  # FP8 dots need K >= 32


def kernel_supports(q: torch.Tensor, info: MaskInfo) -> str | None:
    """Why the kernel cannot run this call (it then runs in ``attention_math``), or None."""
    if info.dense is not None:
        return "a mask other than causal, sliding-window and key padding"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{q.dtype} queries (the kernel takes bf16 or fp16)"
    if q.shape[-1] > 256:
        return f"head dimension {q.shape[-1]} (the kernel takes up to 256)"
    if q.stride(-1) != 1:
        return "queries whose last dimension is not contiguous"
    return None


def prefill_config(rows: int, blocks: int = 1, sms: int = 0) -> dict[str, int]:
    """Tiles for ``rows`` query rows per KV head, ``blocks`` (batch x KV heads) of them, on a
    GPU of ``sms`` multiprocessors (``FP8EXPORT_ATTN_CONFIG`` overrides). 128-row tiles (the
    H200 sweep's best at 8x2048 and 32x512), halved while the grid would leave multiprocessors
    idle: a short prompt's 1x128 with 8 KV heads is 32 tiles of 128 rows for 132 SMs, and took
    17.6 us there against 10.8 us in 256 tiles of 16 rows (H200, 2026-11-29)."""
    if rows <= 16:
        return {"BLOCK_M": 16, "num_warps": 4, "num_stages": 2}
    forced = os.environ.get("FP8EXPORT_ATTN_CONFIG")
    if forced:
        bm, warps, stages = (int(v) for v in forced.split(","))
        return {"BLOCK_M": bm, "num_warps": warps, "num_stages": stages}
    block = 64 if rows <= 64 else 128
    while block > 16 and -(-rows // block) * blocks < sms:
        block //= 2
    return {"BLOCK_M": block, "num_warps": 4, "num_stages": 2}


_LAUNCHER: list[Launcher] = []


def _launcher() -> Launcher:
    if not _LAUNCHER:
        _LAUNCHER.append(Launcher(_kernels()[0], out_arg=5))
    return _LAUNCHER[0]


PREQUANTIZE_KEYS = 4096
"""From this many keys (batch x length) uncached 16-bit keys and values are quantized in one
pass before the attention (each key block is then read once as E4M3 by every query block);
below it the kernel quantizes them as it loads them (one launch less, for small eager calls)."""


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                  v_scale: torch.Tensor, *, sm_scale: float, info: MaskInfo,
                  p_fp8: bool = True) -> torch.Tensor:
    """Attention of ``q [B, Hq, Tq, D]`` over ``k``/``v`` (logically ``[B, Hkv, Tk, D]``, any
    strides): E4M3 from the FP8 cache, or 16-bit (quantized with ``k_scale``/``v_scale``,
    float32 ``[Hkv]``, as the cache stores them). Returns ``[B, Tq, Hq, D]`` in q's dtype."""
    if kernel_available(q.device) and kernel_supports(q, info) is None:
        compiling = torch.compiler.is_compiling()
        if k.dtype != E4M3_DTYPE and (compiling or k.shape[0] * k.shape[2] >= PREQUANTIZE_KEYS):
            k, v = quantize_kv(k, v, k_scale, v_scale)
        if compiling:
            return torch.ops.fp8export.fp8_attention(q, k, v, k_scale, v_scale, info.key_mask,
                                                     *_q_start(info.q_start), sm_scale,
                                                     info.causal, int(info.window), p_fp8)
        return launch_attention(q, k, v, k_scale, v_scale, info.key_mask,
                                *_q_start(info.q_start), sm_scale, info.causal,
                                int(info.window), p_fp8)
    k8 = k if k.dtype == E4M3_DTYPE else quantize_heads(k, k_scale)
    v8 = v if v.dtype == E4M3_DTYPE else quantize_heads(v, v_scale)
    return fp8_attention_reference(q, k8, v8, k_scale, v_scale, sm_scale=sm_scale, info=info,
                                   p_fp8=p_fp8)


def quantize_kv(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit keys and values as the FP8 cache stores them: E4M3 keys ``[B, H, T, D]`` and
    values as a ``[B, H, T, D]`` view of ``[B, H, D, T]`` storage."""
    if torch.compiler.is_compiling() or not k.is_cuda:  # Inductor fuses these into RoPE
        k8 = quantize_heads(k, k_scale)
        v8 = quantize_heads(v, v_scale).transpose(2, 3).contiguous().transpose(2, 3)
        return k8, v8
    b, h, t, d = k.shape
    k8 = torch.empty((b, h, t, d), dtype=E4M3_DTYPE, device=k.device)
    v8t = torch.empty((b, h, d, t), dtype=E4M3_DTYPE, device=k.device)
    launch_kv_write(k, v, k_scale, v_scale, k8, v8t, 0)
    return k8, v8t.transpose(2, 3)


def _q_start(q_start) -> tuple[torch.Tensor | None, int]:
    if isinstance(q_start, torch.Tensor):
        return q_start, 0
    return None, int(q_start)


def launch_attention(q, k, v, k_scale, v_scale, key_mask, q_start_t, q_start: int,
                     sm_scale: float, causal: bool, window: int, p_fp8: bool,
                     config: dict[str, int] | None = None) -> torch.Tensor:
    """One launch of the attention kernel (arguments as :func:`fp8_attention`'s, the mask
    unpacked)."""
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    group = hq // hkv
    out = torch.empty((b, tq, hq, d), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    sms = sm_count(q.device.index if q.device.index is not None else
                   torch.cuda.current_device()) if q.is_cuda else 0
    cfg = config or prefill_config(group * tq, b * hkv, sms)
    mask = key_mask.view(torch.uint8) if key_mask is not None else out
    grid = (-(-(group * tq) // cfg["BLOCK_M"]), b * hkv)
    args = (q, k, v, k_scale, v_scale, out, mask, q_start_t if q_start_t is not None else out,
            q_start, tq, tk, group, hkv, float(sm_scale) * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            k.stride(3), v.stride(0), v.stride(1), v.stride(2), v.stride(3), out.stride(0),
            out.stride(1), out.stride(2), mask.stride(0) if key_mask is not None else 0)
    constexprs = {"D": d, "D_PAD": _head_pad(d), "BLOCK_M": cfg["BLOCK_M"],
                  "BLOCK_N": KEY_BLOCK, "CAUSAL": bool(causal), "WINDOW": int(window),
                  "HAS_MASK": key_mask is not None, "QSTART_PTR": q_start_t is not None,
                  "KV_FP8": k.dtype == E4M3_DTYPE, "P_FP8": bool(p_fp8), "EXACT": _EXACT_CAST}
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if q.is_cuda:
        _launcher()(grid, args, constexprs, options)
    else:  # the interpreter (tests)
        _kernels()[0][grid](*args, **constexprs, **options)
    return out


def kv_write(key: torch.Tensor, value: torch.Tensor, k_scale: torch.Tensor,
             v_scale: torch.Tensor, k_cache: torch.Tensor, v_cache_t: torch.Tensor,
             start: torch.Tensor) -> None:
    """Quantize ``key``/``value`` ``[B, Hkv, Tn, D]`` into ``k_cache [B, Hkv, T, D]`` and
    ``v_cache_t [B, Hkv, D, T]`` (E4M3) at positions ``start + [0, Tn)`` (``start``: 0-d
    integer tensor on the cache's device). The kernel skips positions past the cache; the
    torch path (CPU, and under torch.compile, where Inductor fuses it and CUDA graphs see
    in-place updates of the cache's static buffers, as with transformers' own cache) raises."""
    if torch.compiler.is_compiling() or not (key.is_cuda and kernel_available(key.device)):
        pos = torch.arange(key.shape[2], device=key.device) + start
        # as bytes: index_copy_ has no float8 kernels
        k_cache.view(torch.uint8).index_copy_(2, pos, quantize_heads(key, k_scale).view(
            torch.uint8))
        v_cache_t.view(torch.uint8).index_copy_(3, pos, quantize_heads(value, v_scale).view(
            torch.uint8).transpose(2, 3))
        return
    launch_kv_write(key, value, k_scale, v_scale, k_cache, v_cache_t, start)


def launch_kv_write(key, value, k_scale, v_scale, k_cache, v_cache_t,
                    start: torch.Tensor | int) -> None:
    """One launch of the KV write kernel (``start``: a 0-d device tensor or an int)."""
    b, h, tn, d = key.shape
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    block_t = 16 if tn <= 16 else 64
    grid = (-(-tn // block_t), b * h)
    start_t = start if isinstance(start, torch.Tensor) else None
    _kernels()[1][grid](key, value, k_scale, v_scale, k_cache, v_cache_t,
                        k_cache if start_t is None else start_t,
                        0 if start_t is not None else int(start), tn,
                        k_cache.shape[2], h, key.stride(0), key.stride(1), key.stride(2),
                        value.stride(0), value.stride(1), value.stride(2), k_cache.stride(0),
                        k_cache.stride(1), k_cache.stride(2), v_cache_t.stride(0),
                        v_cache_t.stride(1), v_cache_t.stride(2), D=d, D_PAD=_head_pad(d),
                        BLOCK_T=block_t, START_PTR=start_t is not None, EXACT=_EXACT_CAST,
                        num_warps=4)


# The attention kernel as a torch custom op, for torch.compile: opaque to Inductor, captured by
# CUDA graphs. On a CPU the op is the emulation (what the kernel is tested against), so what a
# compiled GPU step traces can be traced and checked on a CPU too.
@torch.library.custom_op("fp8export::fp8_attention", mutates_args=(), device_types="cuda")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                  v_scale: torch.Tensor, key_mask: torch.Tensor | None,
                  q_start_t: torch.Tensor | None, q_start: int, sm_scale: float, causal: bool,
                  window: int, p_fp8: bool) -> torch.Tensor:
    return launch_attention(q, k, v, k_scale, v_scale, key_mask, q_start_t, q_start, sm_scale,
                            causal, window, p_fp8)


@_attention_op.register_kernel("cpu")
def _(q, k, v, k_scale, v_scale, key_mask, q_start_t, q_start, sm_scale, causal, window, p_fp8):
    k8 = k if k.dtype == E4M3_DTYPE else quantize_heads(k, k_scale)
    v8 = v if v.dtype == E4M3_DTYPE else quantize_heads(v, v_scale)
    info = MaskInfo(q_start_t if q_start_t is not None else q_start, causal, window, key_mask)
    return fp8_attention_reference(q, k8, v8, k_scale, v_scale, sm_scale=sm_scale, info=info,
                                   p_fp8=p_fp8)


@_attention_op.register_fake
def _(q, k, v, k_scale, v_scale, key_mask, q_start_t, q_start, sm_scale, causal, window, p_fp8):
    b, hq, tq, d = q.shape
    return q.new_empty((b, tq, hq, d))


__all__ = ["P_SCALE", "fp8_attention", "kv_write", "launch_attention", "kernel_available"]
