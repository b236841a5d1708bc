#!/usr/bin/env python3
"""The newer families on the GPU FP8 runtime: the table of a run of
``tests/families/test_next_families_gpu.py``, from its JUnit XML.

    python3 -m pytest -m gpu -o junit_family=xunit1 tests/families/test_next_families_gpu.py \\
        --junitxml families.xml                          # on a GPU (the test records its numbers)
    python bench/families_next_gpu.py families.xml --md bench/results/families_next_gpu.md

Per family: the test's verdict (pass, fail with its assertion, or refused with the runtime's
named reason), what it ran on, and its numbers (``record_property``; JUnit's ``xunit1`` form
keeps them): KL and top-1 of the FP8 logits against the bf16 model on the same GPU, the same KL
of the runtime's emulation (what ``verify`` computes on a CPU), the largest rel-L2 of one
quantized linear's GPU output against its emulation on the same input and the largest
distance over that layer's budget (one bf16 step + the FP8 accumulation), and end to end the
rel-L2 of the GPU logits against the emulated model's next to the FP8 error itself (emulated
against bf16). Writes the Markdown table and a JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TEST_MODULE = "test_next_families_gpu"


def read_junit(path: Path, module: str | None = TEST_MODULE) -> list[dict]:
    """One dict per test case of ``module`` (a run may hold other tests; None: every case):
    its recorded properties, ``outcome`` and failure message."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if module and module not in case.get("classname", ""):
            continue
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        outcome = "failed" if failure is not None else "skipped" if skipped is not None \
            else "passed"
        message = ""
        if failure is not None:
            message = (failure.get("message") or failure.text or "").strip()
        elif skipped is not None:
            message = (skipped.get("message") or "").strip()
        m = re.search(r"\[(.+)\]$", case.get("name", ""))
        props.setdefault("family", m.group(1) if m else case.get("name"))
        rows.append({**props, "outcome": outcome, "message": message,
                     "seconds": float(case.get("time") or 0)})
    return rows


def _num(value, fmt: str) -> str:
    try:
        return format(float(value), fmt)
    except (TypeError, ValueError):
        return "–"


def table(rows: list[dict], source: str) -> str:
    devices = sorted({r["device"] for r in rows if r.get("device")})
    out = ["# The newer families on the GPU FP8 runtime", "",
           f"Device: {', '.join(devices) or 'not recorded'}. Rendered by "
           f"`bench/families_next_gpu.py` from `{source}` (a run of "
           "`tests/families/test_next_families_gpu.py`).", "",
           "Each tiny model converted with calibrated static scales and loaded with "
           "`load_fp8_model(device=\"cuda\", mode=\"scaled_mm\")`: KL and top-1 of its logits "
           "against the bf16 model on the same GPU (thresholds: KL ≤ 2e-3, top-1 ≥ 0.75, the "
           "family matrix's), the KL of the runtime's emulation (what `verify` computes on a "
           "CPU; the GPU's must be within 25% of it), the largest rel-L2 of one quantized "
           "linear's GPU output against its emulation on the same input, and its distance "
           "over that layer's budget (one bf16 step of each output + the FP8 tensor cores' "
           "accumulation: ≤ 1×), and end to "
           "end the rel-L2 of the GPU logits against the emulated model's next to the FP8 "
           "error itself (emulated against bf16; recorded, not bounded: last-bit differences "
           "re-quantized to E4M3 cascade through the layers).", "",
           "| family | status | inputs | FP8 linears on the GPU path / quantized | KL vs bf16 | "
           "KL, emulated | top-1 | worst layer vs emulation: rel-L2 / × budget | logits "
           "rel-L2: GPU vs "
           "emulated / emulated vs bf16 | s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r.get("status") or r["outcome"]
        if r["outcome"] == "failed":
            status = "FAIL: " + r["message"].splitlines()[0][:160] if r["message"] else "FAIL"
        elif r["outcome"] == "skipped":
            status = f"skipped: {r['message'][:120]}"
        status = status.replace("|", "\\|")
        linears = (f"{r.get('on_fp8_path', '–')} / {r.get('quantized', '–')}"
                   if r.get("quantized") else "–")
        out.append(f"| {r['family']} | {status} | {r.get('inputs', '–')} | {linears} | "
                   f"{_num(r.get('kl_mean'), '.2e')} | {_num(r.get('kl_mean_emulated'), '.2e')} "
                   f"| {_num(r.get('top1'), '.3f')} | {_num(r.get('layer_rel_l2_max'), '.2e')} / "
                   f"{_num(r.get('layer_over_budget_max'), '.2f')} "
                   f"| {_num(r.get('rel_l2_vs_emulation'), '.2e')} / "
                   f"{_num(r.get('rel_l2_emulated_vs_bf16'), '.2e')} | {r['seconds']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--md", type=Path, required=True)
    ap.add_argument("--source", default=None, help="the JUnit file's name in the report")
    ap.add_argument("--notes", type=Path, default=None, help="appended to --md")
    args = ap.parse_args(argv)
    rows = read_junit(args.junit)
    text = table(rows, args.source or str(args.junit))
    if args.notes is not None:
        text += "\n" + args.notes.read_text().rstrip() + "\n"
    args.md.write_text(text)
    args.md.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(args.md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
