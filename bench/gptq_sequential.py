#!/usr/bin/env python
"""Sequential GPTQ against the parallel variant, on the same model, data and held-out text.

    python bench/gptq_sequential.py --model samples/smollm2/model      # SmolLM2-135M (CPU)

``convert --weight-rounding gptq`` takes every layer's input matrix from the bf16 model (one
pass); ``gptq-sequential`` from the layers before it as they will be written (llm-compressor's
sequential pipeline). Both convert with the same calibrated static input scales (one
``fp8export calibrate`` run, reused with ``--calib-amax``) and the same GPTQ samples; both are
verified against the bf16 model on held-out text (``samples/tiny-llama/data/eval.txt``: no
sample of the calibration file). Reported: KL(bf16‖FP8) per token with verify's 95 % bootstrap
interval, top-1 agreement, and the paired difference of the per-sample KL (the same samples
resampled together, 2,000 times) with its 95 % interval: sequential beats parallel when that
interval lies below zero.

Writes ``bench/results/gptq_sequential.json`` and ``.md`` (``--out``).
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

DATA = REPO / "samples" / "tiny-llama" / "data"


def interval(rows: list[dict], rounds: int = 2000, seed: int = 0) -> list[float]:
    """95 % bootstrap interval (samples resampled with their tokens) of the KL per token."""
    import numpy as np

    k = np.array([r["kl_mean"] * r["tokens"] for r in rows])
    n = np.array([r["tokens"] for r in rows], dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(n), size=(rounds, len(n)))
    return [float(x) for x in np.percentile(k[idx].sum(1) / n[idx].sum(1), [2.5, 97.5])]


def paired(a: list[dict], b: list[dict], rounds: int = 2000, seed: int = 0) -> dict:
    """KL per token of ``b`` minus ``a`` over the same samples, with a paired bootstrap 95 %
    interval (samples resampled with their tokens)."""
    import numpy as np

    ka = np.array([r["kl_mean"] * r["tokens"] for r in a])
    kb = np.array([r["kl_mean"] * r["tokens"] for r in b])
    n = np.array([r["tokens"] for r in a], dtype=float)
    assert [r["index"] for r in a] == [r["index"] for r in b]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(n), size=(rounds, len(n)))
    diff = (kb[idx].sum(1) - ka[idx].sum(1)) / n[idx].sum(1)
    lo, hi = np.percentile(diff, [2.5, 97.5])
    return {"kl_difference": float((kb.sum() - ka.sum()) / n.sum()),
            "interval": [float(lo), float(hi)], "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" /
                    "gptq_sequential.json")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.convert.config import ConvertConfig
    from fp8export.verify.config import VerifyConfig

    work = Path(tempfile.mkdtemp(prefix="fp8export-gptq-seq-"))
    amax = work / "amax.json"
    api.calibrate(CalibrateConfig(checkpoint=args.model, calib_data=DATA / "calib.txt",
                                  output=amax, calib_samples=args.calib_samples,
                                  seq_len=args.seq_len, device=args.device))
    out: dict = {"model": str(args.model), "calib": "samples/tiny-llama/data/calib.txt",
                 "eval": "samples/tiny-llama/data/eval.txt", "args": {
                     k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for rounding in ("nearest", "gptq", "gptq-sequential"):
        folder = work / rounding
        t0 = time.perf_counter()
        api.convert(ConvertConfig(checkpoint=args.model, output=folder, calib_amax=amax,
                                  calib_data=DATA / "calib.txt", weight_rounding=rounding,
                                  calib_samples=args.calib_samples, seq_len=args.seq_len,
                                  device=args.device))
        convert_s = time.perf_counter() - t0
        res = api.verify(VerifyConfig(reference=args.model, candidate=folder,
                                      data=DATA / "eval.txt", samples=args.eval_samples,
                                      seq_len=args.seq_len, device=args.device,
                                      noise_floor=False, thresholds="loose",
                                      write_reports=False))
        rows = [{"index": r["index"], "tokens": r["tokens"], "kl_mean": r["kl_mean"]}
                for r in res.per_sample]
        manifest = json.loads((folder / "fp8export.json").read_text())
        out["runs"][rounding] = {
            "kl_mean": res.metrics["kl_mean"], "kl_interval": interval(rows),
            "top1_agreement": res.metrics["top1_agreement"],
            "ppl_ratio": res.metrics.get("ppl_ratio"), "tokens": res.metrics["tokens"],
            "samples": res.samples, "convert_s": round(convert_s, 1),
            "rounding": manifest.get("weight_rounding"),
            "per_sample": rows}
        args.out.write_text(json.dumps(out, indent=1))
    runs = out["runs"]
    out["sequential_minus_parallel"] = paired(runs["gptq"]["per_sample"],
                                              runs["gptq-sequential"]["per_sample"])
    args.out.write_text(json.dumps(out, indent=1))
    args.out.with_suffix(".md").write_text(render(out) + "\n")
    print(render(out))


def render(out: dict) -> str:
    lines = [f"model {Path(out['model']).name}; calibration {out['calib']}, held-out "
             f"{out['eval']}", "",
             "| rounding | KL(bf16‖FP8) per token | 95 % interval | top-1 | convert s |",
             "|---|---|---|---|---|"]
    for name, r in out["runs"].items():
        iv = r["kl_interval"]
        shown = f"{iv[0]:.3e} – {iv[1]:.3e}" if isinstance(iv, list) else "-"
        lines.append(f"| {name} | {r['kl_mean']:.3e} | {shown} | {r['top1_agreement']:.4f} | "
                     f"{r['convert_s']} |")
    d = out.get("sequential_minus_parallel")
    if d:
        verdict = ("sequential is better" if d["interval"][1] < 0 else
                   "parallel is better" if d["interval"][0] > 0 else
                   "no difference the data can resolve")
        lines += ["", f"sequential − parallel: {d['kl_difference']:+.3e} per token, paired "
                  f"95 % interval {d['interval'][0]:+.3e} … {d['interval'][1]:+.3e} "
                  f"({d['rounds']} resamples): {verdict}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
