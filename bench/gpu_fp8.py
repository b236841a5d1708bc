#!/usr/bin/env python3
"""FP8 runtime vs bf16 on one GPU: prefill throughput and latency of a Llama-shaped model.

Same process, same random weights: the bf16 model (transformers LlamaForCausalLM, SDPA
attention) is the baseline; the FP8 model is a copy whose decoder linears are replaced by
fp8export's ``Fp8Linear`` (E4M3 weights, static per-tensor input scales from a max pass over
two calibration batches, ``torch._scaled_mm``). lm_head and embeddings stay bf16 (DESIGN.md
exclusions). Prefill computes logits for the last position only (``logits_to_keep=1``), as a
server does. Also times bare GEMMs (bf16 matmul vs ``_scaled_mm``) at the model's shapes, so
the model-level number can be read against the kernel-level ceiling.

Usage (on an H100/H200):
    python bench/gpu_fp8.py --out bench/results/gpu_fp8.json            # ~1.1 B params
    python bench/gpu_fp8.py --compile                                  # + torch.compile rows
Random weights are fine for speed; accuracy is measured separately by `fp8export verify`.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3  # noqa: E402
from fp8export.runners.fp8_linear import Fp8Linear  # noqa: E402
from fp8export.runners.fp8_quant import quantize_input  # noqa: E402

DEFAULT_SHAPES = "1x128,1x512,1x2048,4x512,4x2048,8x2048,16x2048,32x512,64x256"


def build_bf16(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=4096, attn_implementation="sdpa", tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


@torch.no_grad()
def to_fp8(model: torch.nn.Module, calib: list[torch.Tensor]) -> tuple[torch.nn.Module, int]:
    """Copy of ``model`` with every decoder nn.Linear as Fp8Linear (static input scales)."""
    targets = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in n}
    amax: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, inp, n=n: amax.__setitem__(n, torch.maximum(
            amax.get(n, torch.zeros((), device="cuda")), inp[0].detach().abs().amax().float())))
        for n, m in targets.items()]
    for ids in calib:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    for h in hooks:
        h.remove()
    fp8 = copy.deepcopy(model)
    for name, lin in targets.items():
        w_scale = amax_to_scale(float(lin.weight.abs().amax()), name + ".weight")
        q = quantize_e4m3(lin.weight, w_scale)
        in_scale = amax_to_scale(float(amax[name]), name + ".input")
        new = Fp8Linear(q, w_scale, in_scale, lin.bias, mode="scaled_mm", out_dtype=torch.bfloat16)
        parent, _, child = name.rpartition(".")
        setattr(fp8.get_submodule(parent), child, new.cuda())
    return fp8, len(targets)


def time_cuda(fn, min_time: float = 0.5, warmup: int = 3) -> list[float]:
    """Per-call milliseconds via CUDA events, repeated until ~min_time seconds are covered."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    start_wall = time.perf_counter()
    while time.perf_counter() - start_wall < min_time or len(times) < 5:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def bench_models(models: dict, shapes, vocab: int) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for b, s in shapes:
        ids = torch.randint(0, vocab, (b, s), device="cuda", generator=g)
        row = {"batch": b, "seq": s, "tokens": b * s}
        for label, model in models.items():
            with torch.no_grad():
                t = time_cuda(lambda m=model: m(input_ids=ids, use_cache=False, logits_to_keep=1))
            ms = statistics.median(t)
            row[f"{label}_ms"] = round(ms, 4)
            row[f"{label}_tok_s"] = round(b * s / ms * 1e3, 1)
        base = next(iter(models))
        for label in list(models)[1:]:
            row[f"speedup_{label}"] = round(row[f"{base}_ms"] / row[f"{label}_ms"], 3)
        rows.append(row)
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def bench_gemms(args) -> list[dict]:
    """Bare GEMMs at the model's projection shapes: bf16 vs _scaled_mm (+ input quantize)."""
    h, i = args.hidden, args.intermediate
    kv = h // args.heads * args.kv_heads
    rows = []
    for m in (128, 2048, 8192, 16384):
        for name, k, n in (("qkv", h, h + 2 * kv), ("o", h, h), ("gate_up", h, 2 * i), ("down", i, h)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            sx = amax_to_scale(float(x.abs().amax()))
            sw = amax_to_scale(float(w.abs().amax()))
            xq, wq = quantize_e4m3(x, sx), quantize_e4m3(w, sw)
            tsx = torch.tensor(sx, device="cuda")
            tsw = torch.tensor(sw, device="cuda")
            bf = statistics.median(time_cuda(lambda: x @ w.t(), 0.2))
            f8 = statistics.median(time_cuda(
                lambda: torch._scaled_mm(xq, wq.t(), scale_a=tsx, scale_b=tsw, out_dtype=torch.bfloat16), 0.2))
            f8q = statistics.median(time_cuda(
                lambda: torch._scaled_mm(quantize_input(x, tsx), wq.t(), scale_a=tsx, scale_b=tsw,
                                         out_dtype=torch.bfloat16), 0.2))
            flops = 2 * m * k * n
            rows.append({"gemm": name, "M": m, "K": k, "N": n, "bf16_ms": round(bf, 4),
                         "fp8_ms": round(f8, 4), "fp8_with_quant_ms": round(f8q, 4),
                         "bf16_tflops": round(flops / bf / 1e9, 1), "fp8_tflops": round(flops / f8 / 1e9, 1),
                         "speedup": round(bf / f8, 3), "speedup_with_quant": round(bf / f8q, 3)})
            print("  " + "  ".join(f"{k_}={v}" for k_, v in rows[-1].items()), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxS list, comma separated")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd models")
    ap.add_argument("--compile-shapes", default="1x128,1x2048,8x2048,32x512,64x256")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_fp8.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        print(f"FP8 GEMMs need compute capability >= 8.9; this GPU is {cc}", file=sys.stderr)
        return 1
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    model = build_bf16(args)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e9:.3f} B params on {torch.cuda.get_device_name()}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    calib = [torch.randint(0, args.vocab, (4, 512), device="cuda", generator=g) for _ in range(2)]
    t0 = time.perf_counter()
    fp8, n_fp8 = to_fp8(model, calib)
    quant_s = time.perf_counter() - t0
    mem = {"bf16_weights_gib": round(sum(p.numel() * p.element_size() for p in model.parameters())
                                     / 2**30, 3),
           "fp8_weights_gib": round((sum(p.numel() * p.element_size() for p in fp8.parameters())
                                     + sum(b.numel() * b.element_size() for b in fp8.buffers()))
                                    / 2**30, 3)}
    print(f"fp8 copy: {n_fp8} linears in {quant_s:.1f}s; weights {mem}", flush=True)
    with torch.no_grad():
        ids = calib[0][:1, :256]
        a = model(input_ids=ids, use_cache=False).logits.float()
        b = fp8(input_ids=ids, use_cache=False).logits.float()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    print(f"random-weight logits cosine bf16 vs fp8: {cos:.5f}", flush=True)
    print("eager prefill:", flush=True)
    rows = bench_models({"bf16": model, "fp8": fp8}, shapes, args.vocab)
    compiled_rows, graph_rows = [], []
    if args.compile:
        cshapes = [tuple(int(v) for v in s.split("x")) for s in args.compile_shapes.split(",")]
        print("torch.compile prefill (default mode: Inductor fuses the quantize into its producer):",
              flush=True)
        cm = {"bf16c": torch.compile(model, dynamic=False), "fp8c": torch.compile(fp8, dynamic=False)}
        compiled_rows = bench_models(cm, cshapes, args.vocab)
        torch._dynamo.reset()
        print("torch.compile mode=reduce-overhead (CUDA graphs; removes launch overhead):", flush=True)
        gm = {"bf16g": torch.compile(model, mode="reduce-overhead", dynamic=False),
              "fp8g": torch.compile(fp8, mode="reduce-overhead", dynamic=False)}
        graph_rows = bench_models(gm, cshapes, args.vocab)
    print("bare GEMMs:", flush=True)
    gemms = bench_gemms(args)
    result = {
        "device": torch.cuda.get_device_name(), "compute_capability": f"{cc[0]}.{cc[1]}",
        "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "model": {"params": params, "hidden": args.hidden, "intermediate": args.intermediate,
                  "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "vocab": args.vocab, "fp8_linears": n_fp8},
        "memory": mem, "logits_cosine_random_weights": round(cos, 6),
        "prefill_eager": rows, "prefill_compiled": compiled_rows, "prefill_cudagraphs": graph_rows,
        "fused_quantize": __import__("fp8export.runners.fp8_quant", fromlist=["x"]).fused_enabled(), "gemms": gemms,
        "method": "median of CUDA-event timings over >=0.5 s per point after 3 warm-ups; "
                  "logits_to_keep=1; static per-tensor input scales; same process and weights",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
