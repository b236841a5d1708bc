"""Every input path and data file is checked before any hashing or model loading: a typo fails
at once with one clear error, before torch is even imported (that is what loading a model or
scanning weights needs first). Each case runs the real CLI in a fresh interpreter and reports
whether torch was imported by the time it exited."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "samples" / "tiny-llama" / "model"
CALIB = REPO / "samples" / "tiny-llama" / "data" / "calib.txt"
PROBE = ("import sys\nfrom fp8export.cli import main\ncode = main(sys.argv[1:])\n"
         "print('torch imported:', 'torch' in sys.modules)\nsys.exit(code)\n")

CASES = {
    "convert, --calib-data missing": (
        lambda t: ["convert", MODEL, "-o", t / "o", "--calib-data", t / "calb.txt"],
        "no such data file"),
    "convert, --calib-data of an unknown format": (
        lambda t: ["convert", MODEL, "-o", t / "o", "--calib-data", REPO / "README.md"],
        "unknown data format '.md'"),
    "convert, --calib-data empty": (
        lambda t: ["convert", MODEL, "-o", t / "o", "--calib-data", t / "empty.txt"],
        "the data file is empty"),
    "convert, --calib-amax missing": (
        lambda t: ["convert", MODEL, "-o", t / "o", "--calib-amax", t / "amx.json"],
        "no such amax file"),
    "convert, checkpoint missing": (lambda t: ["convert", t / "nomodel", "-o", t / "o"],
                                    "no such file or folder"),
    "convert, output exists": (lambda t: ["convert", MODEL, "-o", t / "exists"],
                               "already exists"),
    "calibrate, --calib-data missing": (
        lambda t: ["calibrate", MODEL, "--calib-data", t / "calb.txt", "-o", t / "a.json"],
        "no such data file"),
    "calibrate, checkpoint missing": (
        lambda t: ["calibrate", t / "nomodel", "--calib-data", CALIB, "-o", t / "a.json"],
        "no such file or folder"),
    "verify, --data missing": (
        lambda t: ["verify", MODEL, MODEL, "--data", t / "eval.tx", "--report-dir", t / "r"],
        "no such data file"),
    "inspect, an empty folder": (lambda t: ["inspect", t / "empty"], "no weights found"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_path_fails_before_any_work(case, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "exists").mkdir()
    (tmp_path / "empty.txt").write_text("")
    args, message = CASES[case]
    r = subprocess.run([sys.executable, "-c", PROBE, *map(str, args(tmp_path))],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "[stage]" not in r.stderr  # no hashing, no model loading started
    assert "torch imported: False" in r.stdout, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "empty.txt", "exists"]
