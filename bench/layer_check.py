"""verify's layer check (``layer_sqnr_min``): its margin and its cost, measured.

Margin: the worst quantized layer's isolated SQNR of clean FP8 folders — the sample LM in every
folder format (compressed-tensors, vllm and modelopt with static input scales calibrated on
data/calib.txt; compressed-tensors with dynamic per-token inputs; vllm with 128x128 blocks), on
its own eval data and on the built-in sentences (out of domain, where static input scales clip
most); every family of tests/families (MoE included) and the Keras tutorial model — against
the same folders with one layer's weight scale (block grid: every block's scale) multiplied by
2 and by 8, and the verdict of each preset.

Cost: verify on the sample as the demo runs it (eval.txt, noise floor on; ``--cost-samples``
lines, 64 by default: the check's 2,048 tokens are a fixed cost, so its share is larger on
fewer lines than the demo's 256), with the `default` preset and with the same preset less the
layer check (``layer_sqnr_min: null``), alternated ``--rounds`` times in this one run; CPU
seconds of the process beside wall time, since the machine is shared.

Run:  .venv/bin/python bench/layer_check.py [--rounds 3] [--only cost|margins]
(about 15 minutes on the busy 2-core machine). Writes bench/results/layer_check.json and .md;
tests/test_published_numbers.py checks the numbers docs/verify.md quotes against the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "families"))
from _common import REPO, machine_info  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"
KERAS = REPO / "samples" / "keras-hub-float8"
SAMPLE_LAYER = "model.layers.3.mlp.up_proj"
FORMATS = {  # name: ConvertConfig options
    "compressed-tensors static": {"format": "compressed-tensors", "calib": True},
    "compressed-tensors dynamic": {"format": "compressed-tensors", "calib": False},
    "vllm static": {"format": "vllm", "calib": True},
    "modelopt static": {"format": "modelopt", "calib": True},
    "vllm block 128x128": {"format": "vllm", "calib": False, "weight_granularity": "block"},
}
FACTORS = (2.0, 8.0)
SAMPLES = 24  # lines of eval.txt: ~2,400 tokens, more than the layer check's 2,048
CALIB_SAMPLES = 64  # calibration lines of the static formats
PRESETS = ("strict", "default", "loose")


def convert(src: Path, out: Path, **opts) -> Path:
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    calib = SAMPLE / "data" / "calib.txt" if opts.pop("calib", False) else None
    if calib is not None:
        opts.setdefault("calib_samples", CALIB_SAMPLES)
    api.convert(ConvertConfig(checkpoint=src, output=out, calib_data=calib, **opts))
    return out


def damaged(folder: Path, work: Path, module: str, factor: float) -> Path:
    """A copy of ``folder`` with ``module``'s weight scale times ``factor`` (manifest too)."""
    from fp8_folders import damage_scale

    out = work / f"{folder.name}-x{factor:g}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(folder, out)
    try:
        damage_scale(out, module, factor)
    except KeyError:  # a block folder names its scale weight_scale_inv
        damage_scale(out, module, factor, name="weight_scale_inv")
    return out


def verify(reference: Path, candidate: Path, thresholds="default", **opts):
    """One verify run without reports; the noise floor only where asked (it changes no metric
    the gate compares, and doubles the reference's cost)."""
    from fp8export import api
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig

    opts.setdefault("noise_floor", False)
    cfg = VerifyConfig(reference=reference, candidate=candidate, thresholds=thresholds,
                       write_reports=False, **opts)
    try:
        return api.verify(cfg)
    except VerificationFailed as exc:
        return exc.result


def verdicts(result) -> dict:
    """Each preset's verdict on one run's metrics (the layer check measured once)."""
    from fp8export.verify.thresholds import evaluate, load_thresholds

    out = {}
    for preset in PRESETS:
        checks = evaluate(result.metrics, load_thresholds(preset)[1])
        out[preset] = {"passed": not any(c["status"] == "failed" for c in checks),
                       "failed": sorted(c["metric"] for c in checks if c["status"] == "failed")}
    return out


