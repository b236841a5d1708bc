#!/usr/bin/env python
"""``convert --accuracy-budget`` at three budgets per model: the kept fraction (monotone: a
tighter budget keeps at least as much), the search's KL, and the written folder's KL on
held-out calibration samples no calibration step and no search step read (``met``).

    python bench/budget.py                               # SmolLM2-135M + two family models
    python bench/budget.py --models smollm2 --samples 32

Budgets are fractions of each model's all-FP8 KL (measured by a first run with a budget every
model meets), so each asks for keeping something: 0.8x, 0.5x and 0.25x; or absolute values
with ``--budgets`` (no first run). Models already in the results file and not run again keep
their rows. A budget no FP8 layer can meet is
recorded as refused. Every run is the real ``api.convert`` (the recipe below, calibration text
``samples/tiny-llama/data/calib.txt``), one after another on this machine; results are written
after each run to ``bench/results/budget.json`` and ``budget.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests" / "families"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench._common import machine_info  # noqa: E402

DATA = REPO / "samples" / "tiny-llama" / "data" / "calib.txt"
FRACTIONS = (0.8, 0.5, 0.25)


def model_path(name: str, work: Path) -> Path:
    if name == "smollm2":
        path = REPO / "samples" / "smollm2" / "model"
        if not (path / "config.json").exists():
            sys.exit("build samples/smollm2/model first (samples/smollm2/README.md)")
        return path
    from model_families import save_family

    return save_family(name, work / name)


def one(src: Path, out: Path, budget: float, args) -> dict:
    from fp8export import api
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import Fp8ExportError, VerificationFailed

    t0 = time.perf_counter()
    row: dict = {"budget": budget}
    try:
        res = api.convert(ConvertConfig(
            checkpoint=src, output=out, calib_data=DATA, scales="weights",
            dynamic_activations="token", weight_rounding=args.rounding,
            accuracy_budget=budget, accuracy_samples=args.samples, seq_len=args.seq_len,
            calib_samples=args.calib_samples, force=True))
        b = res.accuracy_budget
    except VerificationFailed as missed:
        b = missed.result.accuracy_budget
    except Fp8ExportError as exc:
        row.update(outcome="refused", message=str(exc)[:300],
                   seconds=round(time.perf_counter() - t0, 1))
        return row
    w = b["written"]
    row.update(outcome="met" if b["met"] else "missed",
               kept_param_fraction=b["kept_param_fraction"], kept_layers=b["kept_layers"],
               candidate_layers=b["candidate_layers"], kl_all_fp8=b["kl_all_fp8"],
               kl_selected=b["kl_selected"], kl_selected_interval=b["kl_selected_interval"],
               held_out_kl=w["kl"], held_out_interval=w["interval"],
               held_out_samples=w["samples"], held_out_top1=w["top1_agreement"],
               met=b["met"], split=b["split"], measurements=len(b["evaluations"]),
               seconds=round(time.perf_counter() - t0, 1))
    return row


def _budget(r: dict) -> str:
    return f"{r['budget']:.3e}" + (f" ({r['fraction']})" if r.get("fraction") else "")


def render(doc: dict) -> str:
    lines = ["# convert --accuracy-budget at three budgets per model", "",
             f"Recipe: per-tensor weights, dynamic per-token activations, --weight-rounding "
             f"{doc['rounding']}; calibration text {DATA.name}; search on "
             f"{doc['samples']} samples x {doc['seq_len']} tokens that no calibration step "
             f"read, the written folder checked on the next {doc['samples'] // 2}. Machine: "
             f"{doc['machine']['cores']} cores, load {doc['machine']['load_avg_1m_at_start']} "
             "at start (shared).", "",
             "| model | budget (x all-FP8) | outcome | linear params kept | search KL [95%] | "
             "held-out KL [95%] | measurements | s |", "|---|---|---|---|---|---|---|---|"]
    for m in doc["models"]:
        for r in m["runs"]:
            if r["outcome"] == "refused":
                lines.append(f"| {m['model']} | {_budget(r)} | refused "
                             f"(exit 1) | – | – | – | – | {r['seconds']} |")
                continue
            si, hi = r["kl_selected_interval"] or [0, 0], r["held_out_interval"] or [0, 0]
            lines.append(
                f"| {m['model']} | {_budget(r)} | "
                f"{'met' if r['met'] else 'missed (exit 3)'} | "
                f"{100 * r['kept_param_fraction']:.1f}% ({r['kept_layers']}/"
                f"{r['candidate_layers']}) | {r['kl_selected']:.3e} [{si[0]:.2e}, {si[1]:.2e}] "
                f"| {r['held_out_kl']:.3e} [{hi[0]:.2e}, {hi[1]:.2e}] | {r['measurements']} | "
                f"{r['seconds']} |")
        mono = m.get("monotone")
        lines.append(f"| {m['model']} | monotone: {mono} | | | | | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2", "mixtral", "smollm2"])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--calib-samples", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounding", default="nearest", choices=("nearest", "gptq"))
    ap.add_argument("--budgets", type=float, nargs=3, default=None,
                    help="absolute KL budgets, loosest first (default: fractions of the "
                         "all-FP8 KL)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "budget")
    args = ap.parse_args()
    doc = {"machine": machine_info(REPO), "rounding": args.rounding, "samples": args.samples,
           "seq_len": args.seq_len, "fractions": list(FRACTIONS), "models": []}
    old = args.out.with_suffix(".json")
    if old.exists():  # rows of models not run again stay
        doc["models"] = [m for m in json.loads(old.read_text())["models"]
                         if m["model"] not in args.models]
    with tempfile.TemporaryDirectory(prefix="accuracy-budget-") as tmp:
        work = Path(tmp)
        for name in args.models:
            src = model_path(name, work)
            entry = {"model": name, "runs": []}
            doc["models"].append(entry)
            if args.budgets:
                budgets = [(b, None) for b in args.budgets]
            else:  # the all-FP8 KL: a budget every model meets with nothing kept
                kl_all = one(src, work / "probe", 1.0, args)["kl_all_fp8"]
                entry["kl_all_fp8"] = kl_all
                budgets = [(kl_all * f, f) for f in FRACTIONS]
            for budget, f in budgets:
                row = one(src, work / "out", budget, args)
                row.update(fraction=f, samples=args.samples, rounding=args.rounding)
                entry["runs"].append(row)
                print(json.dumps(row)[:400], flush=True)
                kept = [r.get("kept_param_fraction", 1.0) for r in entry["runs"]]
                entry["monotone"] = kept == sorted(kept)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
                args.out.with_suffix(".md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
