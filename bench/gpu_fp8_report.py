"""The Markdown report of ``bench/gpu_fp8.py``: its tables, the targets and the measured cause
of each gap, from one merged result JSON (``python bench/gpu_fp8.py --report``).

A result JSON carries the targets it was measured against (``targets``: :data:`TARGETS`, which
``gpu_fp8.py`` writes into every run); JSONs written before that (the H100 runs of
``gpu_fp8.md``) are rendered against the targets of their time (``PREFILL_TARGETS`` ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# targets of the H100 runs (gpu_fp8.md), before FP8 attention and the FP8 KV cache
PREFILL_TARGETS = {"8x2048": 1.5, "32x512": 1.5, "1x128": 1.0}
EAGER_TARGET, DECODE_TARGET, DECODE_TARGET_BATCHES = 0.9, 1.3, (1, 8, 32)

TARGETS = {
    # FP8 attention + FP8 KV cache against bf16 in the same run (speedups, x)
    "compiled_prefill": {"8x2048": 1.6, "32x512": 1.6, "1x128": 1.2},
    "decode_graphs": {"1": 1.5, "8": 1.5, "32": 1.35},
    "eager_prefill": {"1x512": 0.95},
    "max_decode_batch": 1.8,
}
"""The targets of the FP8 attention / FP8 KV cache work, as ``gpu_fp8.py`` records them."""


def _classes(prof: dict) -> tuple[float, float, float]:
    """(GEMM ms, attention ms, everything else ms) of one profiled call."""
    c = prof["by_class_us"]
    gemm = sum(v for k, v in c.items() if k.startswith("gemm")) / 1e3
    attn = c.get("attention", 0.0) / 1e3
    return gemm, attn, prof["device_us"] / 1e3 - gemm - attn


def _top(prof: dict, n: int = 6) -> list[str]:
    return [f"| {r['us'] / 1e3:.3f} | {r['per_call']:g} | {r['class']} | `{r['kernel'][:80]}` |"
            for r in prof["top"][:n]]


def write_report(results: dict, md: Path, notes: Path | None) -> None:
    """``md``: the tables and targets of ``results`` (one merged gpu_fp8 JSON), then ``notes``."""
    if "targets" in results or "sections" in results:  # a gpu_attention_run.sh run
        text = attention_report({"targets": TARGETS, **results})
        if notes is not None and notes.is_file():
            text += "\n" + notes.read_text().rstrip() + "\n"
        md.write_text(text)
        return
    r, m = results, results["model"]
    out = [f"# FP8 runtime vs bf16 — {r['device']} (CC {r['compute_capability']}), torch "
           f"{r['torch']}, CUDA {r['cuda']}", "",
           f"Llama-shaped model, {m['params'] / 1e9:.2f} B params (hidden {m['hidden']}, "
           f"{m['layers']} layers, GQA {m['heads']}/{m['kv_heads']}, intermediate "
           f"{m['intermediate']}), random weights; {m['fp8_linears']} decoder linears in FP8 as "
           f"{m['fused_groups']} fused q/k/v and gate/up groups + o/down (static per-tensor "
           "scales shared per group), lm_head/embeddings bf16; bf16 baseline and FP8 in the same "
           f"process, same weights. {r['method']}.", "",
           f"Weights: bf16 {r['memory']['bf16_weights_gib']} GiB → FP8 model "
           f"{r['memory']['fp8_weights_gib']} GiB. Logits cosine (random weights, 1×256) FP8 vs "
           f"bf16 {r['logits_cosine_random_weights']['fp8']}, FP8 `_scaled_mm` vs FP8 emulated "
           f"{r['logits_cosine_fp8_vs_emulated']}.", ""]
    eager = {f"{x['batch']}x{x['seq']}": x for x in r.get("prefill_eager", [])}
    graphs = {f"{x['batch']}x{x['seq']}": x for x in r.get("prefill_cudagraphs", [])}
    decode = {x["batch"]: x for x in r.get("decode", [])}

    targets = ["## Targets", "", "| target | measured | met | cause of the gap (measured) |",
               "|---|---|---|---|"]
    for shape, want in PREFILL_TARGETS.items():
        x = graphs.get(shape)
        if x is None:
            continue
        got = x["speedup_fp8g"]
        bf_g, bf_a, bf_o = _classes(x["bf16g_profile"])
        f8_g, f8_a, f8_o = _classes(x["fp8g_profile"])
        bf_dev = x["bf16g_profile"]["device_us"] / 1e3
        ceiling = bf_dev / (f8_g + bf_a + bf_o)
        f8_dev = x["fp8g_profile"]["device_us"] / 1e3
        if got >= want:
            cause = ""
        elif ceiling < want:
            cause = (f"Amdahl: FP8 GEMMs {bf_g / f8_g:.2f}× faster ({bf_g:.1f} → {f8_g:.1f} ms) "
                     f"but attention {bf_a:.1f} ms + other kernels {bf_o:.1f} ms = "
                     f"{(bf_a + bf_o) / bf_dev:.0%} of the bf16 device time are not GEMMs (FP8: "
                     f"{f8_a:.1f} + {f8_o:.1f} ms); ceiling with them unchanged {ceiling:.2f}×")
        else:
            cause = (f"device time {bf_dev / f8_dev:.2f}× (bf16 {bf_dev:.1f} → FP8 {f8_dev:.1f} "
                     "ms) meets it; each timed forward starts on an idle GPU, so the host's "
                     "work before the CUDA graph launches counts: wall − device "
                     f"{x['fp8g_ms'] - f8_dev:.1f} ms for FP8 vs {x['bf16g_ms'] - bf_dev:.1f} "
                     "ms for bf16")
        targets.append(f"| compiled + CUDA graphs prefill {shape} ≥ {want}× | {got}× | "
                       f"{'yes' if got >= want else 'no'} | {cause} |")
    for shape, x in eager.items():
        got = x["speedup_fp8"]
        busy = x["fp8_device_ms"] / x["fp8_ms"]
        cause = "" if got >= EAGER_TARGET else (
            f"host-bound: the device is busy {busy:.0%} of the FP8 forward and its device time "
            f"is {x['fp8_device_ms']:.2f} ms vs bf16 {x['bf16_device_ms']:.2f} ms; the gap is "
            f"host time per forward (spread of the round medians: bf16 "
            f"{x['bf16_spread']:.0%}, FP8 {x['fp8_spread']:.0%})")
        targets.append(f"| eager prefill {shape} ≥ {EAGER_TARGET}× | {got}× | "
                       f"{'yes' if got >= EAGER_TARGET else 'no'} | {cause} |")
    for batch in DECODE_TARGET_BATCHES:
        x = decode.get(batch)
        if x is None or "speedup_graphs_ms" not in x:
            continue
        got = x["speedup_graphs_ms"]
        dev = x["speedup_graphs_device_ms"]
        gemm = (f"GEMMs {x['bf16_graphs_gemm_ms']:.3f} → {x['fp8_graphs_gemm_ms']:.3f} ms of a "
                f"{x['bf16_graphs_device_ms']:.3f} ms bf16 step "
                f"({x['bf16_graphs_gemm_ms'] / x['bf16_graphs_device_ms']:.0%})")
        if got >= DECODE_TARGET:
            cause = ""
        elif x["gemm_only_bound"] < DECODE_TARGET:
            cause = (f"Amdahl: {gemm}; with everything else unchanged the bound is "
                     f"{x['gemm_only_bound']}×; device-time ratio {dev}×")
        elif dev >= DECODE_TARGET and x["fp8_graphs_host_ms"] >= x["fp8_graphs_device_ms"]:
            cause = (f"device time {dev}× meets it ({gemm}); in this run the FP8 loop was "
                     f"host-bound: {x['fp8_graphs_host_ms']:.3f} ms of host time per step vs "
                     f"{x['fp8_graphs_device_ms']:.3f} ms of device time")
        else:
            cause = (f"device time {dev}×; {gemm}; GEMM-only bound {x['gemm_only_bound']}×; "
                     f"host {x['bf16_graphs_host_ms']:.3f} / {x['fp8_graphs_host_ms']:.3f} ms "
                     "per step")
        targets.append(f"| decode batch {batch} (compiled + CUDA graphs) ≥ {DECODE_TARGET}× | "
                       f"{got}× | {'yes' if got >= DECODE_TARGET else 'no'} | {cause} |")
    out += targets + [""]

    if eager:
        labels = [k[:-3] for k in next(iter(eager.values())) if k.endswith("_ms")
                  and not k.endswith(("device_ms",)) and k[:-3] not in ("bf16",)]
        head = "| batch×seq | bf16 ms | " + " | ".join(f"{lb} ms | ×" for lb in labels) + \
            " | device ms bf16 / FP8 | FP8 device busy | round spread bf16 / FP8 |"
        out += ["## Prefill, eager (ms per forward, logits for the last position)", "", head,
                "|" + "---|" * (head.count("|") - 1)]
        for shape, x in eager.items():
            cols = " | ".join(f"{x[f'{lb}_ms']:.2f} | {x[f'speedup_{lb}']}" for lb in labels)
            out.append(f"| {shape} | {x['bf16_ms']:.2f} | {cols} | {x['bf16_device_ms']:.2f} / "
                       f"{x['fp8_device_ms']:.2f} | {x['fp8_device_ms'] / x['fp8_ms']:.0%} | "
                       f"{x['bf16_spread']:.0%} / {x['fp8_spread']:.0%} |")
        out.append("")
    if graphs:
        out += ["## Prefill, `torch.compile(mode=\"reduce-overhead\")` (Inductor + CUDA graphs)",
                "", "| batch×seq | bf16 ms | FP8 ms | × | device ms bf16 / FP8 | device × | GEMM "
                "ms bf16 / FP8 | attention ms bf16 / FP8 | other kernels ms bf16 / FP8 | "
                "ceiling (only GEMMs change) | compile s bf16 / FP8 |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for shape, x in graphs.items():
            bf, f8 = _classes(x["bf16g_profile"]), _classes(x["fp8g_profile"])
            bf_dev = x["bf16g_profile"]["device_us"] / 1e3
            f8_dev = x["fp8g_profile"]["device_us"] / 1e3
            out.append(f"| {shape} | {x['bf16g_ms']:.3f} | {x['fp8g_ms']:.3f} | "
                       f"{x['speedup_fp8g']} | {bf_dev:.2f} / {f8_dev:.2f} | "
                       f"{bf_dev / f8_dev:.3f} | {bf[0]:.2f} / {f8[0]:.2f} | {bf[1]:.2f} / "
                       f"{f8[1]:.2f} | {bf[2]:.2f} / {f8[2]:.2f} | "
                       f"{bf_dev / (f8[0] + bf[1] + bf[2]):.2f}× | {x['bf16g_first_call_s']} / "
                       f"{x['fp8g_first_call_s']} |")
        out.append("")
    if decode:
        out += ["## Decode (one greedy step with a StaticCache after a "
                f"{next(iter(decode.values()))['prompt']}-token prompt)", "",
                "ms per step, steps back to back (the loop never waits for the host); "
                "\"waited\": each step waited for (host time before the launch adds); device: "
                "sum of the step's kernels.", "",
                "| batch | eager bf16 / FP8 | × | graphs bf16 / FP8 | × | waited bf16 / FP8 | × "
                "| device bf16 / FP8 | × | GEMMs bf16 / FP8 | GEMM-only bound | host per step "
                "bf16 / FP8 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for batch, x in decode.items():
            g = "speedup_graphs_ms" in x
            cells = [f"{x['bf16_eager_ms']:.3f} / {x['fp8_eager_ms']:.3f}", f"{x['speedup_eager']}"]
            if g:
                cells += [f"{x['bf16_graphs_ms']:.3f} / {x['fp8_graphs_ms']:.3f}",
                          f"{x['speedup_graphs_ms']}",
                          f"{x['bf16_graphs_synced_ms']:.3f} / {x['fp8_graphs_synced_ms']:.3f}",
                          f"{x['speedup_graphs_synced_ms']}",
                          f"{x['bf16_graphs_device_ms']:.3f} / {x['fp8_graphs_device_ms']:.3f}",
                          f"{x['speedup_graphs_device_ms']}",
                          f"{x['bf16_graphs_gemm_ms']:.3f} / {x['fp8_graphs_gemm_ms']:.3f}",
                          f"{x['gemm_only_bound']}×",
                          f"{x['bf16_graphs_host_ms']:.3f} / {x['fp8_graphs_host_ms']:.3f}"]
            else:
                cells += [""] * 9
            out.append(f"| {batch} | " + " | ".join(cells) + " |")
        out.append("")
    kt = ["## Kernel tables (torch.profiler; ms per call, calls per call, class, kernel)", ""]
    picks = [("eager prefill", eager, "1x2048", ("bf16", "fp8")),
             ("compiled prefill", graphs, "8x2048", ("bf16g", "fp8g"))]
    for title, rows, shape, labels in picks:
        if shape in rows:
            for lb in labels:
                p = rows[shape][f"{lb}_profile"]
                kt += [f"**{title} {shape}, {lb}**: device {p['device_us'] / 1e3:.3f} ms, "
                       f"{p['kernels']:g} kernels; by class (ms): " + ", ".join(
                           f"{k} {v / 1e3:.3f}" for k, v in p["by_class_us"].items()), "",
                       "| ms | calls | class | kernel |", "|---|---|---|---|", *_top(p), ""]
    if 32 in decode and "bf16_graphs_profile" in decode[32]:
        for lb in ("bf16", "fp8"):
            p = decode[32][f"{lb}_graphs_profile"]
            kt += [f"**decode batch 32, compiled + CUDA graphs, {lb}**: device "
                   f"{p['device_us'] / 1e3:.3f} ms, {p['kernels']:g} kernels; by class (ms): " +
                   ", ".join(f"{k} {v / 1e3:.3f}" for k, v in p["by_class_us"].items()), "",
                   "| ms | calls | class | kernel |", "|---|---|---|---|", *_top(p), ""]
    out += kt
    if r.get("gemms"):
        out += ["## Bare GEMMs (device time, CUDA-graph replay): bf16 `x @ w.T` vs quantize + "
                "`_scaled_mm` vs the eager one-launch Triton kernel", "",
                "| GEMM | M | K | N | bf16 ms | quantize + `_scaled_mm` ms | × | Triton "
                "one-launch ms | × |", "|---|---|---|---|---|---|---|---|---|"]
        for x in r["gemms"]:
            out.append(f"| {x['gemm']} | {x['M']} | {x['K']} | {x['N']} | {x['bf16_ms']:.4f} | "
                       f"{x['scaled_mm_with_quant_ms']:.4f} | {x['speedup_scaled_mm']} | "
                       f"{x.get('triton_small_m_ms', '')} | {x.get('speedup_triton', '')} |")
        out.append("")
    if r.get("overhead"):
        out += ["## Host cost per call (µs, 2000 calls; tiny tensors unless the op names a "
                "shape)", "", "| op | µs |",
                "|---|---|"] + [f"| {x['op']} | {x['host_us_per_call']} |" for x in r["overhead"]]
        out.append("")
    if notes is not None and notes.is_file():
        out += [notes.read_text().rstrip(), ""]
    md.write_text("\n".join(out))


# ---------------------------------------------------------------- runs that carry their targets
def _ms(x) -> str:
    return "–" if x is None else f"{x:.3f}"


STEP_OF = {"prefill_cudagraphs": "compiled", "prefill_eager": "eager", "kv_memory": "memory",
           "decode": "decode", "attention": "attention"}
"""The step of ``gpu_attention_run.sh`` that measures each section."""


def _not_measured(results: dict, section: str, shape: str | None = None) -> str:
    """Why a section has no row: its status from the runner (gpu_attention_run.sh; a shape's
    own step where the runner ran one per shape), else its error, else that it was not run."""
    sections = results.get("sections") or {}
    step = STEP_OF.get(section, section)
    status = sections.get(f"{step}_{shape}") if shape else None
    status = status or sections.get(step)
    if status and status.get("rc") == "skipped":
        return "not measured: no time was left for it in the call"
    if status and status.get("timed_out"):
        return f"not measured: the section stopped at its limit of {status['limit_s']} s"
    err = (results.get("errors") or {}).get(section)
    if err:
        return "not measured: " + err.strip().splitlines()[-1][:160].replace("|", "\\|")
    if status and status.get("rc"):
        return f"not measured: the section exited {status['rc']} (see its log)"
    return "not measured in this run"


def _prefill_cause(x: dict, want: float, a: str, b: str) -> str:
    """Why compiled prefill missed ``want``, from the two profiles (labels ``a``/``b``)."""
    bf_g, bf_a, bf_o = _classes(x[f"{a}_profile"])
    f8_g, f8_a, f8_o = _classes(x[f"{b}_profile"])
    bf_dev = x[f"{a}_profile"]["device_us"] / 1e3
    f8_dev = x[f"{b}_profile"]["device_us"] / 1e3
    dev = bf_dev / f8_dev
    parts = [f"device time {dev:.2f}× (bf16 {bf_dev:.2f} → FP8 {f8_dev:.2f} ms): GEMMs "
             f"{bf_g:.2f} → {f8_g:.2f} ms, attention {bf_a:.2f} → {f8_a:.2f} ms, other kernels "
             f"{bf_o:.2f} → {f8_o:.2f} ms; with only the GEMMs changed the device-time ceiling "
             f"is {bf_dev / (f8_g + bf_a + bf_o):.2f}×"]
    if dev >= want:
        parts.append(f"wall − device {x[f'{b}_ms'] - f8_dev:.2f} ms for FP8 vs "
                     f"{x[f'{a}_ms'] - bf_dev:.2f} ms for bf16 (host work before the graph "
                     "launch counts: each forward starts on an idle GPU)")
        host = _host_diff(x, a, b)
        if host:
            parts.append(host)
    elif f8_a > bf_a:
        parts.append("FP8 attention is slower than bf16's")
    return "; ".join(parts)


def _host_diff(x: dict, a: str, b: str, n: int = 3) -> str:
    """The host's time per call under cProfile (``<label>_host_profile``) of ``b`` against
    ``a``, and the packages whose own time grew most; "" without profiles."""
    pa, pb = x.get(f"{a}_host_profile"), x.get(f"{b}_host_profile")
    if not pa or not pb:
        return ""
    ua, ub = pa["by_package_us"], pb["by_package_us"]
    grew = sorted(((ub.get(k, 0) - ua.get(k, 0), k) for k in set(ua) | set(ub)), reverse=True)
    return (f"host time under cProfile {pa['host_us_per_call_profiled'] / 1e3:.2f} → "
            f"{pb['host_us_per_call_profiled'] / 1e3:.2f} ms per call; own time that grew most: "
            + ", ".join(f"{k} +{d / 1e3:.2f} ms" for d, k in grew[:n] if d > 0))


def host_table(title: str, x: dict, a: str, b: str) -> list[str]:
    """Markdown: own host time per call by package, ``a`` against ``b`` (cProfile)."""
    pa, pb = x.get(f"{a}_host_profile"), x.get(f"{b}_host_profile")
    if not pa or not pb:
        return []
    ua, ub = pa["by_package_us"], pb["by_package_us"]
    keys = sorted(set(ua) | set(ub), key=lambda k: -max(ua.get(k, 0), ub.get(k, 0)))
    out = [f"**{title}**: host µs per call under cProfile {pa['host_us_per_call_profiled']} "
           f"({a}) / {pb['host_us_per_call_profiled']} ({b}); own time by package:", "",
           f"| package | {a} µs | {b} µs | {b} − {a} |", "|---|---|---|---|"]
    out += [f"| {k} | {ua.get(k, 0)} | {ub.get(k, 0)} | {ub.get(k, 0) - ua.get(k, 0):+.1f} |"
            for k in keys]
    out += ["", f"Largest own times, {b}:", "", "| function | package | calls | own µs | cum µs |",
            "|---|---|---|---|---|"]
    out += [f"| `{t['function'].replace('|', '/')}` | {t['package']} | {t['calls']:g} | "
            f"{t['own_us']} | {t['cum_us']} |" for t in pb["top_own"][:8]]
    return out + [""]


def _decode_cause(x: dict, want: float) -> str:
    gemm = (f"GEMMs {x['bf16_graphs_gemm_ms']:.3f} → {x['fp8_graphs_gemm_ms']:.3f} ms of a "
            f"{x['bf16_graphs_device_ms']:.3f} ms bf16 step")
    skips = (x.get("fp8_graphs_dynamo") or {}).get("cudagraph_skips", 0)
    if skips:
        return (f"the FP8 step skipped its CUDA graph ({skips}×; host {x['fp8_graphs_host_ms']:.3f}"
                f" ms per step); device time {x['speedup_graphs_device_ms']}×")
    dev = x["speedup_graphs_device_ms"]
    host = _host_diff(x, "bf16_graphs", "fp8_graphs")
    if dev < want:
        return (f"device time {dev}× ({gemm}; GEMM-only bound {x['gemm_only_bound']}×)"
                + (f"; {host}" if host else ""))
    return (f"device time {dev}× meets it ({gemm}); host {x['bf16_graphs_host_ms']:.3f} / "
            f"{x['fp8_graphs_host_ms']:.3f} ms per step" + (f"; {host}" if host else ""))


def attention_report(r: dict) -> str:
    """The report of a run that carries ``targets`` (FP8 attention + FP8 KV cache vs bf16)."""
    t, m = r.get("targets") or TARGETS, r.get("model") or {}
    v = r.get("versions") or {}
    out = [f"# FP8 attention and the FP8 KV cache vs bf16 — {r.get('device', '?')} (CC "
           f"{r.get('compute_capability', '?')}), torch {r.get('torch', '?')}, CUDA "
           f"{r.get('cuda', '?')}, Triton {v.get('triton') or 'not recorded'}, transformers "
           f"{v.get('transformers') or 'not recorded'}", "",
           "Written by `bench/gpu_fp8_report.py` from the run's JSON (`bench/gpu_fp8.py`"
           + ("; `bench/gpu_attention_run.sh` ran its sections, each in its own process under "
              "a hard time limit)." if r.get("sections") else ")."), ""]
    if m:
        att = r.get("fp8_attention") or {}
        out += [f"Llama-shaped model, {m['params'] / 1e9:.2f} B params (hidden {m['hidden']}, "
                f"{m['layers']} layers, GQA {m['heads']}/{m['kv_heads']}), random weights; "
                f"FP8: {m['fp8_linears']} linears as {m['fused_groups']} fused groups + o/down, "
                f"attention mode `{att.get('mode')}` (P in {att.get('p')}), the FP8 KV cache "
                "(E4M3) in decode; bf16: transformers' SDPA and its bf16 StaticCache. Same "
                f"process, same weights. {r.get('method', '')}", ""]
    if r.get("note"):
        out += [r["note"], ""]
    files = r.get("gpu_test_files") or "tests/runtime/test_fp8_attention_gpu.py"
    if r.get("gpu_tests"):
        what = (": the kernels against the CPU emulation, the cache write bit for bit"
                if files == "tests/runtime/test_fp8_attention_gpu.py" else "")
        out += [f"GPU tests (`{files}`{what}): {r['gpu_tests']}", ""]
    eager = {f"{x['batch']}x{x['seq']}": x for x in r.get("prefill_eager") or []}
    graphs = {f"{x['batch']}x{x['seq']}": x for x in r.get("prefill_cudagraphs") or []}
    decode = {str(x["batch"]): x for x in r.get("decode") or []}
    mem = r.get("kv_memory")
    if mem is None and "max_batch_ratio" in (r.get("memory") or {}):
        mem = r["memory"]  # runs before the section had its own key

    rows = ["## Targets", "", "| target | measured (bf16 → FP8, same run) | met | cause "
            "(measured) |", "|---|---|---|---|"]
    for shape, want in t["compiled_prefill"].items():
        x = graphs.get(shape)
        name = f"compiled prefill {shape} ≥ {want}×"
        if x is None or "speedup_fp8g" not in x:
            rows.append(f"| {name} | – | – | {_not_measured(r, 'prefill_cudagraphs', shape)} |")
            continue
        got = x["speedup_fp8g"]
        cause = "" if got >= want else _prefill_cause(x, want, "bf16g", "fp8g")
        rows.append(f"| {name} | {got}× ({x['bf16g_ms']:.3f} → {x['fp8g_ms']:.3f} ms) | "
                    f"{'yes' if got >= want else 'no'} | {cause} |")
    for batch, want in t["decode_graphs"].items():
        x = decode.get(batch)
        name = f"decode b{batch}, compiled + CUDA graphs ≥ {want}×"
        if x is None or "speedup_graphs_ms" not in x:
            rows.append(f"| {name} | – | – | {_not_measured(r, 'decode')} |")
            continue
        got = x["speedup_graphs_ms"]
        cause = "" if got >= want else _decode_cause(x, want)
        rows.append(f"| {name} | {got}× ({x['bf16_graphs_ms']:.3f} → {x['fp8_graphs_ms']:.3f} "
                    f"ms per step) | {'yes' if got >= want else 'no'} | {cause} |")
    for shape, want in t["eager_prefill"].items():
        x = eager.get(shape)
        name = f"eager prefill {shape} ≥ {want}×"
        if x is None:
            rows.append(f"| {name} | – | – | {_not_measured(r, 'prefill_eager')} |")
            continue
        got = x["speedup_fp8"]
        host = _host_diff(x, "bf16", "fp8")
        cause = "" if got >= want else (
            f"device time bf16 {x['bf16_device_ms']:.2f} → FP8 {x['fp8_device_ms']:.2f} ms; the "
            f"device is busy {x['fp8_device_ms'] / x['fp8_ms']:.0%} of the FP8 forward: "
            "host-bound" + (f"; {host}" if host else ""))
        rows.append(f"| {name} | {got}× ({x['bf16_ms']:.2f} → {x['fp8_ms']:.2f} ms) | "
                    f"{'yes' if got >= want else 'no'} | {cause} |")
    want = t["max_decode_batch"]
    name = f"max decode batch at a fixed budget ≥ {want}×"
    if not mem:
        rows.append(f"| {name} | – | – | {_not_measured(r, 'kv_memory')} |")
    else:
        got = mem["max_batch_ratio"]
        rows.append(f"| {name} | {got}× ({mem['bf16']['max_decode_batch']} → "
                    f"{mem['fp8']['max_decode_batch']} sequences of {mem['context']} tokens in "
                    f"{mem['budget_gib']} GiB) | {'yes' if got >= want else 'no'} | |")
    out += rows + [""]

    if graphs:
        out += ["## Prefill, `torch.compile(mode=\"reduce-overhead\")` (Inductor + CUDA graphs)",
                "", "| batch×seq | bf16 ms | FP8 ms | × | device ms bf16 / FP8 | GEMM ms | "
                "attention ms | other ms | compile s bf16 / FP8 | graphs / breaks / CUDA-graph "
                "skips (FP8) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for shape, x in graphs.items():
            if "fp8g_profile" not in x:
                continue
            bf, f8 = _classes(x["bf16g_profile"]), _classes(x["fp8g_profile"])
            d = x.get("fp8g_dynamo") or {}
            out.append(f"| {shape} | {x['bf16g_ms']:.3f} | {x['fp8g_ms']:.3f} | "
                       f"{x['speedup_fp8g']} | {x['bf16g_profile']['device_us'] / 1e3:.2f} / "
                       f"{x['fp8g_profile']['device_us'] / 1e3:.2f} | {bf[0]:.2f} / {f8[0]:.2f} "
                       f"| {bf[1]:.2f} / {f8[1]:.2f} | {bf[2]:.2f} / {f8[2]:.2f} | "
                       f"{x['bf16g_first_call_s']} / {x['fp8g_first_call_s']} | "
                       f"{d.get('unique_graphs', '–')} / {d.get('graph_breaks', '–')} / "
                       f"{d.get('cudagraph_skips', '–')} |")
        out.append("")
    if decode:
        out += ["## Decode, compiled + CUDA graphs (one greedy step; ms per step)", "",
                "| batch | bf16 / FP8 | × | waited bf16 / FP8 | device bf16 / FP8 | device × | "
                "GEMMs bf16 / FP8 | host bf16 / FP8 | compile s bf16 / FP8 | CUDA-graph skips "
                "bf16 / FP8 |", "|---|---|---|---|---|---|---|---|---|---|"]
        for batch, x in decode.items():
            if "speedup_graphs_ms" not in x:
                continue
            out.append(
                f"| {batch} | {_ms(x['bf16_graphs_ms'])} / {_ms(x['fp8_graphs_ms'])} | "
                f"{x['speedup_graphs_ms']} | {_ms(x['bf16_graphs_synced_ms'])} / "
                f"{_ms(x['fp8_graphs_synced_ms'])} | {_ms(x['bf16_graphs_device_ms'])} / "
                f"{_ms(x['fp8_graphs_device_ms'])} | {x['speedup_graphs_device_ms']} | "
                f"{_ms(x['bf16_graphs_gemm_ms'])} / {_ms(x['fp8_graphs_gemm_ms'])} | "
                f"{_ms(x['bf16_graphs_host_ms'])} / {_ms(x['fp8_graphs_host_ms'])} | "
                f"{x['bf16_graphs_first_call_s']} / {x['fp8_graphs_first_call_s']} | "
                f"{(x.get('bf16_graphs_dynamo') or {}).get('cudagraph_skips', '–')} / "
                f"{(x.get('fp8_graphs_dynamo') or {}).get('cudagraph_skips', '–')} |")
        out.append("")
    if eager:
        labels = [k[:-3] for k in next(iter(eager.values())) if k.endswith("_ms")
                  and not k.endswith("device_ms") and k[:-3] != "bf16"]
        out += ["## Prefill, eager (ms per forward)", "",
                "| batch×seq | bf16 ms | " + " | ".join(f"{lb} ms | ×" for lb in labels)
                + " | device ms bf16 / FP8 |", "|---|---|" + "---|---|" * len(labels) + "---|"]
        for shape, x in eager.items():
            cols = " | ".join(f"{x[f'{lb}_ms']:.2f} | {x[f'speedup_{lb}']}" for lb in labels)
            out.append(f"| {shape} | {x['bf16_ms']:.2f} | {cols} | {x['bf16_device_ms']:.2f} / "
                       f"{x['fp8_device_ms']:.2f} |")
        out.append("")
    if mem:
        out += ["## KV cache and the largest decode batch", "",
                f"Budget {mem['budget_gib']} GiB for weights + cache + one decode step's peak, "
                f"{mem['context']}-token cache per sequence.", "",
                "| | weights GiB | KV cache MiB per sequence | max decode batch | peak GiB |",
                "|---|---|---|---|---|"]
        for label in ("bf16", "fp8"):
            x = mem[label]
            out.append(f"| {label} | {x['weights_gib']} | {x['kv_cache_mib_per_sequence']} | "
                       f"{x['max_decode_batch']} | {x['peak_gib_at_max']} |")
        out += ["", f"KV cache FP8 / bf16: {mem['kv_cache_ratio_fp8_over_bf16']}×.", ""]
    kernel = (r.get("attention") or {}).get("rows")
    if kernel:
        out += ["## The attention kernel alone (ms per call, CUDA graph of 20 calls)", "",
                "Against transformers' bf16 SDPA (flash/cuDNN, GQA) on the same 16-bit inputs; "
                "accuracy against fp32 attention and agreement with the emulation (rel-L2).", "",
                "| shape | SDPA bf16 | FP8, P bf16 | FP8, P E4M3 | FP8 vs fp32, P bf16 / E4M3 | "
                "SDPA bf16 vs fp32 | kernel vs emulation, P bf16 / E4M3 |",
                "|---|---|---|---|---|---|---|"]
        for x in kernel:
            shape = (f"prefill {x['batch']}×{x['q_tokens']}" if x["kind"] == "prefill" else
                     f"decode b{x['batch']}, {x['kv_tokens']} cached")

            def pair(key, x=x):
                a, b = x.get(f"p_bf16_{key}"), x.get(f"p_e4m3_{key}")
                return "–" if a is None else f"{a:.3g} / {b:.3g}"

            fp32 = x.get("sdpa_bf16_vs_fp32_rel_l2")
            out.append(f"| {shape} | {x['sdpa_ms']:.4f} | {x['p_bf16_ms']:.4f} | "
                       f"{x['p_e4m3_ms']:.4f} | {pair('vs_fp32_rel_l2')} | "
                       f"{'–' if fp32 is None else f'{fp32:.3g}'} | "
                       f"{pair('vs_emulation_rel_l2')} |")
        sweep = (r.get("attention") or {}).get("sweep") or []
        if sweep:
            for shape in dict.fromkeys(f"{x['batch']}×{x['seq']}" for x in sweep):
                xs = [x for x in sweep if f"{x['batch']}×{x['seq']}" == shape]
                out += ["", f"Tiles at prefill {shape} (P {xs[0].get('p', 'e4m3').upper()}; "
                        "BLOCK_M / warps / stages" + (" / programs" if "programs" in xs[0]
                                                      else "") + ": ms): " + ", ".join(
                            f"{x['BLOCK_M']}/{x['num_warps']}/{x['num_stages']}"
                            + (f"/{x['programs']}" if "programs" in x else "") + f": {x['ms']}"
                            for x in xs) + "."]
        out.append("")
    hosts = [line for shape, x in eager.items()
             for line in host_table(f"eager prefill {shape}", x, "bf16", "fp8")]
    hosts += [line for shape, x in graphs.items()
              for line in host_table(f"compiled prefill {shape}", x, "bf16g", "fp8g")]
    hosts += [line for batch, x in decode.items()
              for line in host_table(f"decode b{batch}, compiled + CUDA graphs", x,
                                     "bf16_graphs", "fp8_graphs")]
    if hosts:
        out += ["## Host time per call (cProfile)", "", *hosts]
    sections = r.get("sections") or {}
    if sections:
        out += ["## Sections of this run", "", "| section | seconds | limit s | exit | stopped |",
                "|---|---|---|---|---|"]
        for name, st in sections.items():
            out.append(f"| {name} | {st.get('seconds')} | {st.get('limit_s')} | {st.get('rc')} | "
                       f"{'yes' if st.get('timed_out') else 'no'} |")
        out.append("")
    return "\n".join(out)


MERGED_DICTS = ("errors", "section_s", "sections", "versions")
ROW_LISTS = ("prefill_eager", "prefill_cudagraphs", "decode")
"""Sections whose rows (one per shape or batch) several processes of a run measure apart."""


def _row_key(row) -> tuple:
    return (row.get("batch"), row.get("seq")) if isinstance(row, dict) else (row,)


def merge_results(paths) -> dict:
    """Result files of one run's processes, merged in order: later keys win, except the
    per-section dicts (errors, section_s, sections, versions), which are united, and the row
    lists (:data:`ROW_LISTS`), whose rows are united by shape (a later row of the same shape
    replaces the earlier one)."""
    merged: dict = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        for key, value in part.items():
            if key in MERGED_DICTS and isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            elif key in ROW_LISTS and isinstance(value, list):
                rows = {_row_key(x): x for x in merged.get(key) or []}
                rows.update({_row_key(x): x for x in value})
                merged[key] = list(rows.values())
            else:
                merged[key] = value
    return merged


def main(argv=None) -> int:
    """``python bench/gpu_fp8_report.py RESULT.json... --md OUT.md``: the report without
    importing torch (what ``gpu_fp8.py --report`` does too)."""
    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--md", type=Path, required=True)
    ap.add_argument("--notes", type=Path, default=None, help="appended to --md")
    ap.add_argument("--targets", action="store_true",
                    help="render against TARGETS results written before runs recorded theirs")
    args = ap.parse_args(argv)
    results = merge_results(args.results)
    if args.targets:
        results.setdefault("targets", TARGETS)
    write_report(results, args.md, args.notes)
    print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