def row(result, module: str | None = None) -> dict:
    check = result.layer_check or {}
    worst = (check.get("worst") or [{}])[0]
    out = {"layer_sqnr_min": result.metrics.get("layer_sqnr_min"),
           "worst_layer": worst.get("module"), "layers": check.get("layers"),
           "tokens": check.get("tokens"), "kl_mean": result.metrics.get("kl_mean"),
           "verdicts": verdicts(result)}
    if module is not None:
        below = [m for c in result.checks if c["metric"] == "layer_sqnr_min"
                 for m in c.get("layers", [])]
        out["below"] = below
        out["named"] = below == [m for m in below if _same_module(m, module)] != []
    return out


def _same_module(model_name: str, folder_name: str) -> bool:
    """The runtime names a module as the model does (Mixtral's ``block_sparse_moe`` is
    ``mlp`` there); the same decoder layer and the same expert projection is the same one."""
    if model_name == folder_name:
        return True
    a, b = model_name.split(".experts."), folder_name.split(".experts.")
    return len(a) == len(b) == 2 and a[1] == b[1] and \
        a[0].split(".")[:3] == b[0].split(".")[:3]


def sample_formats(work: Path) -> dict:
    model, data = SAMPLE / "model", SAMPLE / "data" / "eval.txt"
    out = {}
    for name, opts in FORMATS.items():
        folder = convert(model, work / name.replace(" ", "-"), **dict(opts))
        entry = {"clean": row(verify(model, folder, data=data, samples=SAMPLES)),
                 "clean_builtin": row(verify(model, folder))}
        for f in FACTORS:
            bad = damaged(folder, work, SAMPLE_LAYER, f)
            entry[f"x{f:g}"] = row(verify(model, bad, data=data, samples=SAMPLES), SAMPLE_LAYER)
            shutil.rmtree(bad)
        out[name] = entry
        print(f"{name}: {json.dumps(entry)}", flush=True)
    return out


def families(work: Path) -> dict:
    from model_families import FAMILIES, MOE_FAMILIES, save_family

    out = {}
    for name in FAMILIES:
        src = save_family(name, work / f"fam-{name}")
        folder = convert(src, work / f"fam-{name}-fp8")
        entry = {"clean": row(verify(src, folder))}
        if name in MOE_FAMILIES:  # one expert's down projection, as the folder names it
            manifest = json.loads((folder / "fp8export.json").read_text())
            expert = next(m for m in manifest["quantized"] if ".experts.1." in m
                          and m.rsplit(".", 1)[-1] in ("w2", "down_proj"))
            for f in FACTORS:
                bad = damaged(folder, work, expert, f)
                entry[f"x{f:g}"] = row(verify(src, bad), expert)
                shutil.rmtree(bad)
        out[name] = entry
        print(f"{name}: {json.dumps(entry)}", flush=True)
    return out


def keras(work: Path) -> dict:
    ref = KERAS / "model" / "float8_model.keras"
    folder = convert(ref, work / "keras-fp8", scales="history")
    data = KERAS / "data" / "eval.npz"
    entry = {"clean": row(verify(ref, folder, data=data, samples=200,
                                 reference_dtype="fp32"))}
    manifest = json.loads((folder / "fp8export.json").read_text())
    layer = sorted(manifest["quantized"])[0]
    for f in FACTORS:
        bad = damaged(folder, work, layer, f)
        entry[f"x{f:g}"] = row(verify(ref, bad, data=data, samples=200,
                                      reference_dtype="fp32"), layer)
        shutil.rmtree(bad)
    print(f"keras: {json.dumps(entry)}", flush=True)
    return entry


def cost(work: Path, rounds: int, samples: int) -> dict:
    """verify on the sample as the demo runs it (noise floor on), with and without the layer
    check, alternated: wall seconds, and CPU seconds of this process (which the neighbours'
    load on a shared machine barely moves)."""
    model, data = SAMPLE / "model", SAMPLE / "data" / "eval.txt"
    folder = convert(model, work / "cost-fp8", calib=True, calib_samples=256)  # the demo's
    without = work / "no-layer-check.json"
    without.write_text(json.dumps({"preset": "default", "layer_sqnr_min": None}))
    runs = {"with": [], "without": []}
    for _ in range(rounds):
        for label, thr in (("without", str(without)), ("with", "default")):
            t0, c0 = time.perf_counter(), time.process_time()
            res = verify(model, folder, thresholds=thr, data=data, samples=samples,
                         noise_floor=True)
            runs[label].append({"wall_s": round(time.perf_counter() - t0, 2),
                                "cpu_s": round(time.process_time() - c0, 2), **res.timing,
                                "checked": "layer_sqnr_min" in res.metrics,
                                "load_avg_1m": round(os.getloadavg()[0], 2)})
            print(f"cost {label}: {runs[label][-1]}", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "cpu_s")}
           for k, v in runs.items()}
    return {"rounds": rounds, "samples": samples, "runs": runs, "median": med,
            "overhead_cpu": round(med["with"]["cpu_s"] / med["without"]["cpu_s"] - 1, 4),
            "overhead_wall": round(med["with"]["wall_s"] / med["without"]["wall_s"] - 1, 4)}


