"""The fault-injection table of docs/verify.md: what the verify gate sees when one weight scale
is wrong, which is how the `default` and `strict` thresholds were set.

The sample LM (samples/tiny-llama) is converted as the docs' evidence is (static input scales
calibrated on data/calib.txt). Then, for each of eight layers, its ``weight_scale`` is multiplied
by 8 (the E4M3 codes kept: the layer's output is 8x too large) and verified with the `default`
preset, and by 2 with `strict`, on the first 64 lines of data/eval.txt (``--seq-len 256``,
without the noise floor: it does not change the metrics compared). The verdicts are the whole
gate's, the layer check included (``layer_sqnr_min``: the damaged layer's own output SQNR, in
its own columns).

``--layer-check-only`` keeps the committed results' logits metrics and measures only the layer
check (the same folders, faults and lines, verified on the first 32 of the lines: the check reads
only the first 2,048 tokens, so it sees exactly what the full run's check sees), then re-judges
each fault with the whole gate: the logits checks as measured before, and the layer check. The
logits path is unchanged by the layer check, so the verdict is the one a full run gives, at an
eighth of its cost; the JSON records which run measured what.

Run:  .venv/bin/python bench/fault_injection.py [--write-docs] [--layer-check-only]
(18 verifies of 64 lines: 27 minutes on the 2-core machine at a load average of 7, a few
minutes when it is idle.)
Writes bench/results/fault_injection.json and .md; ``--write-docs`` also rewrites the table
between the ``fault-injection`` markers of docs/verify.md. tests/test_published_numbers.py
checks that the docs' table is the one this script renders from the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import REPO, machine_info  # noqa: E402
from fp8_folders import damage_scale  # noqa: E402  (one wrong scale, as the tests plant it)

SAMPLE = REPO / "samples" / "tiny-llama"
LAYERS = ["layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj", "layers.0.mlp.down_proj",
          "layers.2.self_attn.o_proj", "layers.3.mlp.gate_proj", "layers.5.self_attn.k_proj",
          "layers.5.mlp.down_proj", "layers.5.mlp.up_proj"]
FAULTS = ((8.0, "default"), (2.0, "strict"))
BEGIN, END = "<!-- fault-injection:begin -->", "<!-- fault-injection:end -->"
DOC = REPO / "docs" / "verify.md"
METRICS = ("kl_mean", "top1_agreement", "cosine_min", "ppl_ratio")


def verify(folder: Path, preset: str, samples: int, seq_len: int, report_dir: Path) -> dict:
    from fp8export import api
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig

    cfg = VerifyConfig(reference=SAMPLE / "model", candidate=folder,
                       data=SAMPLE / "data" / "eval.txt", thresholds=preset, samples=samples,
                       seq_len=seq_len, batch_size=8, noise_floor=False, report_dir=report_dir,
                       write_reports=False)  # only the numbers are kept
    try:
        result = api.verify(cfg)
    except VerificationFailed as exc:
        result = exc.result
    worst = ((result.layer_check or {}).get("worst") or [{}])[0]
    return {"passed": bool(result.passed), "failures": sorted(f["metric"] for f in
                                                              result.failures),
            **{k: float(result.metrics[k]) for k in METRICS},
            "layer_sqnr_min": result.metrics.get("layer_sqnr_min"),
            "worst_layer": worst.get("module")}


def measure(samples: int, seq_len: int, work: Path) -> dict:
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    t0 = time.perf_counter()
    healthy = work / "fp8"
    api.convert(ConvertConfig(checkpoint=SAMPLE / "model", output=healthy,
                              calib_data=SAMPLE / "data" / "calib.txt"))
    doc = {"samples": samples, "seq_len": seq_len, "layers": {},
           "healthy": {p: verify(healthy, p, samples, seq_len, work / f"rep-{p}")
                       for _, p in FAULTS}}
    for layer in LAYERS:
        module = f"model.{layer}"
        doc["layers"][layer] = {}
        for factor, preset in FAULTS:
            damaged = work / f"x{factor:g}"
            shutil.rmtree(damaged, ignore_errors=True)
            shutil.copytree(healthy, damaged)
            damage_scale(damaged, module, factor)
            doc["layers"][layer][f"x{factor:g}"] = {
                "preset": preset, **verify(damaged, preset, samples, seq_len, work / "rep")}
            print(f"{layer} x{factor:g} ({preset}): {doc['layers'][layer][f'x{factor:g}']}",
                  flush=True)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc


LAYER_CHECK_SAMPLES = 32  # lines at --seq-len 256: more than the check's 2,048 tokens


def layer_check_only(doc: dict, work: Path) -> dict:
    """``doc`` (a full run's results) with each run's layer check measured now and its verdict
    re-judged: the logits checks' failures as measured, and the layer check against the
    preset's bound."""
    from fp8export import api
    from fp8export.convert.config import ConvertConfig
    from fp8export.verify.thresholds import load_thresholds

    def judged(entry: dict, preset: str, folder: Path) -> dict:
        got = verify(folder, preset, LAYER_CHECK_SAMPLES, doc["seq_len"], work / "rep")
        bound = load_thresholds(preset)[1]["layer_sqnr_min"]["value"]
        logits = [f for f in entry["failures"] if f != "layer_sqnr_min"]
        layer_ok = got["layer_sqnr_min"] is not None and got["layer_sqnr_min"] >= bound
        return {**entry, "layer_sqnr_min": got["layer_sqnr_min"],
                "worst_layer": got["worst_layer"], "passed": not logits and layer_ok,
                "failures": sorted(logits + ([] if layer_ok else ["layer_sqnr_min"]))}

    t0 = time.perf_counter()
    healthy = work / "fp8"
    api.convert(ConvertConfig(checkpoint=SAMPLE / "model", output=healthy,
                              calib_data=SAMPLE / "data" / "calib.txt"))
    doc["healthy"] = {p: judged(e, p, healthy) for p, e in doc["healthy"].items()}
    for layer, faults in doc["layers"].items():
        for key, entry in faults.items():
            damaged = work / key
            shutil.rmtree(damaged, ignore_errors=True)
            shutil.copytree(healthy, damaged)
            damage_scale(damaged, f"model.{layer}", float(key[1:]))
            faults[key] = judged(entry, entry["preset"], damaged)
            print(f"{layer} {key}: {faults[key]}", flush=True)
    doc["layer_check"] = {"samples": LAYER_CHECK_SAMPLES, "seconds": round(
        time.perf_counter() - t0, 1), "note": "layer_sqnr_min measured by this later run on the "
        "first lines of the same data; the logits metrics are the full run's"}
    return doc


def _kl(x: float) -> str:
    """Two significant digits: ``0.31``, ``0.040`` from 0.01 up, ``4.3e-4`` below."""
    if x >= 0.01:
        return f"{x:.{max(0, 1 - math.floor(math.log10(x)))}f}"
    return _e(x)


def _e(x: float) -> str:
    mantissa, exp = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exp)}"


