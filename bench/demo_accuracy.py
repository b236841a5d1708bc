"""The README's sample accuracy rows, as the demo prints them: run scripts/demo.sh as a new user
does and keep what its two verify runs reported.

The README's table of the sample LM (torch FP8 emulation and the FP8 ONNX graph, against the
bf16 reference on all 256 lines of eval.txt) must be the numbers `bash scripts/demo.sh` prints,
so this script runs exactly that script (into a temporary DEMO_OUT) and copies each verify
run's report.json, and the console lines the demo printed, to bench/results/demo/.
tests/test_published_numbers.py checks the README's rows against them.

Run:  .venv/bin/python bench/demo_accuracy.py   (the whole demo: about 10 minutes on 2 idle
cores, much longer under load)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_info  # noqa: E402

REPORTS = ("report-torch-fp8", "report-onnx")


def main() -> None:
    out = REPO / "bench" / "results" / "demo"
    with tempfile.TemporaryDirectory(prefix="fp8export-demo-") as tmp:
        env = {**os.environ, "DEMO_OUT": tmp, "CI": "1"}
        t0 = time.perf_counter()
        run = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], env=env, cwd=REPO,
                             capture_output=True, text=True)
        seconds = round(time.perf_counter() - t0, 1)
        if run.returncode != 0:
            sys.exit(f"demo.sh failed ({run.returncode}):\n{run.stderr[-4000:]}")
        out.mkdir(parents=True, exist_ok=True)
        for name in REPORTS:
            shutil.copyfile(Path(tmp) / name / "report.json", out / f"{name}.json")
        printed = [ln for ln in (run.stdout + run.stderr).splitlines()
                   if ln.startswith(("PASSED:", "FAILED:", "+ "))]
        doc = {"machine": machine_info(Path(tmp)), "seconds": seconds, "printed": printed}
        (out / "demo.json").write_text(json.dumps(doc, indent=1) + "\n")
    for line in printed:
        print(line)


if __name__ == "__main__":
    main()
