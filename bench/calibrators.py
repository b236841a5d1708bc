#!/usr/bin/env python
"""Calibrator comparison: FP8 fake-quantisation against the bf16 model, one table per run.

For each calibrator the model runs in float32 with

- every quantized linear's weight replaced by its E4M3 round trip with a per-tensor max
  scale (fused q/k/v and gate/up share the group's weight scale, as convert writes them), and
- every quantized linear's input fake-quantised by a forward pre-hook with the calibrated
  static input scale (``amax / 448``),

and is compared on held-out text with the unquantised model (the bf16 checkpoint's weights,
also computed in float32, so only FP8 error is measured): mean per-token KL(ref || fp8), top-1
agreement, and for causal LMs perplexity. A "weights only" row shows how much of the loss
comes from the weights alone. One observation pass (histogram kept) serves all calibrators,
so they are compared on identical statistics.

    python bench/calibrators.py            # the sample LM and its calib/eval text (CPU, minutes)
    python bench/calibrators.py --calib-samples 16 --eval-samples 16 --results /tmp/r  # quick

Writes ``<results>/calibrators.json`` and ``calibrators.md`` (default ``bench/results``) and
prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_info  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
try:  # an installed (editable) fp8export maps calibration/ to fp8export.calibration
    import fp8export.calibration  # noqa: F401
except ModuleNotFoundError:  # a bare checkout: the same mapping by hand
    import calibration

    sys.modules["fp8export.calibration"] = calibration

SAMPLE = REPO / "samples" / "tiny-llama"
METHODS = ("max", "percentile", "mse", "entropy")


# The FP8 model as a server runs it, simulated in float32: E4M3 weights with per-tensor max
# scales (fused groups share one), inputs fake-quantised with static per-tensor scales.

def fp8_weights(model, modules, groups) -> dict[str, Any]:
    """Each module's weight after an E4M3 round trip with its (group-shared) max scale."""
    import torch

    from fp8export.numerics.fp8 import amax_to_scale, fake_quantize_e4m3
    from fp8export.scales.groups import share_max

    named = dict(model.named_modules())
    amax = share_max({m: float(named[m].weight.detach().abs().max()) for m in modules},
                        groups)
    out = {}
    with torch.no_grad():
        for m in modules:
            w = named[m].weight
            out[m] = fake_quantize_e4m3(w.detach().float(), amax_to_scale(amax[m], m)).to(w.dtype)
    return out


@contextmanager
def fake_quant(model, weights: dict[str, Any], input_scales: dict[str, float] | None = None):
    """``model`` with ``weights`` swapped in and, with ``input_scales``, its inputs quantised."""
    from fp8export.numerics.fp8 import fake_quantize_e4m3

    named = dict(model.named_modules())
    old = {}
    handles = []
    try:
        for m, w in weights.items():
            old[m] = named[m].weight.data
            named[m].weight.data = w
        for m, s in (input_scales or {}).items():
            def hook(module, args, _s=s):
                return (fake_quantize_e4m3(args[0], _s),) + tuple(args[1:])
            handles.append(named[m].register_forward_pre_hook(hook))
        yield model
    finally:
        for h in handles:
            h.remove()
        for m, w in old.items():
            named[m].weight.data = w


class _Acc:
    def __init__(self):
        self.kl = self.tokens = self.agree = 0.0
        self.nll = self.nll_tokens = 0.0

    def add(self, ref_logp, logp, mask, ids, causal: bool):
        valid = mask.bool()
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        self.kl += float(kl[valid].double().sum())
        self.tokens += float(valid.sum())
        self.agree += float((ref_logp.argmax(-1) == logp.argmax(-1))[valid].sum())
        if causal and ids.shape[1] > 1:
            tgt = ids[:, 1:]
            nll = -logp[:, :-1].gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
            v = valid[:, 1:]
            self.nll += float(nll[v].double().sum())
            self.nll_tokens += float(v.sum())

    def result(self) -> dict[str, float]:
        out = {"kl_mean": self.kl / max(self.tokens, 1.0),
               "top1_agreement": self.agree / max(self.tokens, 1.0)}
        if self.nll_tokens:
            out["ppl"] = math.exp(self.nll / self.nll_tokens)
        return out


