#!/usr/bin/env python
"""The family matrix as a table: per tiny model of each family, the FP8 folder's and the FP8
ONNX graph's accuracy against the bf16 checkpoint, and the time of each step.

    python bench/families.py            # every family of tests/families/model_families.py
    python bench/families.py --next     # the newer families (next_families.py): every
                                        # command, each a result or its Error line
    python bench/families.py --next jamba whisper   # only those rows (merged into the JSON)
    python bench/families.py --next --render        # families_next.md from the JSON

Each family's tiny random model is built and saved by transformers (``save_family``), then
``convert --scales calibrate`` (32 calibration lines, 64 tokens), ``export-onnx`` (fp32) and
``verify`` of the folder and of the graph (8 evaluation lines, 64 tokens, CPU), exactly as
``tests/families/test_family_matrix.py`` runs them. Writes ``bench/results/families.json``
and ``families.md``. Random weights give near-uniform next-token probabilities, so top-1
agreement is mostly ties; KL is the number to read.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests" / "families"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from model_families import FAMILIES, save_family  # noqa: E402
from next_families import NEXT_FAMILIES, save_next, write_media  # noqa: E402
from test_family_matrix import THRESHOLDS  # noqa: E402

from bench._common import machine_info  # noqa: E402

DATA = REPO / "samples" / "tiny-llama" / "data"


def run(family: str, work: Path) -> dict:
    from fp8export.api import convert, export_onnx, verify
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import VerificationFailed
    from fp8export.onnx.export import ExportOnnxConfig
    from fp8export.verify.config import VerifyConfig

    src = save_family(family, work / "src")
    t = {}
    t0 = time.perf_counter()
    convert(ConvertConfig(checkpoint=src, output=work / "fp8", scales="calibrate",
                          calib_data=DATA / "calib.txt", calib_samples=32, seq_len=64))
    t["convert_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    export_onnx(ExportOnnxConfig(fp8_dir=work / "fp8", output=work / "m.onnx", dtype="fp32"))
    t["export_s"] = time.perf_counter() - t0
    row = {"family": family, "model_type": FAMILIES[family][0]}
    thresholds = work / "thresholds.json"
    thresholds.write_text(json.dumps(THRESHOLDS))
    for name, cand in (("folder", work / "fp8"), ("onnx", work / "m.onnx")):
        t0 = time.perf_counter()
        try:
            res = verify(VerifyConfig(reference=src, candidate=cand, data=DATA / "eval.txt",
                                      samples=8, seq_len=64, report_dir=work / f"r-{name}",
                                      noise_floor=False, device="cpu",
                                      thresholds=str(thresholds)))
        except VerificationFailed as exc:
            res = exc.result
        t[f"verify_{name}_s"] = time.perf_counter() - t0
        row[name] = {k: res.metrics[k] for k in ("kl_mean", "top1_agreement", "cosine_min")}
        row[name]["passed"] = res.passed
        if name == "folder" and res.candidate.get("moe"):
            row["moe_expert_gemms"] = res.candidate["moe"]["expert_gemms"]
    manifest = json.loads((work / "fp8" / "fp8export.json").read_text())
    row["quantized_layers"] = len(manifest["quantized"])
    row["seconds"] = {k: round(v, 2) for k, v in t.items()}
    return row


# Rows of the newer families: (row, family, calibration/evaluation data). The language tower
# on text; LLaVA also on images and Whisper on audio, through the processors saved with them.
NEXT_ROWS = [*((f, f, None) for f in NEXT_FAMILIES if f != "whisper"),
             ("llava + images", "llava", "images.jsonl"), ("whisper", "whisper", "audio.jsonl")]
STEPS = ("convert (weights)", "convert (calibrated)", "calibrate", "verify", "inspect",
         "export-onnx", "verify onnx", "transformers")
FOLDER_STEPS = ("verify", "inspect", "export-onnx", "transformers")


def run_next(row: str, family: str, media_file: str | None, work: Path, media: Path) -> dict:
    """Every command on one newer family: per step ``ok`` with its numbers, or the Error
    line fp8export printed (``Fp8ExportError``), or the crash (a bug). ``transformers``:
    ``from_pretrained`` of the calibrated folder (else the weights-only one) generating 8
    tokens next to the bf16 model (``tests/families/hf_generate.py``); an exception there is
    raised inside transformers (``upstream``: shown as "fails in transformers")."""
    from hf_generate import compare

    from fp8export.api import calibrate, convert, export_onnx, inspect, verify
    from fp8export.calibration.config import CalibrateConfig
    from fp8export.convert.config import ConvertConfig
    from fp8export.errors import Fp8ExportError, VerificationFailed
    from fp8export.onnx.export import ExportOnnxConfig
    from fp8export.verify.config import VerifyConfig

    src = save_next(family, work / "src")
    data = media / media_file if media_file else DATA / "calib.txt"
    eval_data = media / media_file if media_file else DATA / "eval.txt"
    thresholds = work / "thresholds.json"
    thresholds.write_text(json.dumps(THRESHOLDS))
    fp8 = work / "fp8"

    def check(cand):
        try:
            res = verify(VerifyConfig(reference=src, candidate=cand, data=eval_data, samples=8,
                                      seq_len=64, report_dir=work / f"r-{cand.name}",
                                      noise_floor=False, device="cpu",
                                      thresholds=str(thresholds)))
        except VerificationFailed as exc:
            res = exc.result
        return {"kl_mean": res.metrics["kl_mean"], "top1": res.metrics["top1_agreement"],
                "passed": res.passed}

    def folder():  # the calibrated folder; the weights-only one where calibration is refused
        return fp8 if fp8.exists() else work / "w"

    def transformers_run():
        out = compare(family, src, folder(), media)
        return {"kl_mean": out["kl_mean"], "top1": out["top1"], "passed": (
            out["kl_mean"] <= THRESHOLDS["kl_mean"]
            and out["top1"] >= THRESHOLDS["top1_agreement"] and not out["missing"]),
            "same_tokens": f"{out['same_tokens']}/{out['tokens']}"}

    steps = {
        "convert (weights)": lambda: _quantized(convert(ConvertConfig(
            checkpoint=src, output=work / "w", scales="weights")).output),
        "convert (calibrated)": lambda: _quantized(convert(ConvertConfig(
            checkpoint=src, output=fp8, scales="calibrate", calib_data=data, calib_samples=32,
            seq_len=64)).output),
        "calibrate": lambda: len(calibrate(CalibrateConfig(
            checkpoint=src, calib_data=data, output=work / "amax.json", calib_samples=32,
            seq_len=64)).amax),
        "verify": lambda: check(folder()),
        "inspect": lambda: len(inspect(folder()).tensors),
        "export-onnx": lambda: len(export_onnx(ExportOnnxConfig(
            fp8_dir=folder(), output=work / "m.onnx", dtype="fp32")).fp8_gemms),
        "verify onnx": lambda: check(work / "m.onnx"),
        "transformers": transformers_run,
    }
    out_row = {"row": row, "family": family, "model_type": NEXT_FAMILIES[family][0],
               "data": data.name, "steps": {}}
    for step in STEPS:
        t0 = time.perf_counter()
        if step == "verify onnx" and not (work / "m.onnx").exists():
            out_row["steps"][step] = {"result": "not run", "message": "no graph", "seconds": 0}
            continue
        try:
            out = {"result": "ok", "value": steps[step]()}
        except Fp8ExportError as exc:
            out = {"result": "Error", "message": str(exc).splitlines()[0][:400]}
        except Exception as exc:  # a crash is a bug (ours), or transformers' own
            out = {"result": "upstream" if step == "transformers" else "crash",
                   "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out["seconds"] = round(time.perf_counter() - t0, 2)
        if step in FOLDER_STEPS and not fp8.exists() and (work / "w").exists():
            out["folder"] = "weights-only"
        out_row["steps"][step] = out
        print(f"{row:15s} {step:22s} {out['result']:5s} {out['seconds']:7.1f} s  "
              f"{out.get('value', out.get('message', ''))}", flush=True)
    return out_row


def _quantized(folder) -> int:
    return len(json.loads((Path(folder) / "fp8export.json").read_text())["quantized"])


def _cell(step: dict) -> str:
    which = " (weights-only folder)" if step.get("folder") else ""
    if step["result"] != "ok":  # the Error line without its temporary path
        message = re.sub(r"^/\S+: ", "", step["message"]).replace("|", "/")
        result = {"upstream": "fails in transformers"}.get(step["result"], step["result"])
        return f"{result}{which}: {message[:170]}"
    v = step["value"]
    if isinstance(v, dict):
        tokens = f", tokens {v['same_tokens']}" if "same_tokens" in v else ""
        return (f"KL {v['kl_mean']:.1e}, top-1 {v['top1']:.2f}{tokens}"
                f"{'' if v['passed'] else ' FAIL'}{which}")
    return f"ok ({v}){which}"


def main_next() -> None:
    import os

    out = REPO / "bench" / "results"
    if "--render" not in sys.argv[1:]:
        rows = []
        load = os.getloadavg()
        with tempfile.TemporaryDirectory(prefix="fp8export-bench-") as tmp:
            machine = machine_info(Path(tmp))
            (Path(tmp) / "media").mkdir()
            media = write_media(Path(tmp) / "media")
            only = [a for a in sys.argv[1:] if not a.startswith("--")]
            for row, family, media_file in NEXT_ROWS:
                if not only or row in only:
                    rows.append(run_next(row, family, media_file,
                                         Path(tmp) / row.replace(" ", "_"), media))
        machine["load_average_at_start"] = [round(x, 1) for x in load]
        doc = {"machine": machine, "rows": rows}
        path = out / "families_next.json"
        if only and path.is_file():  # a few rows again: the others stay, the run is recorded
            doc = json.loads(path.read_text())
            again = {r["row"]: r for r in rows}
            doc["rows"] = [again.pop(r["row"], r) for r in doc["rows"]] + list(again.values())
            doc.setdefault("reruns", []).append({"rows": sorted(only), "machine": machine})
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    doc = json.loads((out / "families_next.json").read_text())
    (out / "families_next.md").write_text(render_next(doc))
    print("wrote", out / "families_next.json", "and", out / "families_next.md")


def render_next(doc: dict) -> str:
    """``families_next.md`` from ``families_next.json`` (``--next --render`` rewrites it)."""
    machine = doc["machine"]
    lines = ["# Newer families (bench/families.py --next)", "",
             "Tiny random models saved by transformers (tests/families/next_families.py); every "
             "command per family: `ok` (number of FP8 linears, amaxes, tensors, ONNX FP8 "
             "GEMMs), verify's KL / top-1 against bf16 (8 samples, 64 tokens, CPU; the "
             "matrix's thresholds), or the `Error:` line fp8export prints. `transformers`: "
             "`from_pretrained(folder)` (default configuration, compressed-tensors installed) "
             "generating 8 greedy tokens beside the bf16 model: KL / top-1 of the logits over "
             "the bf16 model's sequence and the generated tokens that agree. Data: calib.txt / "
             "eval.txt (the language tower); `llava + images`: images.jsonl (12 PNGs + a text "
             "line, through LLaVA's processor); Whisper: audio.jsonl (0.8 s clips + "
             "transcripts). Where the calibrated convert is refused, verify, inspect, "
             "export-onnx and transformers take the weights-only folder (marked); `not run`: no "
             "graph to verify.",
             "", f"Machine: {machine['cores']} cores, shared (load average "
             f"{machine['load_average_at_start'][0]} at the start): seconds are wall time "
             f"under that load. Commit {machine.get('git_commit', '?')}, transformers "
             f"{machine.get('versions', {}).get('transformers', '?')}.", "",
             "| family | " + " | ".join(STEPS) + " | seconds |",
             "|---|" + "---|" * (len(STEPS) + 1)]
    for rerun in doc.get("reruns", []):
        m = rerun["machine"]
        lines.insert(-2, f"Rows {', '.join(rerun['rows'])} run again later: commit "
                         f"{m.get('git_commit', '?')}, load average "
                         f"{m['load_average_at_start'][0]} at their start.\n")
    for r in doc["rows"]:
        total = sum(s["seconds"] for s in r["steps"].values())
        lines.append(f"| {r['row']} | " + " | ".join(_cell(r["steps"][s]) for s in STEPS)
                     + f" | {total:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--next" in sys.argv[1:]:
        main_next()
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        machine = machine_info(Path(tmp))
        for family in FAMILIES:
            rows.append(run(family, Path(tmp) / family))
            r = rows[-1]
            print(f"{family:12s} layers {r['quantized_layers']:3d}  folder KL "
                  f"{r['folder']['kl_mean']:.2e} top-1 {r['folder']['top1_agreement']:.3f}  "
                  f"onnx KL {r['onnx']['kl_mean']:.2e} top-1 {r['onnx']['top1_agreement']:.3f}  "
                  f"{sum(r['seconds'].values()):.1f} s", flush=True)
    out = REPO / "bench" / "results"
    doc = {"machine": machine, "rows": rows}
    (out / "families.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    lines = ["# Family matrix (bench/families.py)", "",
             "Tiny random models saved by transformers; convert --scales calibrate, export-onnx "
             "(fp32), verify on 8 lines of eval.txt (64 tokens), CPU. Random weights make top-1 "
             "mostly ties; read KL.", "",
             f"Gate: the matrix's thresholds {json.dumps(THRESHOLDS)}.", "",
             "| family | FP8 linears | folder KL | folder top-1 | ONNX KL | ONNX top-1 | "
             "passes | expert projection calls (FP8) | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        moe = (r.get("moe_expert_gemms") or {}).get("float8_e4m3fn", "–")
        lines.append(f"| {r['family']} | {r['quantized_layers']} | {r['folder']['kl_mean']:.2e} "
                     f"| {r['folder']['top1_agreement']:.3f} | {r['onnx']['kl_mean']:.2e} | "
                     f"{r['onnx']['top1_agreement']:.3f} | "
                     f"{'yes' if r['folder']['passed'] and r['onnx']['passed'] else 'NO'} | "
                     f"{moe} | "
                     f"{sum(r['seconds'].values()):.1f} |")
    (out / "families.md").write_text("\n".join(lines) + "\n")
    print("wrote", out / "families.json", "and", out / "families.md")


if __name__ == "__main__":
    main()
