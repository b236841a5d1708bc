"""FP8 attention as plain torch arithmetic: what the Triton kernel computes, step for step.

The function (``fp8_attention.py`` runs it on the GPU; this module everywhere else, and on the
GPU where the mask is one the kernel does not take):

* queries quantized to E4M3 per row (one scale per token and head: ``amax / 448`` of that row,
  1 for an all-zero row), keys and values E4M3 with the layer's static ``k_scale``/``v_scale``
  (one per KV head; a per-tensor scale is the same value for every head), as the FP8 KV cache
  stores them;
* ``S = (Q8 · K8ᵀ) · (q_scale · k_scale · softmax_scale · log2 e)`` accumulated in fp32;
* the mask (causal from the queries' positions in the key sequence, a sliding window, padded
  keys), softmax in fp32 with base 2;
* ``P·V`` with V in E4M3: P in E4M3 (``P8 = e4m3(p · 2⁸)``, then divided by 2⁸: a power of two,
  so exact, that puts probabilities down to 2⁻¹⁴ in E4M3's normal range where FlashAttention-3
  casts them unscaled and flushes below 2⁻⁹) or P in bf16, accumulated in fp32, times
  ``v_scale``, divided by the row sum of the unrounded ``p``.

The kernel runs the softmax online, over blocks of :data:`KEY_BLOCK` keys: each block's ``p``
is taken against the running maximum of the scores so far, rounded to E4M3 (or bf16), and
rescaled when the maximum grows. Rounding ``p`` against a smaller maximum is not rounding the
final probability (the rescale factor is no power of two), so this emulation reproduces the
block schedule: the running maximum after each block (a cumulative max), each block's ``p``
against it, the rescale to the final maximum. What is left between the two is fp32 summation
order and the tensor cores' accumulation: the device test bounds it (``tests/runtime``).

GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``. Shapes: ``q [B, Hq, Tq, D]``,
``k``/``v`` ``[B, Hkv, Tk, D]``; the output is ``[B, Tq, Hq, D]`` (what transformers' attention
functions return).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fp8export.numerics.fp8 import E4M3_DTYPE, E4M3_MAX, dequantize, quantize_e4m3

KEY_BLOCK = 64
"""Keys per step of the kernel's online softmax (the emulation needs the same blocks)."""
P_SCALE = 256.0
"""``p`` is multiplied by this power of two before its E4M3 cast (see the module docstring)."""
LOG2E = 1.4426950408889634


class MaskInfo(NamedTuple):
    """Which keys each query may read, in the key buffer's own index ``j``.

    ``q_start``: the key index of the first query (an int, or a 0-d integer tensor on the
    device: a static cache's write position); query ``t`` sits at ``q_start + t``. ``causal``:
    keys ``j <= q_start + t`` only. ``window``: also ``q_start + t - j < window`` (0: none).
    ``key_mask``: ``[B, >= Tk]`` bool, False for padded keys (None: none). ``dense``: a 4-D
    bool mask ``[B, 1 or H, Tq, Tk]`` that replaces all of the above (masks this structure
    does not describe).
    """

    q_start: int | torch.Tensor = 0
    causal: bool = True
    window: int = 0
    key_mask: torch.Tensor | None = None
    dense: torch.Tensor | None = None