def compare_calibrators(checkpoint: str | Path, calib_data: str | Path, eval_data: str | Path, *,
                        methods=METHODS, calib_samples: int = 512, eval_samples: int | None = None,
                        batch_size: int = 8, seq_len: int | None = None,
                        percentile: float = 99.99) -> dict[str, Any]:
    """Calibrate once (histogram kept), then fake-quantise with each method's scales.

    See the module docstring; returns a JSON-serialisable dict (``results``, ``amax``, ...).
    """
    import torch

    from fp8export.calibration.observe import amaxes_from_stats, observe
    from fp8export.calibration.targets import default_modules
    from fp8export.inputs.samples import iter_batches, load_samples
    from fp8export.models import load_model, max_positions, task_of
    from fp8export.numerics.fp8 import amax_to_scale
    from fp8export.scales.groups import share_max

    ckpt = Path(checkpoint)
    t0 = time.perf_counter()
    model, config = load_model(ckpt, dtype=torch.bfloat16, device="cpu")
    modules, groups = default_modules(ckpt)
    tok_dir = ckpt if ckpt.is_dir() else None
    calib = load_samples(calib_data, tok_dir, max_samples=calib_samples, seq_len=seq_len,
                         max_positions=max_positions(config))
    ob = observe(model, calib, modules, method="percentile", groups=groups,
                 batch_size=batch_size, hist_rows=None)
    amax: dict[str, dict[str, float]] = {}
    compute_s: dict[str, float] = {}
    for m in methods:
        t = time.perf_counter()
        opts = {"percentile": percentile} if m == "percentile" else {}
        res = amaxes_from_stats(ob.stats, m, **opts)
        compute_s[m] = time.perf_counter() - t
        amax[m] = share_max({k: r.amax for k, r in res.items()}, groups)
    del model

    model, _ = load_model(ckpt, dtype=torch.float32, device="cpu")
    causal = task_of(config) == "causal-lm"
    fq_w = fp8_weights(model, modules, groups)
    evals = load_samples(eval_data, tok_dir, max_samples=eval_samples, seq_len=seq_len,
                         max_positions=max_positions(config))
    configs = ["weights-only"] + list(methods)
    acc = {c: _Acc() for c in ["reference"] + configs}
    scales = {m: {k: float(amax_to_scale(a, k)) for k, a in amax[m].items()} for m in methods}
    with torch.inference_mode():
        for batch in iter_batches(evals, batch_size):
            ids, mask = batch.input_ids, batch.attention_mask
            ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            acc["reference"].add(ref, ref, mask, ids, causal)
            for c in configs:
                with fake_quant(model, fq_w, scales.get(c)):
                    out = model(input_ids=ids, attention_mask=mask).logits.float()
                acc[c].add(ref, torch.log_softmax(out, -1), mask, ids, causal)

    def summary(m):
        ratios = [amax[m][k] / ob.stats[k].amax for k in amax[m]]
        return {"amax_over_max_mean": sum(ratios) / len(ratios), "amax_over_max_min": min(ratios),
                "compute_amax_s": round(compute_s[m], 3)}

    rows = {"reference": acc["reference"].result()}
    for c in configs:
        rows[c] = acc[c].result()
        if c in amax:
            rows[c].update(summary(c))
    return {
        "checkpoint": str(ckpt), "calib_data": str(calib_data), "eval_data": str(eval_data),
        "calib_samples": ob.samples, "calib_tokens": ob.tokens, "eval_samples": len(evals),
        "eval_tokens": evals.num_tokens, "layers": len(modules), "task": task_of(config),
        "percentile": percentile, "seconds": round(time.perf_counter() - t0, 2),
        "method": ("weights: per-tensor max scale, E4M3 fake-quant (fused groups share); "
                   "inputs: calibrated static per-tensor scale, E4M3 fake-quant via pre-hooks; "
                   "all compute in float32; reference = the same model unquantised"),
        "results": rows,
        "amax": {m: dict(sorted(a.items())) for m, a in amax.items()},
    }


def to_markdown(res: dict[str, Any]) -> str:
    causal = any("ppl" in r for r in res["results"].values())
    head = "| configuration | KL(ref‖fp8) per token | top-1 agreement |" + \
        (" perplexity |" if causal else "") + " amax / max (mean, min) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in res["results"].items():
        ratio = (f"{r['amax_over_max_mean']:.3f}, {r['amax_over_max_min']:.3f}"
                 if "amax_over_max_mean" in r else "–")
        label = {"reference": "bf16 weights, no FP8 (reference)",
                 "weights-only": "FP8 weights only"}.get(name, f"FP8 weights + inputs, `{name}`")
        lines.append(f"| {label} | {r['kl_mean']:.3e} | {r['top1_agreement']:.4f} |"
                     + (f" {r['ppl']:.3f} |" if causal else "") + f" {ratio} |")
    lines.append("")
    lines.append(f"Calibration: {res['calib_samples']} samples / {res['calib_tokens']} tokens of "
                 f"`{Path(res['calib_data']).name}`; evaluation: {res['eval_samples']} held-out "
                 f"samples / {res['eval_tokens']} tokens of `{Path(res['eval_data']).name}`; "
                 f"{res['layers']} quantized linears; percentile = {res['percentile']}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("checkpoint", nargs="?", default=str(SAMPLE / "model"))
    ap.add_argument("--calib-data", default=str(SAMPLE / "data" / "calib.txt"))
    ap.add_argument("--eval-data", default=str(SAMPLE / "data" / "eval.txt"))
    ap.add_argument("--calib-samples", type=int, default=512)
    ap.add_argument("--eval-samples", type=int)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--results", default=str(REPO / "bench" / "results"))
    a = ap.parse_args(argv)
    res = compare_calibrators(a.checkpoint, a.calib_data, a.eval_data,
                              calib_samples=a.calib_samples, eval_samples=a.eval_samples,
                              batch_size=a.batch_size, seq_len=a.seq_len)
    results = Path(a.results)
    res["machine"] = machine_info(results.parent if results.parent.exists() else REPO)
    md = to_markdown(res)
    print(md)
    results.mkdir(parents=True, exist_ok=True)
    (results / "calibrators.json").write_text(json.dumps(res, indent=2) + "\n")
    (results / "calibrators.md").write_text(
        "# Calibrator comparison (FP8 fake-quant vs bf16)\n\n" + md)
    print(f"wrote {results / 'calibrators.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
