#!/usr/bin/env python
"""Recipe table: FP8 accuracy of weight granularity x activation scheme x calibrator x weight
rounding, measured with ``verify`` (torch FP8 runtime, emulated on CPU) against the model's
bf16 reference on held-out text (the calibration text and the evaluation text are disjoint).

    python bench/recipes.py                                   # the shipped sample model
    python bench/recipes.py --model smollm2=/tmp/smollm2-135m # plus a real decoder
    python bench/recipes.py --quick                           # 4 recipes, for a smoke run
    python bench/recipes.py --recipes accuracy --fresh --model smollm2=samples/smollm2/model \
        --samples-real 32                                     # the README's accuracy table

Each recipe is one ``fp8export convert`` (calibrated ranges are computed once per calibrator
with ``fp8export calibrate`` and reused through ``--calib-amax``, so the two weight
granularities see the same activation ranges) followed by one ``fp8export verify`` on the same
evaluation samples. Recipes:

* weights: ``tensor`` (one scale per tensor, q/k/v and gate/up share the group max),
  ``channel`` (one scale per output row) or ``block`` (one per 128x128 tile, DeepSeek-V3's
  format);
* activations: ``static`` (calibrated per-tensor input scales; calibrator ``max``,
  ``percentile`` or ``mse``), ``dynamic-tensor`` or ``dynamic-token`` (computed at run time);
  block weights run with ``dynamic-group`` (per token and group of 128 input elements), their
  only activation scheme;
* rounding: ``nearest`` or ``gptq`` (``--weight-rounding gptq`` on the calibration text);
* method (the ``accuracy`` set, bench/recipe_methods.py; not shipped by convert): ``smooth``
  (activation smoothing folded into the checkpoint before convert, α per fold site by the
  calibration output error) or ``scale-search`` (per-tensor weight scales by output error).

Every row also records verify's noise floor (the bf16 reference against fp32 on the same
tokens). Writes ``bench/results/recipes.json`` and ``recipes.md``. The best all-FP8 recipe per
model is the one with the lowest KL among those that pass the ``default`` gate (else the lowest
KL); "all-FP8" means every selected linear is FP8 with FP8 inputs (no layer left in bf16).
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
from bench.recipe_methods import search_weight_scales, smooth_checkpoint  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"
CALIBRATORS = ("max", "percentile", "mse")
ACTIVATIONS = ("static", "dynamic-tensor", "dynamic-token")


def _row(weights, activations, calibrator=None, rounding="nearest", method=None, kv="none"):
    return {"weights": weights, "activations": activations, "calibrator": calibrator,
            "kv_cache": kv, "rounding": rounding, "method": method}


def recipes(which: str) -> list[dict]:
    """``full``: every calibrator; ``core``: static with ``max`` only; ``quick``: core without
    dynamic per-tensor; ``kv``: the default recipe with and without an FP8 KV cache; ``block``:
    the block recipe alone (added to models measured before on the same data); ``accuracy``:
    the recipe methods against today's best (per-tensor weights, per-token inputs) and the
    static default, all measured in one run."""
    kv = {"weights": "tensor", "activations": "static", "calibrator": "max", "kv_cache": "fp8"}
    block = {"weights": "block", "activations": "dynamic-group", "calibrator": None,
             "kv_cache": "none"}
    if which == "kv":
        return [dict(kv, kv_cache="none"), kv]
    if which == "block":
        return [block]
    if which == "accuracy":
        return [_row("tensor", "dynamic-token"), _row("tensor", "static", "max"),
                _row("channel", "dynamic-token"),
                _row("tensor", "dynamic-token", method="smooth"),
                _row("tensor", "dynamic-token", method="scale-search"),
                _row("tensor", "dynamic-token", rounding="gptq"),
                _row("tensor", "static", "max", rounding="gptq"),
                _row("channel", "dynamic-token", rounding="gptq")]
    out = []
    for weights in ("tensor", "channel"):
        for act in ACTIVATIONS:
            methods = CALIBRATORS if act == "static" else (None,)
            for method in methods:
                if which != "full" and method not in (None, "max"):
                    continue
                if which == "quick" and act == "dynamic-tensor":
                    continue
                out.append({"weights": weights, "activations": act, "calibrator": method,
                            "kv_cache": "none"})
    out.append(block)
    out.append(kv)  # the cost of an FP8 KV cache, on the default recipe
    return out


def name_of(r: dict) -> str:
    act = r["activations"] + (f" ({r['calibrator']})" if r["calibrator"] else "")
    kv = " / KV fp8" if r.get("kv_cache") == "fp8" else ""
    rounding = " / gptq" if r.get("rounding", "nearest") == "gptq" else ""
    method = f" / {r['method']}" if r.get("method") else ""
    return f"W {r['weights']} / A {act}{kv}{rounding}{method}"


def run_model(label: str, model: Path, calib: Path, data: Path, args, work: Path,
              which: str) -> dict:
    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig

    samples = args.samples if label == "sample" else args.samples_real
    rows = []
    amax_files: dict[str, Path] = {}
    calib_s: dict[str, float] = {}
    for r in recipes(which):
        method = r["calibrator"]
        if method and method not in amax_files:
            t0 = time.perf_counter()
            amax_files[method] = work / f"{label}-amax-{method}.json"
            api.calibrate(CalibrateConfig(checkpoint=model, calib_data=calib,
                                          output=amax_files[method], calib_method=method,
                                          calib_samples=args.calib_samples,
                                          seq_len=args.seq_len, device="cpu"))
            calib_s[method] = round(time.perf_counter() - t0, 1)
        out = work / f"{label}-fp8"
        static = r["activations"] == "static"
        gptq = r.get("rounding", "nearest") == "gptq"
        t0 = time.perf_counter()
        source, facts = model, {}
        if r.get("method") == "smooth":  # a smoothed high-precision copy, converted as usual
            source = work / f"{label}-smoothed"
            shutil.rmtree(source, ignore_errors=True)
            facts = smooth_checkpoint(model, source, calib, seq_len=args.seq_len)
        api.convert(ConvertConfig(
            checkpoint=source, output=out, force=True,
            scales="calibrate" if static else "weights",
            calib_amax=amax_files.get(method),
            weight_granularity=r["weights"], kv_cache=r["kv_cache"],
            calib_data=calib if r["kv_cache"] == "fp8" or gptq else None,
            calib_samples=args.calib_samples, seq_len=args.seq_len,
            weight_rounding="gptq" if gptq else "nearest",
            dynamic_activations={"dynamic-token": "token", "dynamic-group": "group"}.get(
                r["activations"], "tensor")))
        if r.get("method") == "scale-search":
            facts = search_weight_scales(out, model, calib, samples=args.calib_samples,
                                         seq_len=args.seq_len)
        convert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        attribution = which == "accuracy" and r["weights"] == "tensor" \
            and r["activations"] == "dynamic-token" and not r.get("method")
        try:
            res = api.verify(VerifyConfig(reference=model, candidate=out, data=data,
                                          samples=samples, seq_len=args.seq_len,
                                          report_dir=work / "report", backend="torch",
                                          fp8_mode="emulate", device="cpu",
                                          per_layer=attribution, write_reports=False,
                                          # the floor depends on reference and data only
                                          noise_floor=not rows))
        except VerificationFailed as failed:  # ran to the end, missed the gate: still a row
            res = failed.result
        verify_s = time.perf_counter() - t0
        m = res.metrics
        conf = res.confidence or {}
        floor = (res.noise_floor or {}).get("metrics") or {}
        row = {**r, "recipe": name_of(r), "passed_default": bool(res.passed),
               "failures": [f.get("metric") for f in res.failures],
               "top1_agreement": m.get("top1_agreement"), "kl_mean": m.get("kl_mean"),
               "cosine_mean": m.get("cosine_mean"), "cosine_min": m.get("cosine_min"),
               "ppl_ratio": (m["ppl_candidate"] / m["ppl_reference"]
                             if m.get("ppl_reference") else None),
               "tokens": m.get("tokens"), "intervals": conf.get("intervals"),
               "verdict_confidence": conf.get("verdict"),
               "noise_floor": {k: floor.get(k) for k in ("top1_agreement", "kl_mean",
                                                         "cosine_mean", "ppl_ratio")},
               "method_facts": facts,
               "convert_s": round(convert_s, 1), "verify_s": round(verify_s, 1)}
        row["per_sample"] = [[p["index"], p["tokens"], p["kl_mean"] * p["tokens"],
                               p["top1_agreement"] * p["tokens"]] for p in res.per_sample]
        if res.per_layer:
            row["per_layer"] = [{k: p.get(k) for k in ("module", "order", "sqnr_db",
                                                        "sqnr_e2e_db", "weight_sqnr_db")}
                                for p in sorted(res.per_layer, key=lambda p: p["order"])]
        rows.append(row)
        print(f"{label:10s} {row['recipe']:42s} top1 {row['top1_agreement']:.4f}  "
              f"KL {row['kl_mean']:.3e}  cos {row['cosine_mean']:.5f}  "
              f"{'pass' if row['passed_default'] else 'FAIL'}  ({verify_s:.0f}s)", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / f"{label}-smoothed", ignore_errors=True)
    return {"model": label, "path_name": model.name, "samples": samples, "recipes": which,
            "rows": rows, "calibrate_s": calib_s, **best_of(rows)}


def best_of(rows: list[dict]) -> dict:
    """The all-FP8 recipe (16-bit KV cache) with the lowest KL among those passing `default`,
    else among all."""
    plain = [r for r in rows if r.get("kv_cache", "none") == "none"]
    passing = [r for r in plain if r["passed_default"]]
    best = min(passing or plain, key=lambda r: r["kl_mean"])
    return {"best": best["recipe"], "best_passes_default": best["passed_default"]}


def paired(row: dict, base: dict) -> dict | None:
    """KL and top-1 of ``row`` minus ``base`` (same samples) with paired 95% bootstrap
    intervals: the same sample draws for both, so the spread of the data cancels."""
    import numpy as np

    from fp8export.analysis.confidence import draws

    a = {int(i): (t, k, h) for i, t, k, h in row.get("per_sample") or []}
    b = {int(i): (t, k, h) for i, t, k, h in base.get("per_sample") or []}
    common = sorted(set(a) & set(b))
    if len(common) < 2 or row is base:
        return None
    ta, ka, ha = (np.array([a[i][j] for i in common], float) for j in range(3))
    tb, kb, hb = (np.array([b[i][j] for i in common], float) for j in range(3))
    w = draws(len(common))
    out = {}
    for name, (xa, xb) in {"kl_mean": (ka, kb), "top1_agreement": (ha, hb)}.items():
        d = (w @ xa) / (w @ ta) - (w @ xb) / (w @ tb)
        point = xa.sum() / ta.sum() - xb.sum() / tb.sum()
        out[name] = [float(point), float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))]
    return out


def _delta(r: dict, base: dict | None, metric: str, fmt: str) -> str:
    d = paired(r, base) if base is not None else None
    if d is None:
        return "–"
    v, lo, hi = d[metric]
    return f"{format(v, fmt)} [{format(lo, fmt)}, {format(hi, fmt)}]"


def _interval(r: dict, metric: str, fmt: str) -> str:
    iv = (r.get("intervals") or {}).get(metric)
    return f" [{format(iv[0], fmt)}, {format(iv[1], fmt)}]" if iv else ""


LAYER_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def attribution(per_layer: list[dict]) -> dict:
    """Per-layer SQNR of one recipe summarised: median isolated SQNR per projection kind, the
    worst layers, and the end-to-end SQNR at the first and last decoder layers."""
    import statistics

    kinds = {}
    for kind in LAYER_KINDS:
        vals = [p["sqnr_db"] for p in per_layer if p["module"].endswith(kind)
                and p["sqnr_db"] is not None]
        if vals:
            kinds[kind] = round(statistics.median(vals), 1)
    worst = sorted((p for p in per_layer if p["sqnr_db"] is not None),
                   key=lambda p: p["sqnr_db"])[:5]
    e2e = [p for p in per_layer if p.get("sqnr_e2e_db") is not None]
    return {"median_sqnr_db_by_kind": kinds,
            "worst": [{"module": p["module"], "sqnr_db": round(p["sqnr_db"], 1)} for p in worst],
            "e2e_first_db": round(e2e[0]["sqnr_e2e_db"], 1) if e2e else None,
            "e2e_last_db": round(e2e[-1]["sqnr_e2e_db"], 1) if e2e else None}


def markdown(doc: dict) -> str:
    lines = ["# FP8 recipes (verify against the bf16 reference, torch FP8 runtime, emulated)", ""]
    for model in doc["models"]:
        lines += [f"## {model['model']}", "",
                  "| weights | activations | calibrator | rounding | method | KV cache | top-1 "
                  "[95% interval] | KL / token [95% interval] | KL − first row [paired 95%] | "
                  "cosine mean | ppl ratio | `default` gate |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        base = model["rows"][0] if model["rows"] else None
        for r in model["rows"]:
            gate = "pass" if r["passed_default"] else "fail (" + ", ".join(
                str(f) for f in r["failures"]) + ")"
            lines.append(f"| {r['weights']} | {r['activations']} | {r['calibrator'] or '–'} | "
                         f"{r.get('rounding', 'nearest')} | {r.get('method') or '–'} | "
                         f"{r.get('kv_cache', 'none')} | "
                         f"{r['top1_agreement']:.4f}{_interval(r, 'top1_agreement', '.4f')} | "
                         f"{r['kl_mean']:.3e}{_interval(r, 'kl_mean', '.2e')} | "
                         f"{_delta(r, base, 'kl_mean', '.2e')} | "
                         f"{r['cosine_mean']:.5f} | {r['ppl_ratio']:.4f} | {gate} |")
        floor = next((r["noise_floor"] for r in model["rows"]
                      if (r.get("noise_floor") or {}).get("kl_mean") is not None), None)
        if floor:
            lines.append(f"| noise floor: bf16 vs fp32 | | | | | | "
                         f"{floor['top1_agreement']:.4f} | {floor['kl_mean']:.3e} | | "
                         f"{floor['cosine_mean']:.5f} | {floor['ppl_ratio']:.4f} | |")
        lines += ["", f"Best all-FP8 recipe: **{model['best']}** "
                      f"({'passes' if model['best_passes_default'] else 'fails'} `default`).", ""]
        for r in model["rows"]:
            if r.get("per_layer"):
                a = attribution(r["per_layer"])
                kinds = ", ".join(f"{k} {v}" for k, v in a["median_sqnr_db_by_kind"].items())
                worst = ", ".join(f"`{w['module']}` {w['sqnr_db']}" for w in a["worst"][:3])
                lines += [f"Per-layer attribution of **{r['recipe']}** (isolated SQNR, dB): "
                          f"median by projection {kinds}; worst {worst}; end-to-end SQNR "
                          f"{a['e2e_first_db']} dB after the first layer, {a['e2e_last_db']} dB "
                          "after the last.", ""]
        for r in model["rows"]:
            if r.get("method_facts"):
                lines += [f"`{r['recipe']}`: {json.dumps(r['method_facts'], sort_keys=True)}",
                          ""]
    d = doc["setup"]
    def loads(m):  # rows measured in several runs carry the load of their own run
        found = sorted({r.get("load_avg_1m_at_start") for r in m["rows"]} - {None})
        return ", ".join(map(str, found)) or m.get("setup", {}).get("load_avg_1m_at_start", "?")

    sizes = ", ".join(f"{m['model']} {m['samples']} (machine load {loads(m)})"
                      for m in doc["models"])
    lines += [f"Data: {d['seq_len']}-token samples of each model's eval text ({sizes} samples); "
              f"calibration {d['calib_samples']} samples. Machine: {doc['machine']['cores']} "
              "cores, shared (timings are not comparable across runs).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], metavar="LABEL=PATH[,CALIB,EVAL]",
                    help="more models (HF folders); calibration/eval text default to the "
                         "sample's. Real models run the core recipe set (--recipes-real)")
    sets = ("full", "core", "quick", "kv", "block", "accuracy")
    ap.add_argument("--recipes-real", choices=sets, default="core")
    ap.add_argument("--recipes-sample", choices=sets, default="full",
                    help="the recipe set of the shipped sample model")
    ap.add_argument("--recipes", choices=sets,
                    help="the recipe set for every model (overrides --recipes-sample and "
                         "--recipes-real)")
    ap.add_argument("--fresh", action="store_true",
                    help="replace each measured model's earlier rows instead of merging")
    ap.add_argument("--no-sample", action="store_true", help="skip the shipped sample model")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--samples-real", type=int, default=16,
                    help="eval samples for --model (a real model's forward is slow on CPU)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="the quick set everywhere")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "recipes")
    args = ap.parse_args()

    calib, data = SAMPLE / "data" / "calib.txt", SAMPLE / "data" / "eval.txt"
    models = [] if args.no_sample else [("sample", SAMPLE / "model", calib, data,
                                         args.recipes_sample)]
    for spec in args.model:
        label, _, rest = spec.partition("=")
        parts = rest.split(",")
        models.append((label, Path(parts[0]), Path(parts[1]) if len(parts) > 1 else calib,
                       Path(parts[2]) if len(parts) > 2 else data, args.recipes_real))
    doc = {"machine": machine_info(REPO),
           "setup": {"samples": args.samples, "seq_len": args.seq_len,
                     "calib_samples": args.calib_samples, "runtime": "torch FP8, emulate, cpu",
                     "thresholds": "default"},
           "models": []}
    # Models measured before (another run) are kept: each model's rows are written as soon as
    # they are measured, replacing that model's earlier rows only.
    old = args.out.with_suffix(".json")
    kept = json.loads(old.read_text())["models"] if old.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fp8-recipes-") as tmp:
        for label, path, c, e, which in models:
            which = "quick" if args.quick else (args.recipes or which)
            result = run_model(label, path, c, e, args, Path(tmp), which)
            for row in result["rows"]:
                row["load_avg_1m_at_start"] = doc["machine"]["load_avg_1m_at_start"]
            before = None if args.fresh else next((m for m in kept if m["model"] == label),
                                                  None)
            for row in (before or {}).get("rows", []):
                row.setdefault("load_avg_1m_at_start", before.get("setup", {}).get(
                    "load_avg_1m_at_start"))
            if before is not None and before.get("samples") == result["samples"]:
                # rows of other recipes measured earlier on the same data are kept
                names = {r["recipe"] for r in result["rows"]}
                result["rows"] = [r for r in before["rows"] if r["recipe"] not in names] + \
                    result["rows"]
                result["recipes"] = f"{before.get('recipes')}+{which}"
                result.update(best_of(result["rows"]))
            result["setup"] = dict(doc["setup"], load_avg_1m_at_start=doc["machine"][
                "load_avg_1m_at_start"], load_avg_1m_at_end=round(os.getloadavg()[0], 2))
            kept = [m for m in kept if m["model"] != label] + [result]
            doc["models"] = kept
            old.write_text(json.dumps(doc, indent=1) + "\n")
            args.out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