def quantize_rows(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3: ``(q8, scale)`` with ``scale = amax / 448`` over the last dimension (1 for
    an all-zero row), ``q8 = e4m3(clamp(q / scale, ±448))`` (``numerics.fp8.quantize_e4m3``);
    ``scale`` is ``[..., 1]`` fp32."""
    amax = q.to(torch.float32).abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return quantize_e4m3(q, scale), scale


def quantize_heads(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` to E4M3 with one float32 dequantization scale per head (``[H]``):
    ``numerics.fp8.quantize_e4m3`` with the scale broadcast over each head."""
    return quantize_e4m3(x, scale.to(torch.float32).view(1, -1, 1, 1))


def head_scales(scale, heads: int, device=None) -> torch.Tensor:
    """A per-tensor scale (a number, 0-d or 1-element tensor) or ``heads`` per-head scales
    (``[H]``, ``[H, 1, 1]``) as a float32 ``[heads]`` tensor."""
    t = torch.as_tensor(scale, dtype=torch.float32, device=device).detach().reshape(-1)
    if t.numel() == 1:
        return t.expand(heads).clone()
    if t.numel() != heads:
        raise ValueError(f"a KV scale has {t.numel()} values; expected 1 or one per KV head "
                         f"({heads})")
    return t.clone()


def allowed(info: MaskInfo, batch: int, tq: int, tk: int, device) -> torch.Tensor:
    """``[B or 1, 1, Tq, Tk]`` bool: which keys each query may read under ``info``."""
    if info.dense is not None:
        return info.dense.to(device=device, dtype=torch.bool)[..., :tq, :tk]
    j = torch.arange(tk, device=device)
    qpos = torch.arange(tq, device=device) + torch.as_tensor(info.q_start, device=device)
    ok = torch.ones(tq, tk, dtype=torch.bool, device=device)
    if info.causal:
        ok = ok & (j[None, :] <= qpos[:, None])
    if info.window:
        ok = ok & (qpos[:, None] - j[None, :] < info.window)
    ok = ok[None, None]
    if info.key_mask is not None:
        ok = ok & info.key_mask.to(device=device, dtype=torch.bool)[:, None, None, :tk]
    return ok.expand(batch if info.key_mask is not None else 1, 1, tq, tk)


def fp8_attention_reference(q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                            k_scale: torch.Tensor, v_scale: torch.Tensor, *, sm_scale: float,
                            info: MaskInfo, p_fp8: bool = True,
                            out_dtype: torch.dtype | None = None,
                            head_chunk: int = 8) -> torch.Tensor:
    """The FP8 attention on E4M3 ``k8``/``v8`` ``[B, Hkv, Tk, D]`` with their per-head scales
    (``[Hkv]`` fp32); ``q`` ``[B, Hq, Tq, D]`` in 16 bits. Returns ``[B, Tq, Hq, D]`` in
    ``out_dtype`` (q's by default). ``head_chunk`` query heads at a time bound the memory."""
    b, hq, tq, d = q.shape
    hkv, tk = k8.shape[1], k8.shape[2]
    group = hq // hkv
    dev = q.device
    out = torch.empty(b, tq, hq, d, dtype=out_dtype or q.dtype, device=dev)
    ok = allowed(info, b, tq, tk, dev)
    q8, sq = quantize_rows(q)
    kf = k8.to(torch.float32)
    vf = v8.to(torch.float32)
    ks = k_scale.to(device=dev, dtype=torch.float32)
    vs = v_scale.to(device=dev, dtype=torch.float32)
    c = ks * torch.tensor(sm_scale * LOG2E, dtype=torch.float32, device=dev)  # [Hkv]
    nblocks = -(-tk // KEY_BLOCK)
    pad = nblocks * KEY_BLOCK - tk
    for h0 in range(0, hq, head_chunk):
        heads = torch.arange(h0, min(hq, h0 + head_chunk), device=dev)
        kv = heads // group
        dot = q8[:, heads].to(torch.float32) @ kf[:, kv].transpose(-1, -2)  # [B, h, Tq, Tk]
        s = dot * (sq[:, heads] * c[kv].view(1, -1, 1, 1))
        s = s.masked_fill(~ok, -math.inf)
        # the kernel's running maximum: after each block of KEY_BLOCK keys
        sb = torch.nn.functional.pad(s, (0, pad), value=-math.inf)
        sb = sb.view(*s.shape[:-1], nblocks, KEY_BLOCK)
        run = sb.amax(dim=-1).cummax(dim=-1).values  # [B, h, Tq, nblocks]
        final = run[..., -1:]
        run_safe = torch.where(run == -math.inf, torch.zeros_like(run), run)
        final_safe = torch.where(final == -math.inf, torch.zeros_like(final), final)
        p = torch.exp2(sb - run_safe[..., None])  # each block against its running max
        rescale = torch.exp2(run_safe - final_safe)[..., None]  # to the final max
        row_sum = (p * rescale).sum(dim=(-1, -2))  # unrounded p, as the kernel sums it
        if p_fp8:
            pq = (p * P_SCALE).to(E4M3_DTYPE).to(torch.float32) / P_SCALE
        else:
            pq = p.to(torch.bfloat16).to(torch.float32)
        weights = (pq * rescale).view(*s.shape[:-1], nblocks * KEY_BLOCK)[..., :tk]
        o = (weights @ vf[:, kv]) * vs[kv].view(1, -1, 1, 1)
        o = o / row_sum[..., None]
        o = torch.where(row_sum[..., None] > 0, o, torch.zeros_like(o))  # no key to read
        out[:, :, h0:h0 + len(heads)] = o.transpose(1, 2).to(out.dtype)
    return out


def dequantized_attention_inputs(k8: torch.Tensor, v8: torch.Tensor, k_scale: torch.Tensor,
                                 v_scale: torch.Tensor, dtype: torch.dtype
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 keys and values back to ``dtype`` (what a server with an FP8 KV cache and 16-bit
    attention reads: vLLM's non-FP8 attention backends dequantize the cache so)."""
    ks = k_scale.to(device=k8.device).view(1, -1, 1, 1)
    vs = v_scale.to(device=v8.device).view(1, -1, 1, 1)
    return dequantize(k8, ks, dtype), dequantize(v8, vs, dtype)
