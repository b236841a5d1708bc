#!/usr/bin/env python
"""verify's fixed cost: ``timing.load_s`` against what loading alone costs, same run.

    python bench/verify_load.py                 # the sample (samples/tiny-llama), 3 rounds

Each round runs, each in a fresh interpreter and alternating so drift hits both alike:

* the baseline: ``import torch, transformers``, the reference's tokenizer
  (``AutoTokenizer.from_pretrained``), then one ``from_pretrained`` per model verify runs: the
  reference in bf16, again in fp32 (the noise floor), and the candidate FP8 folder
  (transformers' own compressed-tensors loader; the reference in bf16 stands in where that
  loader refuses the folder, and the JSON says so);
* ``fp8export verify REFERENCE CANDIDATE --data eval.txt --samples N``: its report's
  ``timing.load_s`` (from the start of the run to the models loaded: imports, tokenizer
  check, the three models) and the whole process's wall time.

Target (issue: the CPU paths at their limits): load_s <= 1.5x the baseline. Writes
``bench/results/verify_load.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
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

BASELINE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
t_import = time.perf_counter() - t0
ref, cand = sys.argv[1], sys.argv[2]
AutoTokenizer.from_pretrained(ref, local_files_only=True)
AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16, local_files_only=True)
AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, local_files_only=True)
stand_in = None
try:
    AutoModelForCausalLM.from_pretrained(cand, local_files_only=True)
except Exception as exc:
    stand_in = f"{type(exc).__name__}: {str(exc)[:200]}"
    AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16, local_files_only=True)
print(json.dumps({"seconds": time.perf_counter() - t0, "imports_s": t_import,
                  "candidate_stand_in": stand_in}))
"""


def run_baseline(ref: Path, cand: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", BASELINE, str(ref), str(cand)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_verify(ref: Path, cand: Path, data: Path, samples: int, work: Path, i: int) -> dict:
    rep = work / f"report-{i}"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fp8export.cli", "verify", str(ref), str(cand),
                           "--data", str(data), "--samples", str(samples),
                           "--report-dir", str(rep)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"verify exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    timing = json.loads((rep / "report.json").read_text())["timing"]
    return {"process_s": wall, **timing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SAMPLE / "model")
    ap.add_argument("--data", type=Path, default=SAMPLE / "data" / "eval.txt")
    ap.add_argument("--calib", type=Path, default=SAMPLE / "data" / "calib.txt")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "verify_load")
    args = ap.parse_args()
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": machine_info(REPO), "model": str(args.model.relative_to(REPO))
           if args.model.is_relative_to(REPO) else str(args.model), "samples": args.samples,
           "rounds": []}
    with tempfile.TemporaryDirectory(prefix="verify-load-") as tmp:
        work = Path(tmp)
        cand = work / "fp8"
        subprocess.run([sys.executable, "-m", "fp8export.cli", "convert", str(args.model), "-o",
                        str(cand), "--scales", "calibrate", "--calib-data", str(args.calib)],
                       check=True, capture_output=True)
        for i in range(args.rounds):
            b = run_baseline(args.model, cand)
            v = run_verify(args.model, cand, args.data, args.samples, work, i)
            doc["rounds"].append({"baseline": b, "verify": v})
            print(f"round {i + 1}: baseline {b['seconds']:.2f} s (imports {b['imports_s']:.2f}),"
                  f" verify load_s {v['load_s']:.2f} s (process {v['process_s']:.2f} s)",
                  flush=True)
    doc["machine"]["load_avg_1m_at_end"] = machine_info(REPO)["load_avg_1m_at_start"]
    base = statistics.median(r["baseline"]["seconds"] for r in doc["rounds"])
    load = statistics.median(r["verify"]["load_s"] for r in doc["rounds"])
    ratio = load / base
    doc["summary"] = {"baseline_s": round(base, 3), "load_s": round(load, 3),
                      "ratio": round(ratio, 3), "target": 1.5, "met": ratio <= 1.5}
    stand_in = doc["rounds"][0]["baseline"]["candidate_stand_in"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    m = doc["machine"]
    lines = ["# verify's fixed cost", "",
             f"`bench/verify_load.py` on {doc['date']}, commit {m['git_commit']}, "
             f"{args.rounds} rounds alternated, medians; {doc['model']}, {args.samples} "
             "samples; load average "
             f"{m['load_avg_1m_at_start']} at start, {m['load_avg_1m_at_end']} at end.", "",
             "Baseline (fresh interpreter): import torch + transformers, the tokenizer, "
             "from_pretrained of the reference in bf16 and in fp32, and of the candidate" +
             (f" (transformers refused the folder: {stand_in}; the reference in bf16 stands "
              "in)" if stand_in else "") + ".", "",
             "| round | baseline s (imports s) | verify load_s | verify process s |",
             "|---|---|---|---|"]
    for i, r in enumerate(doc["rounds"], 1):
        lines.append(f"| {i} | {r['baseline']['seconds']:.2f} ({r['baseline']['imports_s']:.2f})"
                     f" | {r['verify']['load_s']:.2f} | {r['verify']['process_s']:.2f} |")
    lines += ["", f"load_s / baseline (medians): **{ratio:.2f}x** (target <= 1.5x: "
              f"{'met' if ratio <= 1.5 else 'NOT met'})."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
