#!/usr/bin/env python3
"""What the FP8 KV cache and FP8 attention cost in accuracy, measured the way a user does.

For each model: ``fp8export convert --scales calibrate --kv-cache fp8`` (static per-tensor FP8
linears, k_scale/v_scale calibrated on the keys after RoPE and the values), then one
``fp8export verify --attention fp8`` run, which measures three configurations on the same
batches against the bf16 reference: FP8 linears only (16-bit KV cache and attention), + the FP8
KV cache (E4M3 keys and values, 16-bit attention on them), + FP8 attention on that cache (the
judged one). On a CPU the attention is ``runtime/attention_math.py``, the emulation of the GPU
kernel. Each row carries KL mean, top-1 agreement and KL p99 with 95% bootstrap intervals over
samples, read back from ``report.json`` (``attention_cost``).

    .venv/bin/python bench/kv_attention_cost.py                      # the sample and SmolLM2
    .venv/bin/python bench/kv_attention_cost.py --models sample      # the sample only

SmolLM2-135M needs ``samples/smollm2/model`` (``samples/smollm2/build.py``). Writes
``bench/results/kv_attention_cost.json`` and ``.md``; the folders go under ``--work`` and are
deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_info  # noqa: E402

DATA = REPO / "samples/tiny-llama/data"
# name -> (model folder, calibration samples, eval samples, tokens per sample)
MODELS = {
    "sample": (REPO / "samples/tiny-llama/model", 256, 64, 128),
    "smollm2": (REPO / "samples/smollm2/model", 64, 32, 128),
}
METRICS = ("kl_mean", "top1_agreement", "kl_p99")


def run(cmd: list[str], log: Path) -> float:
    """Run one CLI command, its output into ``log``; its wall seconds (exit 0 or 3 expected:
    verify exits 3 when the judged configuration misses its thresholds, and still writes the
    reports)."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if rc not in (0, 3):
        sys.exit(f"{' '.join(cmd)} exited {rc}; see {log}")
    return round(time.perf_counter() - t0, 1)


def measure(name: str, model: Path, calib: int, samples: int, seq_len: int, work: Path,
            reuse: bool = False) -> dict:
    if not (model / "config.json").is_file():
        sys.exit(f"{model} is missing; build it first (samples/smollm2/build.py for SmolLM2).")
    fp8, reports = work / f"{name}-fp8", work / f"{name}-report"
    cli = [sys.executable, str(REPO / "cli.py")]
    log = work / f"{name}-convert.log"
    done = re.search(r"PASSED \| convert \| ([\d.]+)s", log.read_text()) if log.is_file() else None
    if reuse and done and (fp8 / "fp8export.json").is_file():
        convert_s, reused = float(done.group(1)), True  # this script's own earlier convert
    else:
        convert_s, reused = run([*cli, "convert", str(model), "-o", str(fp8), "--scales",
                                 "calibrate", "--calib-data", str(DATA / "calib.txt"),
                                 "--calib-samples", str(calib), "--seq-len", str(seq_len),
                                 "--kv-cache", "fp8", "--force"], log), False
    verify_s = run([*cli, "verify", str(model), str(fp8), "--data", str(DATA / "eval.txt"),
                    "--samples", str(samples), "--seq-len", str(seq_len), "--attention", "fp8",
                    "--no-noise-floor", "--device", "cpu", "--timeout", "0", "--report-dir",
                    str(reports), "--force"], work / f"{name}-verify.log")
    report = json.loads((reports / "report.json").read_text())
    cost = report["attention_cost"]
    return {"model": str(model.relative_to(REPO)), "calib_samples": calib,
            "eval_samples": report["samples"], "seq_len": seq_len,
            "tokens": report.get("data", {}).get("tokens"), "passed": report["passed"],
            "kv_cache": cost["kv_cache"], "rows": cost["rows"],
            "seconds": {"convert": convert_s, "verify": verify_s},
            "convert_reused": reused}


def fmt(value, interval) -> str:
    if value is None:
        return "–"
    text = f"{value:.4f}" if isinstance(value, float) and value > 0.01 else f"{value:.3g}"
    if interval:
        lo, hi = interval
        return f"{text} [{lo:.3g}, {hi:.3g}]"
    return text


def markdown(result: dict) -> str:
    lines = ["# What the FP8 KV cache and FP8 attention cost (`verify --attention fp8`)", "",
             "Written by `bench/kv_attention_cost.py` from `kv_attention_cost.json`; CPU "
             "(the attention is the kernel's emulation, `runtime/attention_math.py`). Each "
             "configuration against the bf16 reference on the same samples; 95% bootstrap "
             "intervals over samples.", ""]
    for name, m in result["models"].items():
        lines += [f"## {name}: `{m['model']}`", "",
                  f"`convert --scales calibrate --kv-cache fp8` on {m['calib_samples']} lines of "
                  f"`calib.txt`; verified on {m['eval_samples']} lines of `eval.txt` "
                  f"({m['tokens']} tokens, {m['seq_len']} tokens per sample at most). "
                  f"convert {m['seconds']['convert']} s"
                  + (" (an earlier run of this script; reused)" if m.get("convert_reused")
                     else "") + f", verify {m['seconds']['verify']} s (a shared 2-core machine "
                  f"under a load of {result['machine']['load_avg_1m_at_start']} at the start).",
                  "",
                  "| configuration | KL mean | top-1 agreement | KL p99 |", "|---|---|---|---|"]
        for row in m["rows"]:
            cells = [fmt(row.get(k), row.get(f"{k}_interval")) for k in METRICS]
            lines.append(f"| {row['configuration']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="sample,smollm2", help="comma separated: "
                    + ", ".join(MODELS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8export-kv-cost"))
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/kv_attention_cost.json")
    ap.add_argument("--keep", action="store_true", help="keep the folders and logs in --work")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a folder this script converted in --work before (its convert "
                         "log says PASSED; its time is reported, marked reused)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(REPO), "models": {}}
    for name in args.models.split(","):
        model, calib, samples, seq_len = MODELS[name]
        print(f"{name}: convert + verify --attention fp8 ...", flush=True)
        result["models"][name] = measure(name, model, calib, samples, seq_len, args.work,
                                         args.reuse)
        for row in result["models"][name]["rows"]:
            print("  " + row["configuration"] + ": " + ", ".join(
                f"{k} {fmt(row.get(k), row.get(f'{k}_interval'))}" for k in METRICS), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
