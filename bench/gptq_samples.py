#!/usr/bin/env python
"""``--weight-rounding gptq`` with 12, 64 and 256 calibration samples on SmolLM2-135M: per layer,
the output error of the written codes against nearest rounding on held-out inputs, and the
model's KL on held-out text.

    python bench/gptq_samples.py --model samples/smollm2/model

For each sample count: ``convert --scales weights --weight-rounding gptq --calib-samples N``
on ``calib.txt`` (every fourth sample held out of the fit and used to choose, per layer,
between GPTQ and nearest rounding). Then, on ``--eval-samples`` lines of ``eval.txt`` (text no
calibration step saw): each layer's inputs in the bf16 model give ``H = Σ x xᵀ``, and the
output error ``tr(ΔW H ΔWᵀ)`` of the written codes is compared with nearest rounding's (the
folder converted without GPTQ); and the model's KL(bf16 || FP8) per token with its 95%
interval (``bench/margin.py``'s code). Writes ``bench/results/gptq_samples.json`` / ``.md``.
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
from bench.margin import kl_of, reference_logits  # noqa: E402

DATA = REPO / "samples" / "tiny-llama" / "data"


def layer_errors(model_dir: Path, folder: Path, near: Path, eval_hess) -> dict:
    """Per quantized layer: output error of ``folder``'s codes and of ``near``'s on eval."""
    import torch
    from safetensors import safe_open

    from fp8export.models import load_model
    from fp8export.numerics.gptq import output_error

    ref, _ = load_model(model_dir, dtype=torch.float32, device="cpu")
    man = json.loads((folder / "fp8export.json").read_text())["quantized"]
    out = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as fg, \
            safe_open(str(near / "model.safetensors"), "pt") as fn:
        for m in man:
            h, _ = eval_hess.of(m)
            if h is None:
                continue
            w = ref.get_submodule(m).weight.detach().float()

            def deq(f):
                return f.get_tensor(f"{m}.weight").float() * \
                    f.get_tensor(f"{m}.weight_scale").float()

            out[m] = {"gptq": output_error(w, deq(fg), h), "nearest": output_error(w, deq(fn), h),
                      "method": man[m].get("weight_rounding")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "samples" / "smollm2" / "model")
    ap.add_argument("--samples", type=int, nargs="+", default=[12, 64, 256])
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--no-kl", action="store_true",
                    help="per-layer errors only (no model forward on the eval text)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gptq_samples")
    args = ap.parse_args()
    from fp8export import api
    from fp8export.calibration.hessian import input_hessians
    from fp8export.convert.config import ConvertConfig
    from fp8export.inputs.eval_data import load_verify_samples
    from fp8export.inputs.samples import iter_batches

    cfg = json.loads((args.model / "config.json").read_text())
    doc = {"machine": machine_info(REPO), "model": args.model.parent.name,
           "eval": {"data": "eval.txt", "samples": args.eval_samples, "seq_len": args.seq_len},
           "rows": []}
    with tempfile.TemporaryDirectory(prefix="accuracy-gptq-") as tmp:
        work = Path(tmp)
        near = work / "nearest"
        api.convert(ConvertConfig(checkpoint=args.model, output=near, scales="weights"))
        mods = list(json.loads((near / "fp8export.json").read_text())["quantized"])
        groups: dict[str, list[str]] = {}
        for m, e in json.loads((near / "fp8export.json").read_text())["quantized"].items():
            if e["fused_group"]:
                groups.setdefault(e["fused_group"], []).append(m)
        eval_hess = input_hessians(args.model, DATA / "eval.txt", mods, groups,
                                   samples=args.eval_samples, seq_len=args.seq_len,
                                   batch_size=8, device="cpu")
        s, _ = load_verify_samples(DATA / "eval.txt", args.model, cfg,
                                   samples=args.eval_samples, seq_len=args.seq_len)
        batches = [(b.input_ids, b.attention_mask) for b in iter_batches(s, 4)]
        if args.no_kl:
            doc["nearest"] = {}
        else:
            ref, per_sample = reference_logits(args.model, batches, work / "ref.npy")
            doc["nearest"] = kl_of(near, batches, ref, per_sample)
        for n in args.samples:
            folder = work / f"gptq-{n}"
            t0 = time.perf_counter()
            api.convert(ConvertConfig(checkpoint=args.model, output=folder, scales="weights",
                                      weight_rounding="gptq", calib_data=DATA / "calib.txt",
                                      calib_samples=n, seq_len=args.seq_len))
            secs = time.perf_counter() - t0
            entry = json.loads((folder / "fp8export.json").read_text())["weight_rounding"]
            errs = layer_errors(args.model, folder, near, eval_hess)
            worse = sorted(m for m, e in errs.items() if e["gptq"] > e["nearest"] * (1 + 1e-9))
            gains = sorted(10 * __import__("math").log10(e["nearest"] / e["gptq"])
                           for e in errs.values() if e["gptq"] > 0)
            row = {"calib_samples": n, "fitted_samples": entry["samples"],
                   "held_out_samples": entry["held_out_samples"], "tokens": entry["tokens"],
                   "layers": entry["layers"], "gptq_layers": entry["gptq_layers"],
                   "nearest_by_check": len(entry["nearest_by_check"]),
                   "fewer_tokens_than_inputs": len(entry["fewer_tokens_than_inputs"]),
                   "eval_layers_worse_than_nearest": worse,
                   "eval_gain_db_min": gains[0], "eval_gain_db_median": gains[len(gains) // 2],
                   "convert_s": round(secs, 1),
                   # kl_of's own "tokens" (the eval text's) must not overwrite the fitted count
                   **({} if args.no_kl else {("eval_tokens" if k == "tokens" else k): v for k, v
                                              in kl_of(folder, batches, ref, per_sample).items()})}
            doc["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "eval_layers_worse_than"
                              "_nearest"}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    b = doc["nearest"] or {"kl_mean": float("nan"), "interval": [float("nan")] * 2}
    lines = [f"# --weight-rounding gptq by calibration samples ({doc['model']})", "",
             f"Held-out: {args.eval_samples} lines of eval.txt x {args.seq_len} tokens; "
             f"calibration: calib.txt; CPU, load {doc['machine']['load_avg_1m_at_start']} at "
             "start. Nearest rounding (same scales, same format): KL "
             f"{b['kl_mean']:.4f} [{b['interval'][0]:.4f}, {b['interval'][1]:.4f}].", "",
             "| calib samples (fit + held out) | tokens fitted | layers GPTQ / nearest by the "
             "check | layers worse than nearest on eval | eval gain min / median dB | KL "
             "[95%] | top-1 |", "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['calib_samples']} ({r['fitted_samples']} + "
                     f"{r['held_out_samples']}) | {r['tokens']} | {r['gptq_layers']} / "
                     f"{r['nearest_by_check']} | {len(r['eval_layers_worse_than_nearest'])} "
                     f"of {r['layers']} | {r['eval_gain_db_min']:.2f} / "
                     f"{r['eval_gain_db_median']:.2f} | " + (
                         f"{r['kl_mean']:.4f} [{r['interval'][0]:.4f}, {r['interval'][1]:.4f}]"
                         f" | {r['top1_agreement']:.4f} |" if "kl_mean" in r else "– | – |"))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
