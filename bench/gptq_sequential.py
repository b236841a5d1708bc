#!/usr/bin/env python
"""Sequential GPTQ against the parallel variant, on the same model, data and held-out text.

    python bench/gptq_sequential.py --model samples/smollm2/model --threads 1   # SmolLM2-135M

``convert --weight-rounding gptq`` takes every layer's input matrix from the bf16 model (one
pass); ``gptq-sequential`` from the layers before it as they will be written (llm-compressor's
sequential pipeline). For each activation setting (``--activations``): ``dynamic``, per-token
input scales (``--scales weights``, the recommended small-model recipe and the setting of the
published GPTQ figures in ``margin-smollm2*.md`` / ``gptq_samples.md``), and ``static``, the
per-tensor input scales of one ``fp8export calibrate`` run reused by every convert
(``--calib-amax``), the model is converted with nearest rounding, ``gptq`` and
``gptq-sequential`` (the same calibration samples of ``calib.txt``, the same held-out quarter).

Every folder is measured by ``bench/margin.py``'s metric code (the one of the published
figures): the bf16 reference's logits of ``--eval-samples`` lines of
``samples/tiny-llama/data/eval.txt`` (no line of ``calib.txt``) computed once, each folder run
by the FP8 runtime (emulation) and its KL(bf16‖FP8) per token taken with its 95 % bootstrap
interval (samples resampled with their tokens) and top-1 agreement. The paired difference
sequential − parallel resamples the same samples for both (2,000 draws, ``analysis.
confidence.draws``): sequential beats parallel only when its interval lies below zero.
Recorded beside: which quantized weights hold the same E4M3 codes in both GPTQ folders (the
first decoder layer should: its inputs are the bf16 model's either way).

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

from bench._common import machine_info  # noqa: E402
from bench.margin import kl_of, reference_logits  # noqa: E402

DATA = REPO / "samples" / "tiny-llama" / "data"
ROUNDINGS = ("nearest", "gptq", "gptq-sequential")
PAIRED_DRAWS = 2000


def paired(a: list[float], b: list[float], tokens: list[int], draws: int = PAIRED_DRAWS
           ) -> dict:
    """KL per token of ``b`` minus ``a`` (per-sample KL sums over the same samples, in the same
    order) with its paired bootstrap 95 % interval: each draw weighs both by the same sample
    counts (``analysis.confidence``'s draws, seed 0)."""
    import numpy as np

    from fp8export.analysis.confidence import draws as sample_draws

    ka, kb, n = (np.asarray(x, dtype=np.float64) for x in (a, b, tokens))
    if not len(ka) == len(kb) == len(n):
        raise ValueError(f"unpaired: {len(ka)}, {len(kb)} and {len(n)} samples")
    w = sample_draws(len(n), draws)
    diff = (w @ kb - w @ ka) / (w @ n)
    lo, hi = np.percentile(diff, [2.5, 97.5])
    return {"kl_difference": float((kb.sum() - ka.sum()) / n.sum()),
            "relative": float(kb.sum() / ka.sum() - 1),
            "interval": [float(lo), float(hi)], "draws": draws,
            "samples_lower": int((kb < ka).sum()), "samples": len(n)}


def verdict(d: dict) -> str:
    lo, hi = d["interval"]
    return ("sequential is better" if hi < 0 else "parallel is better" if lo > 0 else
            "no difference the data can resolve")


def same_codes(a: Path, b: Path) -> dict:
    """Quantized weights (E4M3) of folders ``a`` and ``b``: how many, and which hold the same
    codes in both."""
    import torch
    from safetensors import safe_open

    def codes(folder: Path) -> dict:
        out = {}
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    t = f.get_tensor(k)
                    if t.dtype == torch.float8_e4m3fn:
                        out[k] = t.view(torch.uint8)
        return out

    ca, cb = codes(a), codes(b)
    if set(ca) != set(cb):
        raise ValueError(f"{a} and {b} quantize different weights")
    same = sorted(k for k in ca if torch.equal(ca[k], cb[k]))
    return {"weights": len(ca), "identical": len(same), "identical_names": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "samples" / "smollm2" / "model")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" /
                    "gptq_sequential.json")
    ap.add_argument("--activations", nargs="+", choices=("dynamic", "static"),
                    default=["dynamic", "static"])
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="batch of the KL passes (margin.py's)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 on a shared machine: GPTQ's small steps slow down "
                         "badly when threads wait on each other)")
    args = ap.parse_args()
    import torch

    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.convert.config import ConvertConfig
    from fp8export.inputs.eval_data import load_verify_samples
    from fp8export.inputs.samples import iter_batches

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = json.loads((args.model / "config.json").read_text())
    out: dict = {"machine": machine_info(REPO), "model": args.model.parent.name,
                 "torch_threads": torch.get_num_threads(),
                 "calib": {"data": "samples/tiny-llama/data/calib.txt",
                           "samples": args.calib_samples, "seq_len": args.seq_len},
                 "eval": {"data": "samples/tiny-llama/data/eval.txt",
                          "samples": args.eval_samples, "seq_len": args.seq_len},
                 "settings": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="gptqseq-") as tmp:
        work = Path(tmp)
        s, _ = load_verify_samples(DATA / "eval.txt", args.model, cfg,
                                   samples=args.eval_samples, seq_len=args.seq_len)
        batches = [(b.input_ids, b.attention_mask) for b in iter_batches(s, args.batch)]
        t0 = time.perf_counter()
        ref, per_sample = reference_logits(args.model, batches, work / "ref.npy")
        out["eval"].update(tokens=sum(per_sample), reference_s=round(time.perf_counter() - t0, 1))
        print(f"reference: {len(per_sample)} samples, {sum(per_sample)} tokens", flush=True)
        for setting in args.activations:
            opts: dict = {"scales": "weights"}
            entry: dict = {"runs": {}}
            if setting == "static":
                amax = work / "amax.json"
                t0 = time.perf_counter()
                api.calibrate(CalibrateConfig(checkpoint=args.model,
                                              calib_data=DATA / "calib.txt", output=amax,
                                              calib_samples=args.calib_samples,
                                              seq_len=args.seq_len, device="cpu"))
                entry["calibrate_s"] = round(time.perf_counter() - t0, 1)
                opts = {"scales": "calibrate", "calib_amax": amax}
            out["settings"][setting] = entry
            for rounding in ROUNDINGS:
                folder = work / f"{setting}-{rounding}"
                t0 = time.perf_counter()
                reads = {} if rounding == "nearest" else {
                    "calib_data": DATA / "calib.txt", "calib_samples": args.calib_samples,
                    "seq_len": args.seq_len}  # convert refuses data it would not read
                api.convert(ConvertConfig(checkpoint=args.model, output=folder, device="cpu",
                                          weight_rounding=rounding, **opts, **reads))
                convert_s = time.perf_counter() - t0
                man = json.loads((folder / "fp8export.json").read_text())
                t0 = time.perf_counter()
                kl = kl_of(folder, batches, ref, per_sample, sums=True)
                # the eval's token count is kl's "tokens"; the rounding's own facts sit apart
                run = {"convert_s": round(convert_s, 1), "eval_s": round(time.perf_counter() -
                                                                          t0, 1),
                       "activation_scheme": man.get("activation_scheme"), **kl}
                r = man.get("weight_rounding")
                if r:
                    run["rounding"] = {k: r.get(k) for k in (
                        "method", "samples", "held_out_samples", "tokens", "passes", "layers",
                        "gptq_layers", "output_gain_db_median", "seconds")}
                    run["rounding"]["nearest_by_check"] = len(r.get("nearest_by_check", []))
                entry["runs"][rounding] = run
                print(json.dumps({setting: rounding, **{k: v for k, v in run.items()
                                                       if k != "kl_sums"}}), flush=True)
                save()
            runs = entry["runs"]
            entry["sequential_minus_parallel"] = paired(
                runs["gptq"]["kl_sums"], runs["gptq-sequential"]["kl_sums"], per_sample)
            entry["gptq_minus_nearest"] = paired(
                runs["nearest"]["kl_sums"], runs["gptq"]["kl_sums"], per_sample)
            entry["codes"] = same_codes(work / f"{setting}-gptq",
                                        work / f"{setting}-gptq-sequential")
            save()
            for folder in work.glob(f"{setting}-*"):  # keep /tmp small between settings
                __import__("shutil").rmtree(folder)
    save()
    args.out.with_suffix(".md").write_text(render(out) + "\n")
    print(render(out))


