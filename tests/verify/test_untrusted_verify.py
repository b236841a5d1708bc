"""verify on untrusted inputs: a wall-clock limit, reports never in the inputs, no half reports."""

from __future__ import annotations

import pytest

from fp8export import api
from fp8export.errors import Fp8ExportError
from fp8export.verify.config import VerifyConfig


def test_timeout_stops_the_run_with_one_error(run_cli, tiny_llama, tiny_fp8, tmp_path):
    report = tmp_path / "report"
    r = run_cli("verify", tiny_llama, tiny_fp8, "--report-dir", report, "--device", "cpu",
                "--timeout", "0.001")
    assert r.exit_code == 1, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "--timeout 0.001" in errors[0]
    assert not report.exists()


def test_report_dir_inside_an_input_is_refused(tiny_llama, tiny_fp8):
    for inside in (tiny_fp8 / "report", tiny_llama):
        with pytest.raises(Fp8ExportError, match="never writes into its input"):
            api.verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, report_dir=inside,
                                    device="cpu"))
    assert not (tiny_fp8 / "report").exists()


def test_failed_report_write_leaves_no_partial_report(tiny_llama, tiny_fp8, tmp_path,
                                                      monkeypatch):
    import fp8export.io.atomic as atomic

    real, calls = atomic.write_file_atomic, []

    def failing(path, data):
        calls.append(path.name)
        if len(calls) == 3:
            raise Fp8ExportError(f"{path}: writing it failed (No space left on device)")
        real(path, data)

    monkeypatch.setattr(atomic, "write_file_atomic", failing)
    report = tmp_path / "report"
    with pytest.raises(Fp8ExportError, match="No space left"):
        api.verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, report_dir=report,
                                device="cpu", samples=2))
    assert calls[:2] == ["report.json", "report.md"]
    assert not report.exists()
