#!/usr/bin/env python
"""The family matrix as a table: per tiny model of each family, the FP8 folder's and the FP8
ONNX graph's accuracy against the bf16 checkpoint, and the time of each step.

    python bench/families.py            # every family of tests/families/model_families.py

Each family's tiny random model is built and saved by transformers (``save_family``), then
``convert --scales calibrate`` (32 calibration lines, 64 tokens), ``export-onnx`` (fp32) and
``verify`` of the folder and of the graph (8 evaluation lines, 64 tokens, CPU), exactly as
``tests/families/test_family_matrix.py`` runs them. Writes ``bench/results/families.json``
and ``families.md``. Random weights give near-uniform next-token probabilities, so top-1
agreement is mostly ties; KL is the number to read.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests" / "families"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from model_families import FAMILIES, save_family  # noqa: E402
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


def main() -> None:
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
