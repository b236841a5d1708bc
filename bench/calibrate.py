#!/usr/bin/env python
"""Calibration overhead: observed vs plain bf16 forward passes, same batches, same run.

    # GPU, Llama-shaped random model (~1.1 B parameters), the size the overhead target is set for:
    python bench/calibrate.py --device cuda --model llama-1b
    # CPU, the sample model and its calibration corpus:
    python bench/calibrate.py --device cpu --model sample

For each method the calibration pass is exactly what ``fp8export calibrate`` runs
(:func:`fp8export.calibration.observe.observe`: pre-hooks, padding mask, device-side absmax and
histograms, one host sync at the end). The baseline is the same forward callable over the same
batches without hooks. Passes alternate (baseline, max, percentile, ...) for ``--repeats``
rounds and the median is reported, so clock drift hits all of them alike. mse and entropy
collect the same statistics as percentile; their extra cost is the host-side amax search,
reported separately as ``compute_amax_s``.

Writes ``bench/results/calibrate_<device>.json`` (and prints a table).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
try:  # an installed (editable) fp8export maps calibration/ to fp8export.calibration
    import fp8export.calibration  # noqa: F401
except ModuleNotFoundError:  # a bare checkout (e.g. a borrowed GPU box): same mapping by hand
    import calibration

    sys.modules["fp8export.calibration"] = calibration

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048)
LLAMA_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def build(args):
    """(model, samples, modules, groups)."""
    import torch

    from fp8export.calibration.observers import is_linear_like
    from fp8export.inputs.samples import as_samples, load_samples
    from fp8export.models import max_positions
    from fp8export.scales.groups import fused_groups

    if args.model in ("llama-1b", "llama-tiny"):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**(LLAMA_1B if args.model == "llama-1b" else LLAMA_TINY))
        torch.manual_seed(0)
        with torch.device(args.device):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        g = torch.Generator().manual_seed(0)
        lengths = [args.seq_len] * args.samples
        if args.ragged:  # half the samples shorter: exercises the padding path
            lengths = [args.seq_len if i % 2 == 0 else args.seq_len // 2 + i % (args.seq_len // 2)
                       for i in range(args.samples)]
        toks = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
        samples = as_samples(toks, pad_id=0)
        config = cfg.to_dict()
    else:
        from fp8export.models import load_model

        path = REPO / "samples/tiny-llama/model" if args.model == "sample" else Path(args.model)
        model, config = load_model(path, dtype=torch.bfloat16, device=args.device)
        data = Path(args.data) if args.data else path.parent / "data/calib.txt"
        samples = load_samples(data, path, max_samples=args.samples, seq_len=args.seq_len,
                               max_positions=max_positions(config))
    head = {"lm_head", "score", "classifier"}
    modules = [n for n, m in model.named_modules()
               if is_linear_like(m) and n.rsplit(".", 1)[-1] not in head]
    return model, samples, modules, fused_groups(modules, config), config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sample",
                    help="sample | llama-1b | llama-tiny | PATH to a checkpoint folder")
    ap.add_argument("--data", help="calibration data (default: <checkpoint>/../data/calib.txt)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-size", type=int, default=None, help="default: 8 (cuda) / 16 (cpu)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: 1024 (cuda) / 128 (cpu)")
    ap.add_argument("--samples", type=int, default=None, help="default: 128 (cuda) / 256 (cpu)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ragged", action="store_true", help="random models: vary lengths (padding)")
    ap.add_argument("--methods", default="max,percentile,mse,entropy")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: 1 on cpu, so process CPU time is a "
                         "clean measure on a shared machine; torch's default on cuda)")
    ap.add_argument("--out", help="default: bench/results/calibrate_<device>.json")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.batch_size = args.batch_size or (8 if cuda else 16)
    args.seq_len = args.seq_len or (1024 if cuda else 128)
    args.samples = args.samples or (128 if cuda else 256)

    import torch

    from fp8export.calibration.observe import amaxes_from_stats, forward_fn, observe
    from fp8export.inputs.samples import iter_batches

    if cuda and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    if args.threads or not cuda:
        torch.set_num_threads(args.threads or 1)
    model, samples, modules, groups, config = build(args)
    device = torch.device(args.device)
    batches = list(iter_batches(samples, args.batch_size))
    if cuda:  # inputs stay on the host like in calibrate(); pin for async copies
        batches = [type(b)(b.input_ids.pin_memory(), b.attention_mask.pin_memory(), b.labels,
                           b.indices) for b in batches]
    fwd = forward_fn(model, modules)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    # mse/entropy collect exactly what percentile collects: time the collection once per kind.
    collect_as = {"max": "max", "percentile": "percentile", "mse": "percentile",
                  "entropy": "percentile"}
    kinds = list(dict.fromkeys(collect_as[m] for m in methods))
    # Also time the histogram without the per-call row cap (every value histogrammed).
    variants = {k: -1 for k in kinds}
    if "percentile" in kinds:
        variants["percentile-all-rows"] = None
        if cuda:  # the alternative device histogram kernel (see observers.add_counts)
            variants["percentile-histc"] = -1

    def sync():
        if cuda:
            torch.cuda.synchronize()

    cpu_times: dict[str, list[float]] = {}

    def baseline() -> float:
        sync()
        c = time.process_time()
        t = time.perf_counter()
        for b in batches:
            fwd(b, device)
        sync()
        cpu_times.setdefault("baseline", []).append(time.process_time() - c)
        return time.perf_counter() - t

    from fp8export.calibration import observers

    def calib(kind):
        method = "percentile" if kind.startswith("percentile") else kind
        default_kernel = observers.CUDA_HISTOGRAM_KERNEL
        observers.CUDA_HISTOGRAM_KERNEL = "histc" if kind == "percentile-histc" else "index_add"
        c = time.process_time()
        try:
            ob = observe(model, samples, modules, method=method, groups=groups,
                         input_device=device, forward=fwd, batches=batches, show_progress=False,
                         hist_rows=variants[kind])
        finally:
            observers.CUDA_HISTOGRAM_KERNEL = default_kernel
        cpu_times.setdefault(kind, []).append(time.process_time() - c)
        return ob.seconds, ob

    # warm-up (kernels, allocator, hooks)
    for b in batches[:2]:
        fwd(b, device)
    for k in kinds:
        observe(model, samples, modules, method=k, groups=groups, input_device=device,
                forward=fwd, batches=batches[:2], show_progress=False)
    times: dict[str, list[float]] = {"baseline": [], **{k: [] for k in variants}}
    last = {}
    for _ in range(args.repeats):
        times["baseline"].append(baseline())
        for k in variants:
            s, ob = calib(k)
            times[k].append(s)
            last[k] = ob
    base = statistics.median(times["baseline"])
    tokens = sum(b.num_tokens for b in batches)
    rows = {}
    for m in methods:
        k = collect_as[m]
        coll = statistics.median(times[k])
        t = time.perf_counter()
        amaxes_from_stats(last[k].stats, m)
        compute = time.perf_counter() - t
        rows[m] = {"collect_s": round(coll, 4), "overhead_pct": round(100 * (coll / base - 1), 2),
                   "compute_amax_s": round(compute, 4),
                   "total_overhead_pct": round(100 * ((coll + compute) / base - 1), 2),
                   "samples_per_s": round(len(samples) / coll, 2),
                   "collected_as": k}
    for extra in ("percentile-all-rows", "percentile-histc"):
        if extra not in times:
            continue
        coll = statistics.median(times[extra])
        rows[extra] = {
            "collect_s": round(coll, 4), "overhead_pct": round(100 * (coll / base - 1), 2),
            "compute_amax_s": rows.get("percentile", {}).get("compute_amax_s"),
            "samples_per_s": round(len(samples) / coll, 2), "collected_as": "percentile"}
        if extra == "percentile-all-rows":
            rows[extra]["hist_rows"] = None
        else:
            rows[extra]["cuda_histogram_kernel"] = "histc"
    from fp8export.calibration.observers import DEFAULT_HIST_ROWS

    for r in rows.values():
        r.setdefault("hist_rows", DEFAULT_HIST_ROWS if r["collected_as"] != "max" else None)
    if not cuda:
        # Process CPU time: on a shared machine wall-clock mostly measures the neighbours.
        cbase = statistics.median(cpu_times["baseline"])
        for name, r in rows.items():
            kind = name if name in cpu_times else collect_as.get(name, name)
            cc = statistics.median(cpu_times[kind])
            r["process_cpu_s"] = round(cc, 4)
            r["overhead_cpu_time_pct"] = round(100 * (cc / cbase - 1), 2)
    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "model": args.model, "parameters": n_params, "layers_observed": len(modules),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "batch_size": args.batch_size, "seq_len": args.seq_len, "samples": len(samples),
        "batches": len(batches), "tokens": tokens, "ragged": bool(args.ragged),
        "repeats": args.repeats,
        "baseline": {"forward_s": round(base, 4), "samples_per_s": round(len(samples) / base, 2),
                     "tokens_per_s": round(tokens / base, 1),
                     **({"process_cpu_s": round(statistics.median(cpu_times["baseline"]), 4)}
                        if not cuda else {})},
        "methods": rows, "raw_seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "raw_process_cpu_seconds": {k: [round(x, 4) for x in v] for k, v in cpu_times.items()},
        "target": "max/percentile overhead <= 15% on a GPU for a >= 1B Llama-shaped model",
    }
    out = Path(args.out) if args.out else REPO / f"bench/results/calibrate_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.model}: {n_params / 1e6:.1f} M params, {len(modules)} linears, "
          f"{len(batches)} batches x {args.batch_size} x <= {args.seq_len} tokens, "
          f"{result['device_name']}")
    print(f"{'pass':<20}{'seconds':>10}{'samples/s':>12}{'overhead':>11}{'amax calc s':>13}"
          + ("  cpu-time overhead" if not cuda else ""))
    print(f"{'bf16 fwd':<20}{base:>10.3f}{len(samples) / base:>12.1f}{'-':>11}{'-':>13}")
    for m, r in rows.items():
        calc = r["compute_amax_s"]
        print(f"{m:<20}{r['collect_s']:>10.3f}{r['samples_per_s']:>12.1f}"
              f"{r['overhead_pct']:>10.1f}%{calc if calc is not None else float('nan'):>13.3f}"
              + (f"{r['overhead_cpu_time_pct']:>18.1f}%" if "overhead_cpu_time_pct" in r else ""))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