def render(doc: dict) -> str:
    lines = ["# Layer check: worst clean layer against one damaged layer", "",
             "| folder | data | clean: worst layer | dB | ×2 | ×8 | clean passes "
             "strict/default/loose | ×2 fails | ×8 fails |",
             "|---|---|---|---|---|---|---|---|---|"]

    def fails(r):
        return "/".join("fail" if not r["verdicts"][p]["passed"] else "pass" for p in PRESETS)

    def add(name, data, e, clean_key="clean"):
        c = e[clean_key]
        x2, x8 = e.get("x2"), e.get("x8")
        lines.append(
            f"| {name} | {data} | {c['worst_layer']} | {c['layer_sqnr_min']:.1f} | "
            + (f"{x2['layer_sqnr_min']:.1f}" if x2 else "–") + " | "
            + (f"{x8['layer_sqnr_min']:.1f}" if x8 else "–") + " | "
            + "/".join("pass" if c["verdicts"][p]["passed"] else "FAIL" for p in PRESETS)
            + " | " + (fails(x2) if x2 else "–") + " | " + (fails(x8) if x8 else "–") + " |")

    for name, e in doc["sample"].items():
        add(f"sample, {name}", f"eval.txt ({SAMPLES} lines)", e)
        add(f"sample, {name}", "built-in sentences", {"clean": e["clean_builtin"]})
    for name, e in doc["families"].items():
        add(name, "built-in sentences", e)
    add("Keras tutorial (`--scales history`)", "eval.npz (200)", doc["keras"])
    if doc.get("cost"):
        c = doc["cost"]
        w, o = c["median"]["with"], c["median"]["without"]
        lines += ["", f"Cost on the sample ({c['samples']} lines of eval.txt, noise floor on, "
                      f"{c['rounds']} alternated rounds, median): verify took {o['cpu_s']:.1f} "
                      f"CPU s without the layer check and {w['cpu_s']:.1f} with it "
                      f"({c['overhead_cpu']:+.1%}); wall {o['wall_s']:.1f} s and "
                      f"{w['wall_s']:.1f} s ({c['overhead_wall']:+.1%}) on the shared machine."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cost-samples", type=int, default=64,
                    help="lines of eval.txt the cost is measured on (the check's share is "
                         "largest on few: its 2,048 tokens are a fixed cost)")
    ap.add_argument("--only", choices=("cost", "margins"),
                    help="measure only the cost or only the margins (two processes at once; "
                         "the results are merged into one JSON when both files exist)")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fp8export-layer-check-") as tmp:
        work = Path(tmp)
        doc = {"machine": machine_info(work)}
        if args.only != "margins":
            doc["cost"] = cost(work, args.rounds, args.cost_samples)
        if args.only != "cost":
            doc["sample"] = sample_formats(work)
            doc["families"] = families(work)
            doc["keras"] = keras(work)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    args.results.mkdir(parents=True, exist_ok=True)
    if args.only:  # one half: kept apart until the other half is there
        (args.results / f"layer_check_{args.only}.json").write_text(json.dumps(doc, indent=1))
        other = args.results / f"layer_check_{'margins' if args.only == 'cost' else 'cost'}.json"
        if not other.exists():
            return
        halves = {("cost" if "cost" in h else "margins"): h
                  for h in (doc, json.loads(other.read_text()))}
        doc = {"machine": {k: h["machine"] for k, h in halves.items()},
               "seconds": {k: h["seconds"] for k, h in halves.items()},
               **{k: v for h in halves.values() for k, v in h.items()
                  if k not in ("machine", "seconds")}}
        for half in ("cost", "margins"):
            (args.results / f"layer_check_{half}.json").unlink()
    (args.results / "layer_check.json").write_text(json.dumps(doc, indent=1) + "\n")
    table = render(doc)
    (args.results / "layer_check.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
