#!/usr/bin/env python
"""fp8export's all-FP8 recipes against llm-compressor's on real pretrained models: KL to the
bf16 model on held-out text, with 95% bootstrap intervals, measured in one run by one code.

    python bench/margin.py --model samples/smollm2/model
    python bench/margin.py --model /tmp/gemma3 --label gemma3-270m --batch 1

Peer folders come from ``bench/peer_llmcompressor.py`` run in the peer venv
(``FP8EXPORT_PEER_VENV``, default ``/work/main/.venv-peers``; subprocess): FP8_DYNAMIC,
FP8_BLOCK, GPTQ + FP8_DYNAMIC and GPTQ + FP8_BLOCK. Ours come from ``api.convert``. Every
folder, ours and the peer's, is run by fp8export's FP8 runtime in emulation (the reader takes
llm-compressor's compressed-tensors folders as vLLM reads them), so the same code measures all
of them: the reference's bf16 logits of ``--eval-samples`` lines of ``eval.txt`` (disjoint
from the calibration lines) are kept on disk, and each candidate's KL(reference || candidate)
per token is summed per sample for the bootstrap. The margin is ``1 - KL_ours / KL_peer``
against the peer's best recipe; "intervals apart" when our upper bound is below its lower
bound. Writes ``bench/results/margin-<label>.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import machine_info  # noqa: E402

DATA = REPO / "samples" / "tiny-llama" / "data"
PEERS = ("FP8_DYNAMIC", "FP8_BLOCK", "GPTQ_FP8_DYNAMIC", "GPTQ_FP8_BLOCK")
OURS = {
    "tensor + token": {"scales": "weights"},
    "channel + token": {"scales": "weights", "weight_granularity": "channel"},
    "tensor + token, GPTQ": {"scales": "weights", "weight_rounding": "gptq"},
    "channel + token, GPTQ": {"scales": "weights", "weight_granularity": "channel",
                              "weight_rounding": "gptq"},
    "block + group": {"scales": "weights", "weight_granularity": "block"},
    "block + group, GPTQ": {"scales": "weights", "weight_granularity": "block",
                            "weight_rounding": "gptq"},
}


def reference_logits(model_dir: Path, batches, path: Path):
    """The bf16 reference's logits of every real token, in a bf16 file (exact: the model
    outputs bf16), and the tokens per sample."""
    import numpy as np
    import torch

    from fp8export.models import load_model

    model, _ = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
    per_sample = [n for _, mask in batches for n in (mask > 0).sum(1).tolist()]
    vocab = model.get_output_embeddings().weight.shape[0]
    # written batch by batch: the logits of hundreds of samples are gigabytes
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.int16,
                                   shape=(sum(per_sample), vocab))
    start = 0
    with torch.inference_mode():
        for ids, mask in batches:
            lg = model(input_ids=ids, attention_mask=mask).logits[mask > 0]
            mm[start:start + len(lg)] = lg.view(torch.int16).numpy()
            start += len(lg)
    mm.flush()
    return path, per_sample


def kl_of(folder: Path, batches, ref_path: Path, per_sample: list[int], *,
          sums: bool = False) -> dict:
    import numpy as np
    import torch

    from fp8export.runtime.fp8_model import load_fp8_model

    ref_all = np.load(ref_path, mmap_mode="r")
    model = load_fp8_model(folder, dtype=torch.bfloat16, mode="emulate")[0]

    def refs():
        start = 0
        for _, mask in batches:
            n = int((mask > 0).sum())
            yield torch.from_numpy(np.array(ref_all[start:start + n])).view(torch.bfloat16)
            start += n

    return kl_to_reference(model, batches, refs(), per_sample, sums=sums)


def kl_to_reference(model, batches, refs, per_sample: list[int], *, sums: bool = False
                    ) -> dict:
    """KL(reference ‖ ``model``) per token over ``batches`` (``refs``: the reference's logits
    of each batch's real tokens), its 95 % bootstrap interval (samples resampled with their
    tokens, verify's code) and top-1 agreement: the one metric of the margin benchmarks.
    ``sums``: also each sample's KL summed over its tokens (``kl_sums``, in sample order), for
    a paired comparison of two candidates on the same samples."""
    import numpy as np
    import torch

    from fp8export.analysis.confidence import SampleStats, intervals

    kl_rows, agree = [], 0
    with torch.inference_mode():
        for (ids, mask), ref in zip(batches, refs, strict=True):
            lg = model(input_ids=ids, attention_mask=mask).logits[mask > 0].float()
            lp = torch.log_softmax(ref.float(), -1)
            lq = torch.log_softmax(lg, -1)
            kl_rows.append((lp.exp() * (lp - lq)).sum(-1).clamp_min(0))
            agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
    kl = torch.cat(kl_rows).double().numpy()
    bounds = np.cumsum([0] + per_sample)
    sample_kl = np.asarray([kl[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
    iv = intervals(SampleStats({"kl_sum": sample_kl, "tokens": np.asarray(per_sample, float)}),
                   ["kl_mean"])["kl_mean"]
    return {"kl_mean": float(kl.mean()), "interval": iv, "top1_agreement": agree / len(kl),
            "tokens": int(len(kl)), **({"kl_sums": sample_kl.tolist()} if sums else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "samples" / "smollm2" / "model")
    ap.add_argument("--label", default="smollm2")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--peers", nargs="*", default=list(PEERS))
    ap.add_argument("--ours", nargs="*", default=list(OURS))
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1),
                    help="torch threads here (1 on a busy machine: GPTQ's small steps "
                         "slow down badly when threads wait on each other)")
    args = ap.parse_args()
    import torch

    from fp8export import api
    from fp8export.convert.config import ConvertConfig
    from fp8export.inputs.eval_data import load_verify_samples
    from fp8export.inputs.samples import iter_batches

    torch.set_num_threads(args.threads)
    peer_py = Path(os.environ.get("FP8EXPORT_PEER_VENV", "/work/main/.venv-peers")) / \
        "bin" / "python"
    cfg = json.loads((args.model / "config.json").read_text())
    doc = {"machine": machine_info(REPO), "model": args.label,
           "calib": {"data": "calib.txt", "samples": args.calib_samples},
           "eval": {"data": "eval.txt", "samples": args.eval_samples,
                    "seq_len": args.seq_len}, "rows": []}
    out = REPO / "bench" / "results" / f"margin-{args.label}"
    with tempfile.TemporaryDirectory(prefix="accuracy-margin-") as tmp:
        work = Path(tmp)
        s, _ = load_verify_samples(DATA / "eval.txt", args.model, cfg,
                                   samples=args.eval_samples, seq_len=args.seq_len)
        batches = [(b.input_ids, b.attention_mask) for b in iter_batches(s, args.batch)]
        t0 = time.perf_counter()
        ref, per_sample = reference_logits(args.model, batches, work / "ref.npy")
        doc["reference_s"] = round(time.perf_counter() - t0, 1)
        cands = []
        for scheme in args.peers:
            folder = work / f"peer-{scheme}"
            t0 = time.perf_counter()
            cmd = [str(peer_py), str(REPO / "bench" / "peer_llmcompressor.py"), scheme,
                   str(args.model), str(folder), str(DATA / "calib.txt"),
                   str(args.calib_samples), str(args.seq_len)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                doc["rows"].append({"recipe": f"llm-compressor {scheme}", "tool": "peer",
                                    "error": r.stderr[-600:]})
                continue
            cands.append((f"llm-compressor {scheme}", "peer", folder,
                          time.perf_counter() - t0))
        for name in args.ours:
            opts = OURS[name]
            folder = work / f"ours-{len(cands)}"
            t0 = time.perf_counter()
            reads = opts.get("weight_rounding") == "gptq"
            api.convert(ConvertConfig(checkpoint=args.model, output=folder, **opts,
                                      **({"calib_data": DATA / "calib.txt",
                                          "calib_samples": args.calib_samples,
                                          "seq_len": args.seq_len} if reads else {})))
            cands.append((f"fp8export {name}", "ours", folder, time.perf_counter() - t0))
        for name, tool, folder, secs in cands:
            t0 = time.perf_counter()
            row = {"recipe": name, "tool": tool, "convert_s": round(secs, 1),
                   **kl_of(folder, batches, ref, per_sample),
                   "eval_s": round(time.perf_counter() - t0, 1)}
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    rows = [r for r in doc["rows"] if "kl_mean" in r]
    peers = [r for r in rows if r["tool"] == "peer"]
    ours = [r for r in rows if r["tool"] == "ours"]
    if peers and ours:
        bp, bo = min(peers, key=lambda r: r["kl_mean"]), min(ours, key=lambda r: r["kl_mean"])
        doc["best_peer"], doc["best_ours"] = bp["recipe"], bo["recipe"]
        doc["margin"] = 1 - bo["kl_mean"] / bp["kl_mean"]
        doc["intervals_apart"] = bo["interval"][1] < bp["interval"][0]
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# {args.label}: fp8export against llm-compressor, KL(bf16 || FP8) on held-out "
             "text", "",
             f"{args.eval_samples} lines of eval.txt x {args.seq_len} tokens (not in the "
             f"{args.calib_samples} calibration lines of calib.txt); every folder run by "
             f"fp8export's FP8 runtime (emulation), one metric code; CPU, load "
             f"{doc['machine']['load_avg_1m_at_start']} at start.", "",
             "| recipe | KL mean [95%] | top-1 | convert s |", "|---|---|---|---|"]
    for r in doc["rows"]:
        if "kl_mean" not in r:
            lines.append(f"| {r['recipe']} | failed: {r['error'][-120:]!r} | | |")
            continue
        lines.append(f"| {r['recipe']} | {r['kl_mean']:.4f} [{r['interval'][0]:.4f}, "
                     f"{r['interval'][1]:.4f}] | {r['top1_agreement']:.4f} | "
                     f"{r['convert_s']} |")
    if "margin" in doc:
        lines += ["", f"Best ours: {doc['best_ours']}; best peer: {doc['best_peer']}; margin "
                      f"{100 * doc['margin']:.1f}% (target >= 20%), intervals "
                      f"{'apart' if doc['intervals_apart'] else 'overlapping'}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
