#!/usr/bin/env python3
"""FP8 runtime vs bf16 on one GPU: prefill, decode with a KV cache, and the bare GEMMs.

Same process, same random weights: the bf16 model (transformers LlamaForCausalLM, SDPA
attention) is the baseline; the FP8 model is a copy whose decoder linears are fp8export's
runtime layers, built the way ``load_fp8_model`` builds them from a converted folder: E4M3
weights, one weight scale and one static input scale per fused group (q/k/v, gate/up; the
max over the group, as ``convert`` writes them, input ranges from a max pass over two
calibration batches), then ``fuse_projections`` (one GEMM per group). lm_head and embeddings
stay bf16 (DESIGN.md exclusions). Prefill computes logits for the last position only
(``logits_to_keep=1``), as a server does.

Sections (``--parts``, comma separated):
  overhead  host microseconds per call of each eager building block (launch cost)
  gemm      bare GEMMs at the model's projection shapes: bf16 vs ``_scaled_mm`` (+ quantize)
            vs the small-M Triton kernel, M from 1 to 16384
  sweep     tile sweep of the small-M Triton kernel (to set its heuristic)
  prefill   eager at every shape; ``torch.compile(mode="reduce-overhead")`` (Inductor fusion
            + CUDA graphs) at ``--compile-shapes``
  decode    single-token steps with a StaticCache after a ``--prompt``-token prefill, batch
            ``--decode-batches``; eager and compiled + CUDA graphs

Usage (on an H100/H200):
    python bench/gpu_fp8.py --out bench/results/gpu_fp8.json
Random weights are fine for speed; accuracy is measured by `fp8export verify` and the tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fp8export.checkpoint.families import family_of, fused_group_of  # noqa: E402
from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3  # noqa: E402
from fp8export.runners import fp8_gemm, fp8_quant  # noqa: E402
from fp8export.runners.fp8_fused import fuse_projections  # noqa: E402
from fp8export.runners.fp8_linear import Fp8Linear  # noqa: E402

DEFAULT_SHAPES = "1x128,1x512,1x2048,4x512,4x2048,8x2048,16x2048,32x512,64x256"
RESULT: dict = {}


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
def to_fp8(model: torch.nn.Module, calib: list[torch.Tensor], fuse: bool = True):
    """Copy of ``model`` with every decoder nn.Linear as the runtime's FP8 layers."""
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
    family = family_of({"model_type": "llama"})
    groups: dict[str, list[str]] = {}
    for name in targets:
        g = fused_group_of(name, family)
        groups.setdefault(g[0] if g else name, []).append(name)
    fp8 = copy.deepcopy(model)
    for members in groups.values():  # a group shares the max of its members' scales
        w_amax = max(float(targets[n].weight.abs().amax()) for n in members)
        in_amax = max(float(amax[n]) for n in members)
        w_scale = amax_to_scale(w_amax)
        in_scale = amax_to_scale(in_amax)
        for name in members:
            lin = targets[name]
            new = Fp8Linear(quantize_e4m3(lin.weight, w_scale), w_scale, in_scale, lin.bias,
                            mode="scaled_mm", out_dtype=torch.bfloat16)
            parent, _, child = name.rpartition(".")
            setattr(fp8.get_submodule(parent), child, new.cuda())
    fused = {g: m for g, m in groups.items() if len(m) > 1} if fuse else {}
    skipped = fuse_projections(fp8, fused)
    assert not skipped, skipped
    return fp8.eval(), len(targets), len(fused)


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


def median_ms(fn, min_time: float = 0.5) -> float:
    return round(statistics.median(time_cuda(fn, min_time)), 4)


