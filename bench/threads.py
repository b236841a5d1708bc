#!/usr/bin/env python
"""CPU threads for ``calibrate`` and ``verify`` on the sample: the old defaults against the
fitted ones (``fp8export/_threads.py``), measured in the same run.

    .venv/bin/python bench/threads.py                          # 3 rounds, verify on 64 samples
    .venv/bin/python bench/threads.py --rounds 5 --verify-samples 256

Each variant runs the real CLI in a fresh interpreter:

* ``old default``: what the commands ran before ``_threads.py``: torch is imported before
  fp8export, so libgomp loads with ``OMP_WAIT_POLICY`` unset (idle workers spin), and
  ``OMP_NUM_THREADS`` pins torch's own default count so fp8export does not refit it.
* ``fitted``: the plain command, today's default: ``OMP_WAIT_POLICY=PASSIVE`` and torch
  threads = the physical cores of the affinity mask / cgroup quota.
* ``one thread``: the fitted settings with ``OMP_NUM_THREADS=1`` (what the user walk found
  fast on a busy machine), to show whether fewer threads than cores would be better.

Per round the variants run back to back, in an order that rotates each round; the table shows
the median wall time and CPU seconds (user + system of the child, from ``wait4``) and the
command's own measure of its work (calibrate: the calibration pass; verify: ``report.json``'s
``timing.total_s``, loading, running and comparing the models). The machine is shared: its load
(``os.getloadavg``) is recorded before every run, and only numbers from the same run compare.
Writes ``bench/results/threads.json`` and ``threads.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_info, md_table, run_measured, write_json  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"
# The CLI, run as a program that may import torch first (the old default).
LAUNCH = ("import sys\n{pre}from fp8export.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def torch_default_threads() -> int:
    """torch's own intra-op thread count in a clean interpreter (no fp8export)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.strip())


def variants(default_threads: int) -> dict[str, tuple[str, dict[str, str]]]:
    """name -> (launcher code, environment)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    clean["CI"] = "1"  # one [stage] line per step instead of progress bars
    return {
        "old default": (LAUNCH.format(pre="import torch  # libgomp loads, OMP_WAIT_POLICY unset\n"),
                        {**clean, "OMP_NUM_THREADS": str(default_threads)}),
        "fitted": (LAUNCH.format(pre=""), clean),
        "one thread": (LAUNCH.format(pre=""), {**clean, "OMP_NUM_THREADS": "1"}),
    }


def own_seconds(kind: str, log: Path, report_dir: Path) -> float | None:
    """The command's own measure of its work, from its output."""
    if kind == "calibrate":
        m = re.search(r"calibrated .*, ([\d.]+)s\)", log.read_text(errors="replace"))
        return float(m.group(1)) if m else None
    try:
        return json.loads((report_dir / "report.json").read_text())["timing"]["total_s"]
    except (OSError, ValueError, KeyError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verify-samples", type=int, default=64)
    ap.add_argument("--work", type=Path, default=REPO / "bench" / "_work" / "threads")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    fp8 = work / "fp8"
    subprocess.run([sys.executable, "-m", "fp8export.cli", "convert", str(SAMPLE / "model"),
                    "-o", str(fp8), "--calib-data", str(SAMPLE / "data" / "calib.txt"),
                    "--force"], check=True, capture_output=True, env={**os.environ, "CI": "1"})
    default_threads = torch_default_threads()
    runs = variants(default_threads)
    jobs = {
        "calibrate": lambda name, out: [
            "calibrate", str(SAMPLE / "model"), "--calib-data", str(SAMPLE / "data/calib.txt"),
            "-o", str(out / "amax.json"), "--force"],
        "verify": lambda name, out: [
            "verify", str(SAMPLE / "model"), str(fp8), "--data", str(SAMPLE / "data/eval.txt"),
            "--samples", str(args.verify_samples), "--report-dir", str(out / "report"),
            "--force"],
    }
    info = machine_info(work)
    info["torch_default_threads"] = default_threads
    sys.path.insert(0, str(REPO))
    from fp8export._threads import cpu_threads

    info["fitted_threads"] = cpu_threads()
    records = []
    names = list(runs)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for job, argv_of in jobs.items():
            for name in order:
                code, env = runs[name]
                out = work / f"{job}-{name.replace(' ', '_')}"
                out.mkdir(exist_ok=True)
                load = os.getloadavg()
                res = run_measured([sys.executable, "-c", code, *argv_of(name, out)],
                                   out / "log.txt", env=env)
                if res.returncode != 0:
                    print((out / "log.txt").read_text()[-2000:], file=sys.stderr)
                    raise SystemExit(f"{job} ({name}) failed with exit {res.returncode}")
                rec = {"round": r, "job": job, "variant": name, "wall_s": round(res.seconds, 2),
                       "cpu_s": round(res.cpu_seconds, 2),
                       "own_s": own_seconds(job, out / "log.txt", out / "report"),
                       "load_1m_before": round(load[0], 2)}
                records.append(rec)
                print(f"round {r} {job:9s} {name:11s} wall {rec['wall_s']:6.2f}s  cpu "
                      f"{rec['cpu_s']:6.2f}s  own {rec['own_s']}s  load {rec['load_1m_before']}",
                      flush=True)
                time.sleep(1)

    rows, summary = [], {}
    for job in jobs:
        base = None
        for name in names:
            mine = [x for x in records if x["job"] == job and x["variant"] == name]
            med = {k: statistics.median(x[k] for x in mine if x[k] is not None)
                   for k in ("wall_s", "cpu_s", "own_s")}
            base = base or med
            summary.setdefault(job, {})[name] = {**med, "runs": mine}
            rows.append((job, name, f"{med['wall_s']:.2f}", f"{med['cpu_s']:.2f}",
                         f"{med['own_s']:.2f}", f"{base['wall_s'] / med['wall_s']:.2f}x",
                         ", ".join(f"{x['load_1m_before']:.1f}" for x in mine)))
    header = ("command", "threads", "wall s (median)", "CPU s", "own s", "speed-up vs old",
              "load before each run")
    table = md_table(rows, header)
    loads = [x["load_1m_before"] for x in records]
    note = (f"{args.rounds} rounds; calibrate: all 256 samples of calib.txt; verify: "
            f"{args.verify_samples} samples of eval.txt. Machine: {info['cores']} cores, torch "
            f"default {default_threads} threads, fitted {info['fitted_threads']}; 1-minute load "
            f"before the runs {min(loads):.1f}-{max(loads):.1f} (shared machine).")
    print("\n" + table + "\n\n" + note)
    write_json(args.results / "threads.json", {"machine": info, "rounds": args.rounds,
                                               "verify_samples": args.verify_samples,
                                               "summary": summary})
    (args.results / "threads.md").write_text(
        "# CPU threads: calibrate and verify on the sample (bench/threads.py)\n\n"
        + table + "\n\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
