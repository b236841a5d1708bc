#!/usr/bin/env python
"""GPTQ's column loop on a GPU: the Triton kernel against the torch loop, same call, same data.

    python3 bench/gptq_gpu.py --out bench/results/gptq_gpu_h200.json

For each weight shape (a fused group as convert rounds it: rows = the members' outputs, columns
= the input width) one ``gptq_round`` per path on random weights with per-row scales and a
Hessian of correlated random inputs. Reported: seconds (median of ``--repeat`` for the kernel,
one run of the torch loop where ``loop`` is on), ms per column, the speedup, and whether the
codes are bit-identical. Shapes: Llama-3.2-3B's and Llama-3.1-70B's layer groups (q/k/v, o,
gate/up, down). Prints a table and writes JSON + ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# (name, rows, columns, also time the torch loop)
SHAPES = [
    ("3B q/k/v", 5120, 3072, True), ("3B o", 3072, 3072, True),
    ("3B gate/up", 16384, 3072, True), ("3B down", 3072, 8192, True),
    ("70B q/k/v", 10240, 8192, False), ("70B o", 8192, 8192, False),
    ("70B gate/up", 57344, 8192, False), ("70B down", 8192, 28672, True),
]


def _data(rows: int, cols: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(rows, cols, device="cuda", generator=g) * 0.02
    mix = torch.randn(cols, cols, device="cuda", generator=g) / math.sqrt(cols)
    x = torch.randn(2 * cols, cols, device="cuda", generator=g) @ mix
    h = (x.T.double() @ x.double())
    del x, mix
    return w, h, w.abs().amax(1) / 448


def _timed(fn):
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return r, time.perf_counter() - t0


def measure(name: str, rows: int, cols: int, loop: bool, seed: int, repeat: int) -> dict:
    import torch

    from fp8export.numerics import gptq_kernel
    from fp8export.numerics.gptq import gptq_round

    w, h, scale = _data(rows, cols, seed)
    assert gptq_kernel.enabled(w)
    gptq_round(w[:64, :256], h[:256, :256], scale[:64])  # compile the kernel once
    times = []
    for _ in range(repeat):
        fused, sec = _timed(lambda: gptq_round(w, h, scale))
        times.append(sec)
    row = {"shape": name, "rows": rows, "columns": cols,
           "kernel_s": round(statistics.median(times), 4),
           "kernel_ms_per_column": round(1e3 * statistics.median(times) / cols, 4)}
    if loop:
        os.environ["FP8EXPORT_GPTQ_KERNEL"] = "0"
        try:
            ref, sec = _timed(lambda: gptq_round(w, h, scale))
        finally:
            del os.environ["FP8EXPORT_GPTQ_KERNEL"]
        row.update({"loop_s": round(sec, 3), "loop_ms_per_column": round(1e3 * sec / cols, 4),
                    "speedup": round(sec / statistics.median(times), 1),
                    "codes_identical": torch.equal(fused.codes.view(torch.uint8),
                                                   ref.codes.view(torch.uint8))})
    row["output_error_gain"] = round(fused.error_nearest / fused.error_rounded, 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    args = ap.parse_args()
    import torch

    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        args.out.with_suffix(".md").write_text(table(out) + "\n")

    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for i, (name, rows, cols, loop) in enumerate(SHAPES):
        if only and name not in only:
            continue
        row = measure(name, rows, cols, loop, seed=i, repeat=args.repeat)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()
        torch.cuda.empty_cache()
    save()
    print(table(out))


def table(out: dict) -> str:
    lines = [f"# GPTQ's column loop: Triton kernel against the torch loop ({out['device']})", "",
             f"torch {out['torch']}, triton {out['triton']}; `python3 bench/gptq_gpu.py`. "
             "Per-row scales, float32 weights; seconds of one `gptq_round` (the Cholesky of "
             "H⁻¹, the loop, the codes and three output errors in float64).", "",
             "| shape | rows x columns | kernel s | ms/column | torch loop s | ms/column | "
             "speedup | codes identical | error gain vs nearest |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in out["rows"]:
        lines.append(
            f"| {r['shape']} | {r['rows']} x {r['columns']} | {r['kernel_s']} | "
            f"{r['kernel_ms_per_column']} | {r.get('loop_s', '')} | "
            f"{r.get('loop_ms_per_column', '')} | {r.get('speedup', '')} | "
            f"{r.get('codes_identical', '')} | {r['output_error_gain']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
