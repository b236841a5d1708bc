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

The FP8 model also runs FP8 attention (``fp8export.runtime.attention``, mode ``--attention``:
the Triton kernel, P in E4M3 unless ``--p-bf16``) with k/v scales calibrated per layer on the
same batches (max |K| and |V| / 448, keys after RoPE), and decodes with the FP8 KV cache
(``Fp8StaticCache``: E4M3, half the bytes of transformers' bf16 ``StaticCache``).

Sections (``--parts``, comma separated):
  attention the attention kernel alone: time against cuDNN/flash SDPA (bf16, GQA) at the
            model's prefill and decode shapes, P in E4M3 vs bf16, its accuracy against fp32
            attention and its agreement with the CPU emulation (rel-L2), a tile sweep
  memory    KV-cache bytes (bf16 StaticCache vs the FP8 cache) and the largest decode batch
            whose weights + cache + step peak fit ``--budget-gib`` at ``--budget-context``
  overhead  host microseconds per call of each eager building block (launch cost)
  gemm      bare GEMMs at the model's projection shapes: bf16 vs ``_scaled_mm`` (+ quantize)
            vs the small-M Triton kernel, M from 1 to 16384
  sweep     tile sweep of the small-M Triton kernel (to set its heuristic)
  eager     eager prefill at ``--shapes``
  compiled  ``torch.compile(mode="reduce-overhead")`` (Inductor fusion + CUDA graphs) prefill at
            ``--compile-shapes``, with the padding mask a server passes (an all-ones
            ``attention_mask``: without one, transformers' compiled mask is the packed-sequence
            mask, which it cannot rule out while tracing; the FP8 kernel does not take it and
            the step would trace the torch emulation instead)
  prefill   eager and compiled
  decode    single-token steps with a StaticCache after a ``--prompt``-token prefill: eager at
            ``--decode-eager`` batches, compiled + CUDA graphs at ``--decode-compiled``

Compile work is bounded: shapes are static (``dynamic=False``: one graph per shape, recompiles
logged with their reason), a recompile-limit hit is an error instead of a silent fall-back to
eager, and ``--warm-only`` compiles and runs each compiled configuration once without timing
(to fill Inductor's on-disk caches from another process while something else runs). Rows are
saved as they are measured, so a section stopped by a time limit keeps what it finished.

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
from gpu_attention_kernel import bench_attention  # noqa: E402  (beside)
from gpu_fp8_report import TARGETS, merge_results, write_report  # noqa: E402  (beside)
from gpu_timing import (  # noqa: E402  (beside)
    bound_compile_work,
    dynamo_stats,
    graph_ms,
    host_and_wall_ms,
    host_profile,
    log_row,
    profile_calls,
    reset_dynamo,
    time_cuda,
)

from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3  # noqa: E402
from fp8export.runtime import attention, fp8_gemm, fp8_quant  # noqa: E402
from fp8export.runtime.fp8_attention import emulated  # noqa: E402
from fp8export.runtime.fp8_fused import fuse_projections  # noqa: E402
from fp8export.runtime.fp8_linear import Fp8Linear  # noqa: E402
from fp8export.runtime.kv_cache import kv_hook  # noqa: E402
from fp8export.scales.families import family_of, fused_group_of  # noqa: E402

DEFAULT_SHAPES = "1x128,1x512,8x2048,32x512"
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
def to_fp8(model: torch.nn.Module, calib: list[torch.Tensor], fuse: bool = True,
           attention_mode: str = "fp8", p_fp8: bool = True):
    """Copy of ``model`` with every decoder nn.Linear as the runtime's FP8 layers, and its
    attention in ``attention_mode`` ("fp8", "kv": FP8 KV cache only, "off")."""
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
    if attention_mode != "off":
        attention.install(fp8, kv_scales(model, calib), mode=attention_mode, p_fp8=p_fp8)
    return fp8.eval(), len(targets), len(fused)


@torch.no_grad()
def kv_scales(model, calib: list[torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per attention layer (k_scale, v_scale) = max |K| / 448 and max |V| / 448 over ``calib``,
    keys after RoPE, as ``convert --kv-cache fp8`` calibrates them."""
    amax: dict[str, list[float]] = {}

    def observe(name, key, value):
        a = amax.setdefault(name, [0.0, 0.0])
        a[0] = max(a[0], float(key.abs().max()))
        a[1] = max(a[1], float(value.abs().max()))
        return key, value

    with kv_hook(model, observe):
        for ids in calib:
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return {n: (float(amax_to_scale(k)), float(amax_to_scale(v))) for n, (k, v) in amax.items()}


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

    # one layer's q/k/v at 512 rows: where eager prefill of 512-2048 tokens spends host time
    m, kv = 512, k // args.heads * args.kv_heads
    xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    lins = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            for n in (k, kv, kv)]
    group = torch.nn.Module()
    group.q, group.k, group.v = (Fp8Linear(quantize_e4m3(lin.weight, 0.001), 0.001, 0.01,
                                           mode="scaled_mm").cuda() for lin in lins)
    fuse_projections(group, {"qkv": ["q", "k", "v"]})
    w_qkv, w_cat = group.fused_qkv.weight, torch.cat([lin.weight for lin in lins])
    xq_m = fp8_quant.quantize_input(xm, s)

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
        "F.linear bf16, 512x2048 @ 2048x3072": lambda: torch.nn.functional.linear(xm, w_cat),
        "quantize_input, 512x2048": lambda: fp8_quant.quantize_input(xm, s),
        "_scaled_mm alone, 512x2048 @ 2048x3072": lambda: torch._scaled_mm(
            xq_m, w_qkv.t(), scale_a=s, scale_b=s, out_dtype=torch.bfloat16),
        "q, k, v: 3 nn.Linear bf16 (512 rows)": lambda: [lin(xm) for lin in lins],
        "q, k, v: FP8 fused group, 3 slice calls (512 rows)": lambda: (
            group.q(xm), group.k(xm), group.v(xm)),
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


def bench_memory(model, fp8, args) -> dict:
    """KV-cache bytes per sequence (bf16 StaticCache vs FP8 cache, allocated and measured) and
    the largest decode batch whose weights + cache + step peak fit ``--budget-gib`` with a
    ``--budget-context``-token cache: found by bisection, each candidate batch run for one
    decode step and its peak allocation read back."""
    ctx, budget = args.budget_context, int(args.budget_gib * 2**30)
    out = {"context": ctx, "budget_gib": args.budget_gib}
    for label, m in (("bf16", model), ("fp8", fp8)):
        weights = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])

        def step_peak(batch: int, m=m) -> tuple[int, int]:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            cache = make_cache(m, ctx)
            ids = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
            with torch.no_grad():
                m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base  # the cache, after the step
            peak = torch.cuda.max_memory_allocated() - base
            del cache
            return held, peak

        held1, _ = step_peak(1)
        held2, _ = step_peak(2)
        per_seq = held2 - held1
        lo, hi = 0, max(1, (budget - weights) // max(per_seq, 1) + 1)
        peaks = {}
        while lo < hi:  # the largest batch whose weights + peak fit the budget
            mid = (lo + hi + 1) // 2
            _, peak = step_peak(mid)
            peaks[mid] = peak
            if weights + peak <= budget:
                lo = mid
            else:
                hi = mid - 1
        out[label] = {"weights_gib": round(weights / 2**30, 3),
                      "kv_cache_bytes_per_sequence": per_seq,
                      "kv_cache_mib_per_sequence": round(per_seq / 2**20, 2),
                      "max_decode_batch": lo,
                      "peak_gib_at_max": round((weights + peaks.get(lo, 0)) / 2**30, 3)}
        log_row({"model": label, **out[label]})
    out["kv_cache_ratio_fp8_over_bf16"] = round(out["fp8"]["kv_cache_bytes_per_sequence"]
                                                / out["bf16"]["kv_cache_bytes_per_sequence"], 4)
    out["max_batch_ratio"] = round(out["fp8"]["max_decode_batch"]
                                   / max(1, out["bf16"]["max_decode_batch"]), 3)
    return out


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


def bench_prefill(models: dict, shapes, vocab: int, min_time: float = 0.5, rounds: int = 5,
                  profile: bool = True, rows: list | None = None, mask: bool = False,
                  warm_only: bool = False, on_row=None, host_reps: int = 0) -> list[dict]:
    """Median ms per forward of each model at each shape. The models take turns in ``rounds``
    rounds (``min_time / rounds`` seconds each), so that drift of the host or the clocks hits all
    of them alike; ``<label>_spread`` is the range of the per-round medians over their median.
    ``profile``: also the device time per forward and its kernel table (torch.profiler).
    ``mask``: pass an all-ones ``attention_mask``; ``rows``: append to it (``on_row`` after each
    row); ``warm_only``: the first call of each model only (compilation), no timing;
    ``host_reps``: also where the host's time per forward goes (``<label>_host_profile``, that
    many forwards under cProfile)."""
    rows = [] if rows is None else rows
    g = torch.Generator(device="cuda").manual_seed(1)
    for b, s in shapes:
        ids = torch.randint(0, vocab, (b, s), device="cuda", generator=g)
        kwargs = {"attention_mask": torch.ones_like(ids)} if mask else {}
        row = {"batch": b, "seq": s, "tokens": b * s}
        calls = {}
        for label, model in models.items():
            def call(m=model):
                with torch.no_grad():
                    m(input_ids=ids, use_cache=False, logits_to_keep=1, **kwargs)
            calls[label] = call
            before = dynamo_stats()
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            row[f"{label}_first_call_s"] = round(time.perf_counter() - t0, 2)
            if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
                row[f"{label}_dynamo"] = {k: v - before.get(k, 0)
                                          for k, v in dynamo_stats().items()}
        if warm_only:
            rows.append(row)
            log_row(row)
            if on_row:
                on_row()
            continue
        times: dict[str, list[float]] = {label: [] for label in models}
        medians: dict[str, list[float]] = {label: [] for label in models}
        for _ in range(rounds):
            for label, call in calls.items():
                t = time_cuda(call, min_time / rounds, warmup=2)
                times[label] += t
                medians[label].append(statistics.median(t))
        for label in models:
            mid = statistics.median(times[label])
            row[f"{label}_ms"] = round(mid, 4)
            row[f"{label}_spread"] = round((max(medians[label]) - min(medians[label])) / mid, 3)
            if profile:
                prof = profile_calls(calls[label], 3, top=8)
                row[f"{label}_device_ms"] = round(prof["device_us"] / 1e3, 4)
                row[f"{label}_profile"] = prof
            if host_reps:
                row[f"{label}_host_profile"] = host_profile(calls[label], host_reps)
        base = next(iter(models))
        for label in list(models)[1:]:
            row[f"speedup_{label}"] = round(row[f"{base}_ms"] / row[f"{label}_ms"], 3)
        rows.append(row)
        log_row(row)
        if on_row:
            on_row()
    return rows


def make_cache(model, max_cache_len: int):
    """The FP8 KV cache for a model running FP8 attention, else transformers' bf16 one."""
    from transformers import StaticCache

    from fp8export.runtime.fp8_kv_cache import fp8_static_cache

    if model.__dict__.get("_fp8export_attention") is not None:
        return fp8_static_cache(model, max_cache_len)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


class DecodeRun:
    """Greedy single-token steps (batch ``batch``) with a StaticCache after a ``--prompt``-token
    prefill; ``compiled``: the steps run under ``torch.compile(mode="reduce-overhead")``. The
    position stays on the device and the next token is the argmax on the device, so steps
    need no host sync (as in a serving loop that reads tokens back asynchronously)."""

    def __init__(self, model, batch: int, args, compiled: bool):
        self.batch = batch
        self.cache = make_cache(model, args.prompt + 3 * args.decode_steps + 32)
        g = torch.Generator(device="cuda").manual_seed(4)
        ids = torch.randint(0, args.vocab, (batch, args.prompt), device="cuda", generator=g)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                        logits_to_keep=1, cache_position=torch.arange(args.prompt, device="cuda"))
        self.tok = out.logits[:, -1:].argmax(-1)
        self.pos = torch.tensor([args.prompt], device="cuda")
        self.fwd = torch.compile(model, mode="reduce-overhead", dynamic=False) if compiled \
            else model

    @torch.no_grad()
    def step(self) -> None:
        out = self.fwd(input_ids=self.tok, past_key_values=self.cache, use_cache=True,
                       logits_to_keep=1, cache_position=self.pos,
                       position_ids=self.pos.expand(self.batch, 1))
        self.tok = out.logits[:, -1:].argmax(-1)
        self.pos.add_(1)

    def synced_step_ms(self) -> float:
        """ms from the call until the step's last kernel ended, starting with an idle device
        (a loop that waits for each step's tokens): host time before the first launch counts."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self.step()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)


def bench_decode(model, label: str, batch: int, args, compiled: bool) -> dict:
    """One decode configuration: ms per step back to back (``<label>_ms``: max of host and
    device time), the host's ms per step, ms per step when each step is waited for, and the
    device time per step by kernel class (torch.profiler). ``args.warm_only``: the first
    (compiling) steps only."""
    t0 = time.perf_counter()
    run = DecodeRun(model, batch, args, compiled)
    run.step()
    run.step()  # reduce-overhead records the CUDA graph on the second call
    torch.cuda.synchronize()
    first_s = round(time.perf_counter() - t0, 2)
    if args.warm_only:
        return {f"{label}_first_call_s": first_s}
    for _ in range(2):
        run.step()
    host, wall = host_and_wall_ms(run.step, args.decode_steps)
    synced = statistics.median(run.synced_step_ms() for _ in range(args.decode_steps))
    prof = profile_calls(run.step, 4, top=8)
    extra = {f"{label}_host_profile": host_profile(run.step, args.decode_steps)} \
        if args.host_profile else {}
    return {**extra, f"{label}_ms": wall, f"{label}_host_ms": host,
            f"{label}_synced_ms": round(synced, 4),
            f"{label}_device_ms": round(prof["device_us"] / 1e3, 4),
            f"{label}_gemm_ms": round(sum(v for k, v in prof["by_class_us"].items()
                                          if k.startswith("gemm")) / 1e3, 4),
            f"{label}_first_call_s": first_s, f"{label}_profile": prof}


def section(name: str, fn, args):
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        out = fn()
        if out is not None:
            RESULT[name] = out
    except Exception:  # keep what the other sections measured
        RESULT.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
        print(RESULT["errors"][name], flush=True)
    RESULT.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
    save(args)


PARTS = ("overhead", "gemm", "sweep", "attention", "memory", "eager", "compiled", "prefill",
         "decode")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--parts", default="overhead,attention,memory,prefill,decode",
                    help="comma separated: " + ", ".join(PARTS))
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxS list, comma separated")
    ap.add_argument("--compile-shapes", default="8x2048,32x512,1x128")
    ap.add_argument("--no-compile-mask", dest="compile_mask", action="store_false",
                    help="compiled prefill without an attention_mask (see 'compiled' above)")
    ap.add_argument("--decode-batches", default="1,8,32", help="batches of the eager decode "
                    "(alias of --decode-eager, kept for old command lines)")
    ap.add_argument("--decode-eager", default=None,
                    help="batches decoded eager ('' for none; default: --decode-batches)")
    ap.add_argument("--decode-compiled", default="1,8,32",
                    help="batches also timed compiled + CUDA graphs ('' for none)")
    ap.add_argument("--prompt", type=int, default=256, help="prefill tokens before decoding")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--unfused", action="store_true", help="also time FP8 without fused groups")
    ap.add_argument("--attention", choices=("fp8", "kv", "off"), default="fp8",
                    help="the FP8 model's attention: FP8 kernel + FP8 KV cache, FP8 KV cache "
                         "with bf16 attention, or bf16 (FP8 linears only)")
    ap.add_argument("--p-e4m3", dest="p_bf16", action="store_false",
                    help="FP8 attention with P in E4M3 (default: bf16, what the runtime ships)")
    ap.add_argument("--p-bf16", dest="p_bf16", action="store_true", default=True,
                    help=argparse.SUPPRESS)
    ap.add_argument("--linears-only", action="store_true",
                    help="also time the FP8-linears-only model (bf16 attention) in eager prefill")
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--budget-context", type=int, default=4096)
    ap.add_argument("--eager-m-alt", type=int, default=0,
                    help="also time eager FP8 with this one-launch row threshold")
    ap.add_argument("--warm-only", action="store_true",
                    help="compiled sections: compile and run each configuration once, no timing")
    ap.add_argument("--recompile-limit", type=int, default=8,
                    help="torch._dynamo recompiles per frame before it is an error")
    ap.add_argument("--no-logits-check", dest="logits_check", action="store_false",
                    help="skip the FP8-vs-bf16-vs-emulated logits check at start")
    ap.add_argument("--host-profile", action="store_true",
                    help="prefill and decode: also where the host's time per call goes "
                         "(cProfile, by package)")
    ap.add_argument("--note", default="", help="a line about this run, kept in the JSON")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_fp8.json"))
    ap.add_argument("--report", nargs="+", type=Path, metavar="JSON",
                    help="write --md from these result files (merged in order) and exit")
    ap.add_argument("--md", type=Path, default=Path("bench/results/gpu_fp8.md"))
    ap.add_argument("--notes", type=Path, default=Path("bench/results/gpu_fp8_notes.md"),
                    help="appended to --md")
    args = ap.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS) - {""}
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.decode_eager is None:
        args.decode_eager = args.decode_batches
    return args


def _versions() -> dict:
    out = {"torch": torch.__version__}
    for name in ("transformers", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def _batches(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        write_report(merge_results(args.report), args.md, args.notes)
        print(f"wrote {args.md}")
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        print(f"FP8 GEMMs need compute capability >= 8.9; this GPU is {cc}", file=sys.stderr)
        return 1
    parts = set(args.parts.split(","))
    if "prefill" in parts:
        parts |= {"eager", "compiled"}
    bound_compile_work(args.recompile_limit)
    RESULT.update({
        "device": torch.cuda.get_device_name(), "compute_capability": f"{cc[0]}.{cc[1]}",
        "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
        "versions": _versions(), "targets": TARGETS, "eager_m": fp8_gemm.EAGER_M,
        "argv": sys.argv[1:] if argv is None else list(argv), "warm_only": args.warm_only,
        "method": "prefill: median of CUDA-event timings, the models taking turns in 5 rounds "
                  "of >=0.1 s each; compiled prefill with an all-ones attention_mask (both "
                  "models); decode: --decode-steps steps back to back (ms/step), and "
                  "the median of as many steps each waited for (synced); device time from "
                  "torch.profiler kernel records; logits_to_keep=1; static per-tensor input "
                  "scales; same process and weights",
    })
    if args.note:
        RESULT["note"] = args.note
    if "overhead" in parts:
        section("overhead", lambda: bench_overhead(args), args)
    if "gemm" in parts:
        section("gemms", lambda: bench_gemms(args), args)
    if "sweep" in parts:
        section("sweep", lambda: bench_sweep(args), args)
    if "attention" in parts:
        section("attention", lambda: bench_attention(args), args)
    if not parts & {"eager", "compiled", "decode", "memory"}:
        return 0
    model = build_bf16(args)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device="cuda").manual_seed(2)
    calib = [torch.randint(0, args.vocab, (4, 512), device="cuda", generator=g) for _ in range(2)]
    t0 = time.perf_counter()
    fp8, n_fp8, n_groups = to_fp8(model, calib, attention_mode=args.attention,
                                  p_fp8=not args.p_bf16)
    models = {"bf16": model, "fp8": fp8}
    if args.linears_only:
        models["fp8_linears"] = to_fp8(model, calib, attention_mode="off")[0]
    if args.unfused:
        models["fp8_unfused"] = to_fp8(model, calib, fuse=False)[0]
    if args.eager_m_alt:
        models[f"fp8_eagerM{args.eager_m_alt}"] = WithEagerM(fp8, args.eager_m_alt)
    RESULT["fp8_attention"] = {"mode": args.attention, "p": "bf16" if args.p_bf16 else "e4m3"}
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
    if args.logits_check and not args.warm_only:
        logits_check(model, fp8, models, calib)
    if "memory" in parts and not args.warm_only:
        section("kv_memory", lambda: bench_memory(model, fp8, args), args)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    cshapes = [tuple(int(v) for v in s.split("x")) for s in args.compile_shapes.split(",") if s]
    if "eager" in parts and shapes and not args.warm_only:
        RESULT["prefill_eager"] = rows = []
        section("prefill_eager", lambda: bench_prefill(
            models, shapes, args.vocab, rows=rows, on_row=lambda: save(args),
            host_reps=20 if args.host_profile else 0), args)
    if "compiled" in parts and cshapes:
        def graphs():
            reset_dynamo()
            gm = {"bf16g": torch.compile(model, mode="reduce-overhead", dynamic=False),
                  "fp8g": torch.compile(fp8, mode="reduce-overhead", dynamic=False)}
            RESULT["prefill_cudagraphs"] = rows = []
            bench_prefill(gm, cshapes, args.vocab, rows=rows, mask=args.compile_mask,
                          warm_only=args.warm_only, on_row=lambda: save(args),
                          host_reps=20 if args.host_profile else 0)
        section("prefill_cudagraphs", graphs, args)
    if "decode" in parts:
        section("decode", lambda: decode_section(model, fp8, args), args)
    print(f"wrote {args.out}")
    return 0


def logits_check(model, fp8, models, calib) -> None:
    """Logits of a 1x256 batch: FP8 (GPU kernels) against bf16 and against the same FP8 model
    emulated (FP8 linears and attention in torch), cosine."""
    with torch.no_grad():
        ids = calib[0][:1, :256]
        ref = model(input_ids=ids, use_cache=False).logits.float()
        outs = {k: m(input_ids=ids, use_cache=False).logits.float() for k, m in models.items()}
        emu = {n: m for n, m in fp8.named_modules() if isinstance(m, Fp8Linear)}
        for m in emu.values():
            m.mode = "emulate"
            m._refresh()
        with emulated():  # the FP8 attention's torch emulation too
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


def decode_section(model, fp8, args) -> list[dict]:
    """Eager steps at ``--decode-eager`` batches, compiled + CUDA graphs at
    ``--decode-compiled``; each row saved as soon as it is measured."""
    RESULT["decode"] = rows = []
    eager, compiled = _batches(args.decode_eager), _batches(args.decode_compiled)
    for batch in dict.fromkeys(eager + compiled):
        row = {"batch": batch, "prompt": args.prompt}
        rows.append(row)
        if batch in eager and not args.warm_only:
            for label, m in (("bf16", model), ("fp8", fp8)):
                row.update(bench_decode(m, f"{label}_eager", batch, args, False))
            row["speedup_eager"] = round(row["bf16_eager_ms"] / row["fp8_eager_ms"], 3)
            save(args)
        if batch in compiled:
            for label, m in (("bf16", model), ("fp8", fp8)):
                reset_dynamo()
                row.update(bench_decode(m, f"{label}_graphs", batch, args, True))
                row[f"{label}_graphs_dynamo"] = dynamo_stats()
                save(args)
            if not args.warm_only:
                for kind in ("ms", "synced_ms", "device_ms"):
                    row[f"speedup_graphs_{kind}"] = round(
                        row[f"bf16_graphs_{kind}"] / row[f"fp8_graphs_{kind}"], 3)
                # device time if only the GEMMs changed (everything else as in bf16)
                bf_dev, bf_g = row["bf16_graphs_device_ms"], row["bf16_graphs_gemm_ms"]
                row["gemm_only_bound"] = round(
                    bf_dev / (bf_dev - bf_g + row["fp8_graphs_gemm_ms"]), 3)
        log_row(row)
        save(args)
    return rows


if __name__ == "__main__":
    sys.exit(main())
