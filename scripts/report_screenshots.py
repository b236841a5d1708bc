"""Regenerate the pictures in docs/images/ from the sample LM, as a reader's browser shows them.

    .venv/bin/python scripts/report_screenshots.py [--work DIR]

Converts samples/tiny-llama/model (static input scales calibrated on data/calib.txt), verifies
the FP8 folder and a copy with one weight scale multiplied by 8 (the damaged candidate of
docs/verify.md) on 64 lines of data/eval.txt with --per-layer, draws `inspect --plot` SVGs of
the checkpoint and the FP8 folder, checks every page in headless Chromium (no overlapping
labels, no empty panels) and takes screenshots. Needs Chromium (tests/browser.py); 5-10
minutes on two busy CPU cores (the two verify runs).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "verify"))

from browser import chromium, layout_problems, measure, screenshot  # noqa: E402
from fp8_folders import damage_scale  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"
IMAGES = REPO / "docs" / "images"
DAMAGED = "model.layers.3.mlp.up_proj"


def fp8export(*args: str) -> None:
    cmd = [str(REPO / ".venv" / "bin" / "fp8export"), *args]
    rc = subprocess.run(cmd, cwd=REPO, check=False).returncode
    if rc not in (0, 3):  # 3: the damaged candidate fails, as it should
        raise SystemExit(f"{' '.join(cmd)} exited {rc}")


def checked(path: Path, width: int) -> None:
    problems = layout_problems(measure(path, width))
    if problems:
        raise SystemExit(f"{path}: the layout has problems:\n  " + "\n  ".join(problems))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="keep the outputs here")
    args = ap.parse_args()
    if chromium() is None:
        raise SystemExit("needs Chromium: apt-get install chromium (or set $CHROMIUM)")
    work = args.work or Path(tempfile.mkdtemp(prefix="fp8export-shots-"))
    work.mkdir(parents=True, exist_ok=True)
    fp8, bad = work / "tiny-llama-fp8", work / "tiny-llama-fp8-damaged"
    fp8export("convert", "samples/tiny-llama/model", "-o", str(fp8), "--calib-data",
              "samples/tiny-llama/data/calib.txt", "--force")
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(fp8, bad)
    damage_scale(bad, DAMAGED, 8.0)
    common = ["--data", "samples/tiny-llama/data/eval.txt", "--samples", "64", "--per-layer"]
    fp8export("verify", "samples/tiny-llama/model", str(fp8), *common,
              "--report-dir", str(work / "report"))
    fp8export("verify", "samples/tiny-llama/model", str(bad), *common,
              "--report-dir", str(work / "report-damaged"))
    fp8export("inspect", "samples/tiny-llama/model", "--plot", str(work / "scales.svg"),
              "--force")
    fp8export("inspect", str(fp8), "--plot", str(work / "scales-fp8.svg"), "--force")
    IMAGES.mkdir(parents=True, exist_ok=True)
    for page, width in ((work / "report" / "report.html", 1200),
                        (work / "report-damaged" / "report.html", 1200),
                        (work / "scales.svg", 900), (work / "scales-fp8.svg", 900)):
        checked(page, width)
    ok, damaged = work / "report" / "report.html", work / "report-damaged" / "report.html"
    shots = {"report-passed.png": (ok, None, "figure-3"),
             "report-failed.png": (damaged, None, "figure-3"),
             "report-failed-logits.png": (damaged, "figure-3", "layers"),
             "report-failed-samples.png": (damaged, "worst-samples", "metrics")}
    for name, (page, start, stop) in shots.items():
        screenshot(page, IMAGES / name, 1200, start, stop)
    screenshot(work / "scales-fp8.svg", IMAGES / "inspect-plot-fp8.png", 880)
    screenshot(work / "scales.svg", IMAGES / "inspect-plot-checkpoint.png", 880)
    print(f"screenshots in {IMAGES}; outputs in {work}")


if __name__ == "__main__":
    main()