def graph_ms(fn, reps: int = 20, min_time: float = 0.2) -> float:
    """Device time per call of ``fn``: ``reps`` calls captured in one CUDA graph, replayed.

    Single kernels of a few microseconds cannot be timed with events around a Python call:
    the host's launch cost (20-50 us on the benchmark host) lands inside the interval.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return round(statistics.median(time_cuda(graph.replay, min_time)) / reps, 5)


def log_row(row: dict) -> None:
    print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def save(args) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(RESULT, indent=2) + "\n")


# ------------------------------------------------------------------------------- sections
def bench_overhead(args) -> list[dict]:
    """Host cost per call (us): many calls on tiny tensors, one sync at the end."""
    k = args.hidden
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor(0.01, device="cuda")
    wq = quantize_e4m3(w, 0.001)
    lin = torch.nn.Linear(k, k, bias=False, device="cuda", dtype=torch.bfloat16)
    f8 = Fp8Linear(wq, 0.001, 0.01, None, mode="scaled_mm").cuda()
    xq = fp8_quant.quantize_input(x, s)
    launcher = fp8_quant._launcher()

    def quant_jit():
        out = torch.empty(x.shape, device="cuda", dtype=torch.float8_e4m3fn)
        fp8_quant._kernel()[(1,)](x, s, out, x.numel(), BLOCK=fp8_quant._BLOCK)

    def f8_scaled_mm_path():  # the _scaled_mm path at M=1 (prefill-style), not small-M
        a = fp8_quant.quantize_input(x, s)
        return torch._scaled_mm(a, wq.t(), scale_a=s, scale_b=f8.weight_scale,
                                out_dtype=torch.bfloat16)

    cases = {
        "torch.empty": lambda: torch.empty(x.shape, device="cuda", dtype=torch.bfloat16),
        "nn.Linear bf16": lambda: lin(x),
        "quantize (Triton JIT launch)": quant_jit,
        "quantize_input (runtime launch)": lambda: fp8_quant.quantize_input(x, s),
        "quantize (eager torch ops)": lambda: fp8_quant.quantize_eager(x, s),
        "_scaled_mm alone": lambda: torch._scaled_mm(xq, wq.t(), scale_a=s, scale_b=s,
                                                     out_dtype=torch.bfloat16),
        "quantize + _scaled_mm": f8_scaled_mm_path,
        "small-M Triton GEMM": lambda: fp8_gemm.small_m_matmul(
            x, wq, s, f8.weight_scale, None, torch.bfloat16),
        "Fp8Linear forward (M=1)": lambda: f8(x),
    }
    rows = []
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        rows.append({"op": name, "host_us_per_call": round(host, 2)})
        log_row(rows[-1])
    rows.append({"op": "direct launch in use", "host_us_per_call": bool(launcher.direct),
                 "error": launcher.error})
    log_row(rows[-1])
    return rows


def bench_profile(models: dict, args) -> dict:
    """Where eager host time goes at 1x128: cProfile's top functions, and launches per forward."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, args.vocab, (1, 128), device="cuda")
    report = {}
    for label, model in models.items():
        with torch.no_grad():
            for _ in range(3):
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            host_ms = (time.perf_counter() - t0) / 10 * 1e3
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            prof.disable()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as tp:
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
        kernels = sum(e.count for e in tp.key_averages() if e.device_type.name == "CUDA")
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
        report[label] = {"host_ms_per_forward": round(host_ms, 3), "cuda_kernels": kernels}
        print(f"-- {label}: host {host_ms:.2f} ms/forward, {kernels} kernels/forward", flush=True)
        print("\n".join(text.getvalue().splitlines()[6:34]), flush=True)
    return report


def gemm_shapes(args):
    h, i = args.hidden, args.intermediate
    kv = h // args.heads * args.kv_heads
    return (("qkv", h, h + 2 * kv), ("o", h, h), ("gate_up", h, 2 * i), ("down", i, h))


