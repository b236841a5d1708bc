#!/usr/bin/env python
"""16-bit linears in fp32 on CPUs without 16-bit matrix units (``fp8export/cpu_gemm.py``):
``verify`` and ``calibrate`` of the sample with torch's own bf16 kernel
(``FP8EXPORT_CPU_GEMM=native``, the baseline) and with the conversion, alternated, same run.

    python bench/cpu_gemm.py --rounds 2

Each run is the CLI in a fresh process (wall time, and verify's report: its ``timing`` and
KL, which must agree to the last digits that matter); plus one GEMM of the sample's MLP shape
in both ways. Writes ``bench/results/cpu_gemm.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import machine_info  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"


def gemm_seconds() -> dict:
    import torch

    a, b = torch.randn(2048, 256), torch.randn(256, 1024)
    out = {"mkldnn_bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for name, fn in (("fp32", lambda: a @ b),
                     ("bf16 native", lambda: a.bfloat16() @ b.bfloat16()),
                     ("bf16 via fp32", lambda: (a.bfloat16().float() @ b.bfloat16().float())
                      .bfloat16())):
        fn()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        out[name] = (time.perf_counter() - t0) / 5
    return out


def run(argv: list[str], gemm: str) -> float:
    env = {**os.environ, "FP8EXPORT_CPU_GEMM": gemm}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fp8export.cli", *argv], check=True, env=env,
                   capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu_gemm")
    args = ap.parse_args()
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": machine_info(REPO), "gemm_2048x256x1024_s": gemm_seconds(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="cpu-gemm-") as tmp:
        work = Path(tmp)
        cand = work / "fp8"
        subprocess.run([sys.executable, "-m", "fp8export.cli", "convert", str(SAMPLE / "model"),
                        "-o", str(cand)], check=True, capture_output=True)
        for i in range(args.rounds):
            for gemm in ("native", "fp32"):
                rep = work / f"rep-{gemm}-{i}"
                v = run(["verify", str(SAMPLE / "model"), str(cand), "--data",
                         str(SAMPLE / "data" / "eval.txt"), "--samples", str(args.samples),
                         "--report-dir", str(rep)], gemm)
                report = json.loads((rep / "report.json").read_text())
                c = run(["calibrate", str(SAMPLE / "model"), "--calib-data",
                         str(SAMPLE / "data" / "calib.txt"), "--calib-samples", "128", "-o",
                         str(work / f"amax-{gemm}-{i}.json")], gemm)
                doc["runs"].append({"round": i + 1, "gemm": gemm, "verify_s": v,
                                    "verify_timing": report["timing"],
                                    "kl_mean": report["metrics"]["kl_mean"],
                                    "top1_agreement": report["metrics"]["top1_agreement"],
                                    "calibrate_s": c})
                print(json.dumps(doc["runs"][-1]), flush=True)
    med = {g: {k: statistics.median(r[k] for r in doc["runs"] if r["gemm"] == g)
               for k in ("verify_s", "calibrate_s", "kl_mean")} for g in ("native", "fp32")}
    doc["medians"] = med
    doc["machine"]["load_avg_1m_at_end"] = machine_info(REPO)["load_avg_1m_at_start"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    g = doc["gemm_2048x256x1024_s"]
    m = doc["machine"]
    lines = ["# 16-bit linears in fp32 on CPUs without 16-bit matrix units", "",
             f"`bench/cpu_gemm.py` on {doc['date']}, commit {m['git_commit']}; CPU "
             f"{g['cpu_capability']}, mkldnn bf16 supported: {g['mkldnn_bf16_supported']}; load "
             f"average {m['load_avg_1m_at_start']} at start, {m['load_avg_1m_at_end']} at end; "
             f"{args.rounds} rounds alternated, medians.", "",
             f"One GEMM 2048x256 @ 256x1024: fp32 {g['fp32'] * 1e3:.1f} ms, bf16 with torch's "
             f"kernel {g['bf16 native'] * 1e3:.1f} ms, bf16 through fp32 "
             f"{g['bf16 via fp32'] * 1e3:.1f} ms.", "",
             "| run (CLI, fresh process) | torch's bf16 kernel | fp32 GEMMs | speed-up |",
             "|---|---|---|---|"]
    for key, label in (("verify_s", f"verify, sample, {args.samples} samples (s)"),
                       ("calibrate_s", "calibrate, sample, 128 samples (s)")):
        a, b = med["native"][key], med["fp32"][key]
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    lines += ["", f"verify's KL: {med['native']['kl_mean']:.6e} with torch's kernel, "
              f"{med['fp32']['kl_mean']:.6e} with fp32 GEMMs."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
