"""verify on untrusted inputs: a wall-clock limit, reports never in the inputs, no half reports."""

from __future__ import annotations

import signal
import time

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
    assert "nothing was written" in errors[0]
    assert not report.exists()


def test_timeout_says_how_far_the_run_got(tiny_llama, tiny_fp8, monkeypatch):
    """Stopped while comparing: the message names the stage and the batches done."""
    from fp8export.runners.torch_fp8_runner import TorchFp8Runner

    real, calls, armed = TorchFp8Runner._infer, [], []

    def slow_third_batch(self, feed):
        calls.append(1)
        if len(calls) == 3:
            # The run's own alarm (armed for the 60 s limit) brought forward to now, rather
            # than waiting out the minute; an alarm that was never armed is left alone, and
            # then the sleep runs its 120 s.
            armed.append(signal.getitimer(signal.ITIMER_REAL)[0])
            if armed[0] > 0:
                signal.setitimer(signal.ITIMER_REAL, 0.01)
            time.sleep(120)  # the limit stops it long before
        return real(self, feed)

    monkeypatch.setattr(TorchFp8Runner, "_infer", slow_third_batch)
    t0 = time.perf_counter()
    with pytest.raises(Fp8ExportError) as err:
        api.verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, device="cpu",
                                samples=16, batch_size=4, timeout=60, write_reports=False,
                                noise_floor=False))
    assert time.perf_counter() - t0 < 100
    assert 0 < armed[0] <= 60  # the alarm was armed, for the limit asked
    assert "stopped by --timeout 60 s" in str(err.value)
    assert "while comparing logits on 16 sample(s): 2 of 4 batch(s) done" in str(err.value)


def test_no_time_limit_by_default(run_cli):
    assert VerifyConfig(reference="a", candidate="b").timeout is None
    help_text = run_cli("verify", "--help").output
    assert "3600" not in help_text and "Default: no limit" in " ".join(help_text.split())


def test_report_dir_inside_an_input_is_refused(tiny_llama, tiny_fp8):
    for inside in (tiny_fp8 / "report", tiny_llama):
        with pytest.raises(Fp8ExportError, match="never writes into its input"):
            api.verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, report_dir=inside,
                                    device="cpu"))
    assert not (tiny_fp8 / "report").exists()


def test_failed_report_write_leaves_no_partial_report(tiny_llama, tiny_fp8, tmp_path,
                                                      monkeypatch):
    import errno

    import fp8export.io.atomic as atomic

    real, calls = atomic.os.fsync, []

    def failing(fd):  # the third report file's bytes do not reach the disk
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", failing)
    report = tmp_path / "report"
    with pytest.raises(Fp8ExportError, match="No space left"):
        api.verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, report_dir=report,
                                device="cpu", samples=2))
    assert len(calls) == 3
    assert not report.exists()
