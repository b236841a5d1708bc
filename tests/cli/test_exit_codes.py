"""The exit-code contract, per command: 0 / 1 bad input / 2 usage / 3 verify / 4 internal error /
130 Ctrl-C, and a
last stderr line ``PASSED | <cmd> | <s>`` or ``FAILED | <cmd> | <s>`` in every case.

Runs the real CLI in-process on the shipped sample LM. Ctrl-C is simulated per command by making
the library call raise KeyboardInterrupt (what Python raises on SIGINT); one test sends a real
SIGINT to a subprocess in the middle of a calibrated convert.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fp8export.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    EXIT_VERIFY_FAILED,
)

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "samples" / "tiny-llama"
MODEL, CALIB, EVAL = SAMPLE / "model", SAMPLE / "data" / "calib.txt", SAMPLE / "data" / "eval.txt"
STATUS = re.compile(r"^(PASSED|FAILED) \| (\S+) \| \d+\.\d\ds$")


def _status(result) -> tuple[str, str]:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, f"no stderr at all:\n{result.output}"
    m = STATUS.match(lines[-1])
    assert m, f"last stderr line is not a status line: {lines[-1]!r}\n{result.output}"
    return m.group(1), m.group(2)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    from click.testing import CliRunner

    from fp8export.cli import cli

    out = tmp_path_factory.mktemp("exit") / "fp8"
    r = CliRunner().invoke(cli, ["convert", str(MODEL), "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_success_ends_with_passed(run_cli, fp8_dir, tmp_path):
    runs = {
        "convert": ["convert", MODEL, "-o", tmp_path / "c", "--scales", "weights"],
        "calibrate": ["calibrate", MODEL, "--calib-data", CALIB, "--calib-samples", "4",
                      "-o", tmp_path / "amax.json"],
        "inspect": ["inspect", fp8_dir],
        "verify": ["verify", MODEL, fp8_dir, "--data", EVAL, "--samples", "4",
                   "--report-dir", tmp_path / "rep", "--thresholds", "loose"],
    }  # export-onnx: tests/onnx/test_onnx_sample_lm.py; build-engine needs TensorRT
    for name, args in runs.items():
        r = run_cli(*args)
        assert r.exit_code == 0, r.output
        assert _status(r) == ("PASSED", name)


def test_verify_threshold_failure_is_3_and_failed(run_cli, fp8_dir, tmp_path):
    strict = tmp_path / "impossible.yaml"
    strict.write_text("kl_mean: 0.0\n")  # any rounding at all misses it
    r = run_cli("verify", MODEL, fp8_dir, "--data", EVAL, "--samples", "4",
                "--report-dir", tmp_path / "rep", "--thresholds", strict)
    assert r.exit_code == EXIT_VERIFY_FAILED, r.output
    assert _status(r) == ("FAILED", "verify")
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["passed"] is False


USAGE = {
    "convert": lambda t: ["convert", MODEL, "-o", t / "o", "--scales", "calibrate"],
    "calibrate": lambda t: ["calibrate", MODEL, "--calib-data", CALIB, "--percentile", "99"],
    "export-onnx": lambda t: ["export-onnx", t, "--opset", "30"],
    "build-engine": lambda t: ["build-engine", t / "m.onnx", "--shapes", "input_ids:1x8"],
    "verify": lambda t: ["verify", MODEL, t, "--thresholds", "bogus"],
    "inspect": lambda t: ["inspect"],
    "fp8export": lambda t: ["--no-such-option"],
}


@pytest.mark.parametrize("name", USAGE)
def test_usage_errors_are_2_and_failed(run_cli, tmp_path, name):
    r = run_cli(*USAGE[name](tmp_path))
    assert r.exit_code == EXIT_USAGE, r.output
    assert _status(r) == ("FAILED", name)
    assert "Traceback" not in r.output and "Error:" in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


BAD_INPUT = {
    "convert": lambda t: ["convert", t / "missing", "-o", t / "o"],
    "calibrate": lambda t: ["calibrate", t / "missing", "--calib-data", CALIB, "-o", t / "a.json"],
    "export-onnx": lambda t: ["export-onnx", t / "missing", "-o", t / "m.onnx"],
    "build-engine": lambda t: ["build-engine", t / "missing.onnx"],
    "verify": lambda t: ["verify", MODEL, t / "missing.onnx"],
    "inspect": lambda t: ["inspect", t / "missing"],
}


@pytest.mark.parametrize("name", BAD_INPUT)
def test_bad_input_is_1_one_error_and_failed(run_cli, tmp_path, name):
    r = run_cli(*BAD_INPUT[name](tmp_path))
    assert r.exit_code == EXIT_BAD_INPUT, r.output
    assert _status(r) == ("FAILED", name)
    assert "Traceback" not in r.output
    assert sum(line.startswith("Error:") for line in r.stderr.splitlines()) == 1, r.stderr
    assert list(tmp_path.iterdir()) == []


API_OF = {"convert": "convert", "calibrate": "calibrate", "export-onnx": "export_onnx",
          "build-engine": "build_engine", "verify": "verify", "inspect": "inspect"}
CTRL_C_ARGS = {
    "convert": lambda t: ["convert", MODEL, "-o", t / "o"],
    "calibrate": lambda t: ["calibrate", MODEL, "--calib-data", CALIB, "-o", t / "a.json"],
    "export-onnx": lambda t: ["export-onnx", t, "-o", t / "m.onnx"],
    "build-engine": lambda t: ["build-engine", t / "m.onnx"],
    "verify": lambda t: ["verify", MODEL, t],
    "inspect": lambda t: ["inspect", MODEL],
}


@pytest.mark.parametrize("name", API_OF)
def test_ctrl_c_is_130_and_failed(run_cli, tmp_path, monkeypatch, name):
    from fp8export import api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, API_OF[name], interrupted)
    r = run_cli(*CTRL_C_ARGS[name](tmp_path))
    assert r.exit_code == EXIT_INTERRUPTED, r.output
    assert _status(r) == ("FAILED", name)
    assert "Interrupted" in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize("debug", ["", "--debug", "env"])
def test_a_bug_is_exit_4_with_how_to_report_it(run_cli, tmp_path, monkeypatch, debug):
    """An unexpected exception is not bad input (1): exit 4, one line naming it, how to report
    it; the traceback only with --debug or FP8EXPORT_DEBUG=1."""
    from fp8export import api

    def bug(*args, **kwargs):
        raise ZeroDivisionError("division by zero in a helper")

    monkeypatch.setattr(api, "inspect", bug)
    monkeypatch.delenv("FP8EXPORT_DEBUG", raising=False)
    if debug == "env":
        monkeypatch.setenv("FP8EXPORT_DEBUG", "1")
    r = run_cli(*(["--debug"] if debug == "--debug" else []), "inspect", MODEL)
    assert r.exit_code == EXIT_INTERNAL == 4, r.output
    assert _status(r) == ("FAILED", "inspect")
    assert "Internal error (a bug in fp8export" in r.stderr
    assert "ZeroDivisionError: division by zero in a helper" in r.stderr
    assert "report it" in r.stderr
    assert not any(line.startswith("Error:") for line in r.stderr.splitlines())  # not a 1
    assert ("Traceback" in r.stderr) == bool(debug), r.stderr


def default_sigint() -> None:
    """preexec_fn: the child starts with SIGINT's default disposition, as from a terminal. A
    test run from a script's background job (``pytest … &``) inherits SIGINT *ignored*, and
    Python (like every Unix program) keeps it ignored; the CLI rightly respects that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("parent", ["default", "ignored"])
def test_real_sigint_during_convert_leaves_nothing(tmp_path, parent):
    out = tmp_path / "fp8"
    env = {**os.environ, "CI": "1", "PYTHONPATH": str(REPO)}
    # "ignored": what the test process inherits as a background job of a script
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if parent == "ignored" else None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fp8export.cli", "convert", str(MODEL), "-o", str(out),
             "--calib-data", str(CALIB)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, preexec_fn=default_sigint)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    seen = []
    try:
        for line in proc.stderr:  # stage lines come as each stage starts
            seen.append(line)
            if line.startswith("[stage] calibrate"):
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in "".join(seen).splitlines() + rest.splitlines() if line.strip()]
    assert proc.returncode == EXIT_INTERRUPTED, "\n".join(lines)
    assert "\n\n\nInterrupted" not in "".join(seen) + rest  # one line break, not two blank lines
    assert "\nInterrupted: outputs are written atomically" in "".join(seen) + rest
    assert lines[-1].startswith("FAILED | convert | ") and "Traceback" not in rest
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no temporary sibling