def bench_gemms(args) -> list[dict]:
    """bf16 matmul vs quantize+_scaled_mm vs the small-M kernel, per shape and M."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    for m in (1, 8, 16, 32, 64, 128, 256, 512, 2048, 8192, 16384):
        for name, k, n in gemm_shapes(args):
            # several weight copies so that small-M timings read HBM, not the 50 MB L2
            copies = max(1, min(8, int(4 * 2**27 // (n * k * 2))))
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(copies)]
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                  for _ in range(copies)]
            sx = torch.tensor(float(amax_to_scale(float(xs[0].abs().amax()))), device="cuda")
            sw = torch.tensor(float(amax_to_scale(float(ws[0].abs().amax()))), device="cuda")
            wqs = [quantize_e4m3(w, sw) for w in ws]
            it = iter(range(10**9))

            def pick(lst):
                return lst[next(it) % copies]

            bf = graph_ms(lambda: pick(xs) @ pick(ws).t())
            f8 = graph_ms(lambda: torch._scaled_mm(
                fp8_quant.quantize_input(pick(xs), sx), pick(wqs).t(), scale_a=sx, scale_b=sw,
                out_dtype=torch.bfloat16))
            row = {"gemm": name, "M": m, "K": k, "N": n, "bf16_ms": bf,
                   "scaled_mm_with_quant_ms": f8, "speedup_scaled_mm": round(bf / f8, 3)}
            if m <= 2048:  # the eager one-launch kernel, timed in a graph for device time
                tri = graph_ms(lambda: fp8_gemm.small_m_matmul(
                    pick(xs), pick(wqs), sx, sw, None, torch.bfloat16))
                row.update(triton_small_m_ms=tri, speedup_triton=round(bf / tri, 3))
                # weight bytes over time: how close each gets to HBM bandwidth
                row["triton_weight_gb_s"] = round(n * k / tri / 1e6, 1)
                row["bf16_weight_gb_s"] = round(2 * n * k / bf / 1e6, 1)
                ref = (fp8_quant.quantize_eager(xs[0], sx).float() * sx) @ \
                    (wqs[0].float() * sw).t()
                got = fp8_gemm.small_m_matmul(xs[0], wqs[0], sx, sw, None, torch.float32)
                row["triton_rel_err"] = float((got - ref).norm() / ref.norm())
            flops = 2 * m * k * n
            row["bf16_tflops"] = round(flops / bf / 1e9, 1)
            rows.append(row)
            log_row(row)
    return rows


def bench_sweep(args) -> list[dict]:
    """Tile sweep of the small-M kernel at decode sizes; the heuristic's pick is marked."""
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 32, 64, 128, 256):
        for name, k, n in gemm_shapes(args):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ws = [quantize_e4m3(torch.randn(n, k, device="cuda") * 0.02, 0.001)
                  for _ in range(max(1, min(8, int(4 * 2**27 // (n * k)))))]
            sx = torch.tensor(0.01, device="cuda")
            sw = torch.tensor(0.001, device="cuda")
            pick = fp8_gemm.small_m_config(m, n, k, sms)
            best = None
            for bn in (16, 32, 64, 128):
                for bk in (128, 256):
                    for stages, warps in ((4, 4), (6, 4), (4, 8)):
                        cfg = {"BLOCK_M": pick["BLOCK_M"], "BLOCK_N": bn, "BLOCK_K": bk,
                               "num_warps": warps, "num_stages": stages}
                        i = [0]

                        def run(cfg=cfg, i=i):
                            i[0] += 1
                            return fp8_gemm.small_m_matmul(x, ws[i[0] % len(ws)], sx, sw, None,
                                                           torch.bfloat16, cfg)
                        try:
                            ms = graph_ms(run, 10, 0.05)
                        except Exception as exc:  # out of shared memory etc.
                            ms = None
                            err = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
                        row = {"gemm": name, "M": m, **cfg, "ms": ms,
                               "gb_s": round(n * k / ms / 1e6, 1) if ms else err,
                               "heuristic": cfg == pick}
                        rows.append(row)
                        if ms and (best is None or ms < best["ms"]):
                            best = row
            heur = next((r for r in rows if r["heuristic"] and r["gemm"] == name
                         and r["M"] == m), None)
            print(f"  sweep {name} M={m}: best {best} | heuristic {heur}", flush=True)
    return rows


class WithEagerM(torch.nn.Module):
    """Runs ``model`` with the runtime's eager one-launch threshold set to ``rows``."""

    def __init__(self, model, rows: int):
        super().__init__()
        self.model, self.rows = model, rows

    def forward(self, **kwargs):
        saved, fp8_gemm.EAGER_M = fp8_gemm.EAGER_M, self.rows
        try:
            return self.model(**kwargs)
        finally:
            fp8_gemm.EAGER_M = saved


def decode_gemm_ms(args, m: int) -> dict:
    """Device time of one decode step's decoder GEMMs as each model runs them (graph-timed):
    bf16 q, k, v, o, gate, up, down separately; FP8 quantize + fused qkv, o, gate_up, down."""
    h, i = args.hidden, args.intermediate
    kv = h // args.heads * args.kv_heads
    x = {k_: torch.randn(m, k_, device="cuda", dtype=torch.bfloat16) for k_ in (h, i)}
    s = torch.tensor(0.01, device="cuda")
    bf16 = fp8 = 0.0
    for k_, n in ((h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)):
        w = torch.randn(n, k_, device="cuda", dtype=torch.bfloat16)
        bf16 += graph_ms(lambda: x[k_] @ w.t(), 10, 0.1)
    for k_, n in ((h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)):
        wq = quantize_e4m3(torch.randn(n, k_, device="cuda") * 0.02, 0.001)
        fp8 += graph_ms(lambda: torch._scaled_mm(fp8_quant.quantize_input(x[k_], s), wq.t(),
                                                 scale_a=s, scale_b=s, out_dtype=torch.bfloat16),
                        10, 0.1)
    return {"bf16_gemm_ms": round(bf16 * args.layers, 4),
            "fp8_gemm_ms": round(fp8 * args.layers, 4)}


def bench_prefill(models: dict, shapes, vocab: int, min_time: float = 0.5) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for b, s in shapes:
        ids = torch.randint(0, vocab, (b, s), device="cuda", generator=g)
        row = {"batch": b, "seq": s, "tokens": b * s}
        for label, model in models.items():
            with torch.no_grad():
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
                row[f"{label}_first_call_s"] = round(time.perf_counter() - t0, 2)
                t = time_cuda(lambda m=model: m(input_ids=ids, use_cache=False,
                                                logits_to_keep=1), min_time)
            row[f"{label}_ms"] = round(statistics.median(t), 4)
        base = next(iter(models))
        for label in list(models)[1:]:
            row[f"speedup_{label}"] = round(row[f"{base}_ms"] / row[f"{label}_ms"], 3)
        rows.append(row)
        log_row(row)
    return rows


@torch.no_grad()
def bench_decode(model, label: str, batch: int, args, compiled: bool) -> dict:
    """Median ms of one greedy decode step (batch ``batch``) after a ``--prompt`` prefill."""
    from transformers import StaticCache

    steps, warm = args.decode_steps, 4
    cache = StaticCache(config=model.config, max_cache_len=args.prompt + warm + steps + 1)
    g = torch.Generator(device="cuda").manual_seed(4)
    ids = torch.randint(0, args.vocab, (batch, args.prompt), device="cuda", generator=g)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                cache_position=torch.arange(args.prompt, device="cuda"))
    tok = out.logits[:, -1:].argmax(-1)
    fwd = torch.compile(model, mode="reduce-overhead", dynamic=False) if compiled else model
    times, first_s = [], None
    for i in range(warm + steps):
        pos = torch.tensor([args.prompt + i], device="cuda")
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        out = fwd(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1,
                  cache_position=pos, position_ids=pos.expand(batch, 1))
        tok = out.logits[:, -1:].argmax(-1)
        b.record()
        b.synchronize()
        if i == 0:
            first_s = round(time.perf_counter() - t0, 2)
        if i >= warm:
            times.append(a.elapsed_time(b))
    return {f"{label}_ms": round(statistics.median(times), 4), f"{label}_first_call_s": first_s}


def section(name: str, fn, args):
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        RESULT[name] = fn()
    except Exception:  # keep what the other sections measured
        RESULT.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
        print(RESULT["errors"][name], flush=True)
    RESULT.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
    save(args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--parts", default="overhead,gemm,prefill,decode")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxS list, comma separated")
    ap.add_argument("--compile-shapes", default="1x128,8x2048,32x512")
    ap.add_argument("--decode-batches", default="1,8,32,128")
    ap.add_argument("--decode-compiled", default="1,8,32,128",
                    help="batches also timed compiled + CUDA graphs ('' for none)")
    ap.add_argument("--prompt", type=int, default=256, help="prefill tokens before decoding")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--unfused", action="store_true", help="also time FP8 without fused groups")
    ap.add_argument("--eager-m-alt", type=int, default=0,
                    help="also time eager FP8 with this one-launch row threshold")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_fp8.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        print(f"FP8 GEMMs need compute capability >= 8.9; this GPU is {cc}", file=sys.stderr)
        return 1
    parts = set(args.parts.split(","))
    RESULT.update({
        "device": torch.cuda.get_device_name(), "compute_capability": f"{cc[0]}.{cc[1]}",
        "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "eager_m": fp8_gemm.EAGER_M,
        "method": "median of CUDA-event timings over >=0.5 s per point after 3 warm-ups "
                  "(decode: median of --decode-steps steps after 4 warm-up steps); "
                  "logits_to_keep=1; static per-tensor input scales; same process and weights",
    })
    if "overhead" in parts:
        section("overhead", lambda: bench_overhead(args), args)
    if "gemm" in parts:
        section("gemms", lambda: bench_gemms(args), args)
    if "sweep" in parts:
        section("sweep", lambda: bench_sweep(args), args)
    if not parts & {"prefill", "decode", "profile"}:
        return 0
    model = build_bf16(args)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device="cuda").manual_seed(2)
    calib = [torch.randint(0, args.vocab, (4, 512), device="cuda", generator=g) for _ in range(2)]
    t0 = time.perf_counter()
    fp8, n_fp8, n_groups = to_fp8(model, calib)
    models = {"bf16": model, "fp8": fp8}
    if args.unfused:
        models["fp8_unfused"] = to_fp8(model, calib, fuse=False)[0]
    if args.eager_m_alt:
        models[f"fp8_eagerM{args.eager_m_alt}"] = WithEagerM(fp8, args.eager_m_alt)
    RESULT["model"] = {"params": params, "hidden": args.hidden, "intermediate": args.intermediate,
                       "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                       "vocab": args.vocab, "fp8_linears": n_fp8, "fused_groups": n_groups,
                       "build_s": round(time.perf_counter() - t0, 1)}
    RESULT["memory"] = {
        "bf16_weights_gib": round(sum(p.numel() * p.element_size() for p in model.parameters())
                                  / 2**30, 3),
        "fp8_weights_gib": round((sum(p.numel() * p.element_size() for p in fp8.parameters())
                                  + sum(b.numel() * b.element_size() for b in fp8.buffers()))
                                 / 2**30, 3)}
    print(f"model: {params / 1e9:.3f} B params on {torch.cuda.get_device_name()}; "
          f"{RESULT['model']}; {RESULT['memory']}", flush=True)
    with torch.no_grad():
        ids = calib[0][:1, :256]
        ref = model(input_ids=ids, use_cache=False).logits.float()
        outs = {k: m(input_ids=ids, use_cache=False).logits.float() for k, m in models.items()}
        emu = {n: m for n, m in fp8.named_modules() if isinstance(m, Fp8Linear)}
        for m in emu.values():
            m.mode = "emulate"
            m._refresh()
        outs["fp8_emulated"] = fp8(input_ids=ids, use_cache=False).logits.float()
        for m in emu.values():
            m.mode = "scaled_mm"
            m._refresh()
    RESULT["logits_cosine_fp8_vs_emulated"] = round(torch.nn.functional.cosine_similarity(
        outs["fp8"].flatten(), outs["fp8_emulated"].flatten(), dim=0).item(), 6)
    RESULT["logits_cosine_random_weights"] = {
        k: round(torch.nn.functional.cosine_similarity(ref.flatten(), v.flatten(), dim=0).item(),
                 6) for k, v in outs.items() if k != "bf16"}
    print(f"logits cosine vs bf16: {RESULT['logits_cosine_random_weights']}", flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cshapes = [tuple(int(v) for v in s.split("x")) for s in args.compile_shapes.split(",") if s]
    if "profile" in parts:
        section("profile", lambda: bench_profile(models, args), args)
    if "prefill" in parts:
        section("prefill_eager", lambda: bench_prefill(models, shapes, args.vocab), args)
        models = {"bf16": model, "fp8": fp8}
        if cshapes:
            def graphs():
                torch._dynamo.reset()
                gm = {"bf16g": torch.compile(model, mode="reduce-overhead", dynamic=False),
                      "fp8g": torch.compile(fp8, mode="reduce-overhead", dynamic=False)}
                return bench_prefill(gm, cshapes, args.vocab)
            section("prefill_cudagraphs", graphs, args)
    if "decode" in parts:
        def decode():
            rows = []
            cb = {int(b) for b in args.decode_compiled.split(",") if b}
            for batch in (int(b) for b in args.decode_batches.split(",")):
                row = {"batch": batch, "prompt": args.prompt, **decode_gemm_ms(args, batch)}
                for label, m in (("bf16", model), ("fp8", fp8)):
                    row.update(bench_decode(m, f"{label}_eager", batch, args, False))
                row["speedup_eager"] = round(row["bf16_eager_ms"] / row["fp8_eager_ms"], 3)
                if batch in cb:
                    torch._dynamo.reset()
                    for label, m in (("bf16", model), ("fp8", fp8)):
                        row.update(bench_decode(m, f"{label}_graphs", batch, args, True))
                    row["speedup_graphs"] = round(row["bf16_graphs_ms"] / row["fp8_graphs_ms"],
                                                  3)
                    row["graph_skips"] = int(sum(
                        torch._dynamo.utils.counters["inductor"].get(k, 0)
                        for k in ("cudagraph_skips",)))
                rows.append(row)
                log_row(row)
                RESULT["decode"] = rows
                save(args)
            return rows
        section("decode", decode, args)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
