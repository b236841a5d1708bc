"""The FP8 attention kernel against flash SDPA and its CPU emulation, shape by shape
(``bench/gpu_fp8.py --parts attention``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import graph_ms, log_row  # noqa: E402  (beside)


def _attn_inputs(b, hq, hkv, tq, tk, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, tq, d, device="cuda", generator=g).bfloat16()
    # keys with a few large channels, as rotated keys have; values plain
    k = (torch.randn(b, hkv, tk, d, device="cuda", generator=g)
         * (1 + 4 * torch.rand(d, device="cuda", generator=g))).bfloat16()
    v = torch.randn(b, hkv, tk, d, device="cuda", generator=g).bfloat16()
    ks = torch.full((hkv,), float(k.float().abs().max()) / 448, device="cuda")
    vs = torch.full((hkv,), float(v.float().abs().max()) / 448, device="cuda")
    return q, k, v, ks, vs

def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return round(float((a - b).norm() / b.norm()), 6)

def bench_attention(args) -> dict:
    """The kernel alone at the model's shapes: device ms (CUDA graphs of 20 calls) against SDPA
    on bf16 with GQA, P in E4M3 vs bf16; accuracy against fp32 attention on the same 16-bit
    inputs and agreement with the CPU emulation; a tile sweep at each prefill shape (P as
    the model runs it; ``programs``: the launch's grid)."""
    import torch.nn.functional as F

    from fp8export.runtime.attention_math import (
        MaskInfo,
        fp8_attention_reference,
        quantize_heads,
    )
    from fp8export.runtime.fp8_attention import launch_attention, launch_kv_write

    hq, hkv, d = args.heads, args.kv_heads, args.hidden // args.heads
    sm = d ** -0.5
    rows, sweep = [], []
    prefill = [(1, 128), (8, 2048), (32, 512)]
    decode = [(1, 384), (8, 384), (32, 384), (32, 4096)]
    for kind, shapes in (("prefill", prefill), ("decode", decode)):
        for b, t in shapes:
            tq = t if kind == "prefill" else 1
            q, k, v, ks, vs = _attn_inputs(b, hq, hkv, tq, t, d, seed=b * t)
            q_start = t - tq
            start_t = torch.tensor(q_start, device="cuda")
            k8 = quantize_heads(k, ks)
            v8t = quantize_heads(v, vs).transpose(2, 3).contiguous()
            v8 = v8t.transpose(2, 3)
            row = {"kind": kind, "batch": b, "q_tokens": tq, "kv_tokens": t}
            causal = tq > 1
            mask = None
            if not causal:  # decode: SDPA over the whole cache (all positions valid)
                row["sdpa_ms"] = graph_ms(lambda: F.scaled_dot_product_attention(
                    q, k, v, enable_gqa=True))
            else:
                row["sdpa_ms"] = graph_ms(lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True))
            for p_fp8 in (True, False):
                tag = "p_e4m3" if p_fp8 else "p_bf16"
                if kind == "prefill":  # no cache: the kernel quantizes K and V as it loads
                    def run(p_fp8=p_fp8):
                        return launch_attention(q, k, v, ks, vs, None, None, 0, sm, True, 0,
                                                p_fp8)
                else:  # from the FP8 cache, position on the device
                    def run(p_fp8=p_fp8):
                        return launch_attention(q, k8, v8, ks, vs, None, start_t, 0, sm, True,
                                                0, p_fp8)
                out = run()
                row[f"{tag}_ms"] = graph_ms(run)
                row[f"speedup_{tag}"] = round(row["sdpa_ms"] / row[f"{tag}_ms"], 3)
                if b * tq * t <= 8 * 2048 * 2048 // 4:  # the fp32 references fit comfortably
                    info = MaskInfo(q_start, True, 0, mask, None)
                    # the emulation on the CPU, in fp32: what verify computes
                    emu = fp8_attention_reference(
                        q.cpu(), k8.cpu(), v8.cpu(), ks.cpu(), vs.cpu(), sm_scale=sm,
                        info=info, p_fp8=p_fp8, out_dtype=torch.float32)
                    exact = F.scaled_dot_product_attention(
                        q.float(), k.float(), v.float(), is_causal=causal,
                        enable_gqa=True).transpose(1, 2)
                    sdpa = F.scaled_dot_product_attention(
                        q, k, v, is_causal=causal, enable_gqa=True).transpose(1, 2)
                    row[f"{tag}_vs_emulation_rel_l2"] = _rel(out, emu)
                    row[f"{tag}_vs_fp32_rel_l2"] = _rel(out, exact)
                    row["sdpa_bf16_vs_fp32_rel_l2"] = _rel(sdpa, exact)
            if kind == "decode":
                kc = torch.empty(b, hkv, t, d, dtype=torch.float8_e4m3fn, device="cuda")
                vc = torch.empty(b, hkv, d, t, dtype=torch.float8_e4m3fn, device="cuda")
                kn, vn = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
                row["kv_write_ms"] = graph_ms(lambda: launch_kv_write(kn, vn, ks, vs, kc, vc,
                                                                      start_t))
            rows.append(row)
            log_row(row)
            if kind == "prefill":  # tiles, P as the model runs it
                tiles = ((16, 4, 2), (32, 4, 2), (64, 4, 2), (128, 4, 2)) if b * t < 16384 \
                    else ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3))
                for bm, warps, stages in tiles:
                    cfg = {"BLOCK_M": bm, "num_warps": warps, "num_stages": stages}
                    try:
                        ms = graph_ms(lambda cfg=cfg: launch_attention(
                            q, k, v, ks, vs, None, None, 0, sm, True, 0, not args.p_bf16,
                            config=cfg))
                    except Exception as exc:  # a tiling that does not compile or fit
                        ms = f"{type(exc).__name__}: {str(exc)[:120]}"
                    sweep.append({"batch": b, "seq": t, "p": "bf16" if args.p_bf16 else "e4m3",
                                  **cfg, "programs": -(-(hq // hkv * t) // bm) * b * hkv,
                                  "ms": ms})
                    log_row(sweep[-1])
    return {"rows": rows, "sweep": sweep}
