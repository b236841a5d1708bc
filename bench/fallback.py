#!/usr/bin/env python
"""``convert --accuracy-budget`` on a real decoder: kept parameters, search cost against one
``verify`` run of the same data, the ``default`` gate on held-out text, and how far the
search's estimate is from what held-out text measures.

    python bench/fallback.py --model samples/smollm2/model --budget 0.008 \
        --scales weights --dynamic-activations token --weight-rounding gptq

Steps (one process, same machine state for all):
1. ``convert`` with the recipe and ``--accuracy-budget``; the search runs on
   ``--accuracy-samples`` samples of the calibration text and checks the written folder on the
   samples that follow them. Its cost is what the manifest records (load, score, measurements,
   the written folder's check).
2. The baseline: one ``verify`` of the full-FP8 folder (same recipe, no budget) on the search's
   data (same samples, same sequence length) — what "at most 3x one verify run" compares
   against.
3. ``verify`` of the full-FP8 folder and of the folder convert wrote, on held-out eval text
   (disjoint from the calibration text), with the ``default`` gate.

Writes ``bench/results/fallback.json`` and ``fallback.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import machine_info  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"


def _verify(model: Path, candidate: Path, data: Path, samples: int, seq_len: int, work: Path):
    from fp8export import api
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig

    t0 = time.perf_counter()
    try:
        res = api.verify(VerifyConfig(reference=model, candidate=candidate, data=data,
                                      samples=samples, seq_len=seq_len, backend="torch",
                                      fp8_mode="emulate", device="cpu", write_reports=False,
                                      report_dir=work / "report"))
    except VerificationFailed as failed:
        res = failed.result
    return res, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SAMPLE / "model")
    ap.add_argument("--calib-data", type=Path, default=SAMPLE / "data" / "calib.txt")
    ap.add_argument("--eval-data", type=Path, default=SAMPLE / "data" / "eval.txt")
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--weight-granularity", default="tensor")
    ap.add_argument("--scales", default="calibrate", choices=("calibrate", "weights"))
    ap.add_argument("--dynamic-activations", default="token", choices=("tensor", "token"))
    ap.add_argument("--weight-rounding", default="nearest", choices=("nearest", "gptq"))
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--accuracy-samples", type=int, default=32)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fallback")
    args = ap.parse_args()

    from fp8export import api
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import VerificationFailed

    with tempfile.TemporaryDirectory(prefix="fp8-fallback-") as tmp:
        work = Path(tmp)
        common = dict(checkpoint=args.model, scales=args.scales, calib_data=args.calib_data,
                      calib_samples=args.calib_samples, seq_len=args.seq_len,
                      weight_granularity=args.weight_granularity,
                      dynamic_activations=args.dynamic_activations,
                      weight_rounding=args.weight_rounding)
        # the all-FP8 folder first (quick, and a bad option fails before the search); weight
        # scales with nearest rounding read no calibration text
        needs_data = args.scales == "calibrate" or args.weight_rounding == "gptq"
        api.convert(ConvertConfig(output=work / "full",
                                  **dict(common, calib_data=args.calib_data if needs_data
                                         else None)))
        t0 = time.perf_counter()
        try:
            res = api.convert(ConvertConfig(output=work / "budget", accuracy_budget=args.budget,
                                            accuracy_samples=args.accuracy_samples, **common))
        except VerificationFailed as missed:  # written, over the budget on held-out samples
            res = missed.result
        convert_s = time.perf_counter() - t0
        fb = res.accuracy_budget
        _, baseline_s = _verify(args.model, work / "full", args.calib_data,
                                args.accuracy_samples, args.seq_len, work)
        full, _ = _verify(args.model, work / "full", args.eval_data, args.eval_samples,
                          args.seq_len, work)
        gated, gate_s = _verify(args.model, work / "budget", args.eval_data, args.eval_samples,
                                args.seq_len, work)
    # samples/<name>/model folders are named by their sample
    label = args.model.parent.name if args.model.name == "model" else args.model.name
    doc = {
        "machine": machine_info(REPO), "model": label, "budget_kl": args.budget,
        "weight_granularity": args.weight_granularity, "scales": args.scales,
        "dynamic_activations": args.dynamic_activations,
        "weight_rounding": args.weight_rounding,
        "search": {k: fb.get(k) for k in ("kept_layers", "candidate_layers", "kept_params",
                                          "linear_params", "kept_param_fraction", "kl_all_fp8",
                                          "kl_selected", "kl_selected_interval", "written",
                                          "evaluations", "seconds", "keep", "steps",
                                          "samples", "tokens", "held_out_samples")},
        "convert_with_budget_s": round(convert_s, 1),
        "baseline_verify_same_data_s": round(baseline_s, 1),
        "search_cost_ratio": round(fb["seconds"]["total"] / baseline_s, 2),
        "full_fp8_eval": {"passed": full.passed, **{k: full.metrics.get(k) for k in (
            "top1_agreement", "kl_mean", "cosine_mean", "cosine_min")}},
        "fallback_eval": {"passed": gated.passed, "failures": [f["message"] for f in
                                                                gated.failures],
                          **{k: gated.metrics.get(k) for k in (
                              "top1_agreement", "kl_mean", "cosine_mean", "cosine_min",
                              "ppl_ratio", "tokens")},
                          "confidence": gated.confidence},
        # > 0: held-out text measures more KL than the search estimated on its own data
        "estimate_gap_eval": gated.metrics["kl_mean"] / fb["kl_selected"] - 1.0,
        "estimate_gap_calib_held_out": fb["written"].get("gap"),
        "eval": {"data": args.eval_data.name, "samples": args.eval_samples,
                 "seq_len": args.seq_len},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    s, f, g = doc["search"], doc["full_fp8_eval"], doc["fallback_eval"]
    w = s["written"]
    md = "\n".join([
        f"# convert --accuracy-budget {args.budget} on {label}", "",
        f"Recipe: --scales {args.scales}, weights per {args.weight_granularity}"
        + (f", dynamic activations per {args.dynamic_activations}"
           if args.scales == "weights" else ", calibrator max")
        + f", --weight-rounding {args.weight_rounding}.", "",
        "| | value | target |", "|---|---|---|",
        f"| linears kept in bf16 | {s['kept_layers']} of {s['candidate_layers']} | |",
        f"| linear parameters kept in bf16 | {100 * s['kept_param_fraction']:.1f}% | <= 20% |",
        f"| search cost (load, score, {len(s['evaluations'])} measurements, written check) | "
        f"{s['seconds']['total']:.1f} s | |",
        f"| one verify on the same data ({s['samples']} samples x {args.seq_len}) | "
        f"{doc['baseline_verify_same_data_s']:.1f} s | |",
        f"| search / verify | {doc['search_cost_ratio']:.2f}x | <= 3x |",
        f"| KL on the search data: all FP8 -> kept | {s['kl_all_fp8']:.3e} -> "
        f"{s['kl_selected']:.3e} (written: {s['written']['kl']:.3e}) | <= {args.budget} |",
        f"| held-out eval, all FP8: top-1 / KL / `default` | {f['top1_agreement']:.4f} / "
        f"{f['kl_mean']:.3e} / {'pass' if f['passed'] else 'fail'} | |",
        f"| held-out eval, with fallback: top-1 / KL / `default` | {g['top1_agreement']:.4f} / "
        f"{g['kl_mean']:.3e} / {'pass' if g['passed'] else 'fail'} | pass |",
        f"| written folder on {w.get('samples')} {w.get('data')} calibration samples (manifest) "
        f"| KL {w['kl']:.3e}, gap {100 * (w.get('gap') or 0):+.0f}% | |",
        f"| held-out eval KL against the search's estimate | "
        f"{100 * doc['estimate_gap_eval']:+.0f}% | |",
        f"| verdict confidence on the eval (95% bootstrap) | "
        f"{(g.get('confidence') or {}).get('verdict')} | certain |", "",
        "Steps kept (unit: layers): " + "; ".join(
            f"{st['unit']} ({len(st['layers'])})" for st in (s.get("steps") or [])), "",
        f"Eval: {args.eval_samples} samples x {args.seq_len} tokens of {args.eval_data.name}; "
        f"search data: {s['samples']} samples of {args.calib_data.name}. Shared 2-core machine "
        f"(load {doc['machine']['load_avg_1m_at_start']} at start): the ratio compares runs "
        "made back to back in one process.", ""])
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