SETTING_NAMES = {"dynamic": "per-tensor weights, dynamic per-token inputs (`--scales weights`)",
                 "static": "per-tensor weights, static per-tensor inputs (`calibrate`, max, "
                           "reused with `--calib-amax`)"}


def _kl(x: float) -> str:
    return f"{x:.4f}" if x >= 1e-3 else f"{x:.2e}"


def render(out: dict) -> str:
    c, e, m = out["calib"], out["eval"], out["machine"]
    lines = [f"# Sequential GPTQ against the parallel variant ({out['model']})", "",
             f"Held-out: {e['samples']} lines of eval.txt x {e['seq_len']} tokens ({e['tokens']} "
             f"tokens; no line of calib.txt); calibration: the first {c['samples']} lines of "
             "calib.txt (GPTQ fits three quarters, checks each layer on every fourth); KL(bf16 "
             "|| FP8) per token by bench/margin.py's metric code, 95% bootstrap intervals over "
             f"samples. CPU, torch on {out['torch_threads']} thread(s), load "
             f"{m['load_avg_1m_at_start']} at start.", ""]
    for setting, entry in out["settings"].items():
        lines += [f"## {SETTING_NAMES[setting]}", "",
                  "| rounding | KL per token [95%] | top-1 | convert s |", "|---|---|---|---|"]
        for name, r in entry["runs"].items():
            lines.append(f"| {name} | {_kl(r['kl_mean'])} [{_kl(r['interval'][0])}, "
                         f"{_kl(r['interval'][1])}] | {r['top1_agreement']:.4f} | "
                         f"{r['convert_s']} |")
        d = entry.get("sequential_minus_parallel")
        if d:
            codes = entry["codes"]
            lines += ["", f"sequential − parallel: {d['kl_difference']:+.2e} per token "
                      f"({100 * d['relative']:+.1f}%), paired 95% interval "
                      f"[{d['interval'][0]:+.2e}, {d['interval'][1]:+.2e}] ({d['draws']} draws; "
                      f"lower on {d['samples_lower']} of {d['samples']} samples): "
                      f"{verdict(d)}. Identical E4M3 codes in both GPTQ folders: "
                      f"{codes['identical']} of {codes['weights']} weights."]
        lines.append("")
    return "\n".join(lines).rstrip()


if __name__ == "__main__":
    main()