def _db(run: dict) -> str:
    """The layer check's worst layer, in dB (– where the run had no layer check)."""
    v = run.get("layer_sqnr_min")
    return "–" if v is None else f"{v:.1f}"


def render(doc: dict) -> str:
    lines = [BEGIN, "<!-- written by bench/fault_injection.py; do not edit -->", "",
             "| layer | ×8: KL mean | top-1 | cosine min | ppl ratio | layer dB | `default` | "
             "×2: KL mean | top-1 | layer dB | `strict` |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for layer, faults in doc["layers"].items():
        a, b = faults["x8"], faults["x2"]
        lines.append(f"| {layer} | {_kl(a['kl_mean'])} | {a['top1_agreement']:.3f} | "
                     f"{a['cosine_min']:.3f} | {a['ppl_ratio']:.3f} | {_db(a)} | "
                     f"{'pass' if a['passed'] else 'fail'} | {_e(b['kl_mean'])} | "
                     f"{b['top1_agreement']:.3f} | {_db(b)} | "
                     f"{'pass' if b['passed'] else 'fail'} |")
    return "\n".join(lines + ["", END])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--write-docs", action="store_true",
                    help="rewrite the table in docs/verify.md")
    ap.add_argument("--layer-check-only", action="store_true",
                    help="keep the committed logits metrics; measure the layer check only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp8export-faults-") as tmp:
        if args.layer_check_only:
            doc = json.loads((args.results / "fault_injection.json").read_text())
            doc = layer_check_only(doc, Path(tmp))
            doc["layer_check"]["machine"] = machine_info(Path(tmp))
        else:
            doc = {"machine": machine_info(Path(tmp)), **measure(args.samples, args.seq_len,
                                                                   Path(tmp))}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "fault_injection.json").write_text(json.dumps(doc, indent=1) + "\n")
    table = render(doc)
    (args.results / "fault_injection.md").write_text(table + "\n")
    if args.write_docs:
        text = DOC.read_text(encoding="utf-8")
        start, end = text.index(BEGIN), text.index(END) + len(END)
        DOC.write_text(text[:start] + table + text[end:], encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
