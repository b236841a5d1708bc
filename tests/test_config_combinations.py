"""Options that cannot work together are usage errors (exit 2) before any file is read: the
checkpoint given here does not even exist, so any work before the check would end in exit 1.
(``fp8export/convert/config.py``, ``fp8export/verify/config.py``.)"""

from __future__ import annotations

import pytest

from fp8export.config import CalibMethod, Device
from fp8export.convert.config import ConvertConfig
from fp8export.errors import EXIT_USAGE, UsageError

INCOMPATIBLE = {
    "vllm per channel": (["--format", "vllm", "--weight-granularity", "channel"],
                         "--format vllm cannot hold per-channel weight scales"),
    "modelopt per channel": (["--format", "modelopt", "--weight-granularity", "channel"],
                             "--format modelopt cannot hold per-channel weight scales"),
    "history weight scales per channel": (
        ["--weight-scales-from-history", "--weight-granularity", "channel"],
        "--weight-scales-from-history gives one scale per tensor"),
    "modelopt without activation scales": (["--format", "modelopt", "--scales", "weights"],
                                           "--format modelopt needs a static input scale"),
    "weights with calibration data": (["--scales", "weights", "--calib-data", "calib.txt"],
                                      "--calib-data would be ignored"),
    "weights with an amax file": (["--scales", "weights", "--calib-amax", "amax.json"],
                                  "--calib-amax would be ignored"),
    "calibration data beside an amax file": (
        ["--calib-amax", "amax.json", "--calib-data", "calib.txt"],
        "--calib-amax gives the activation ranges, so --calib-data would be ignored"),
    "percentile of another method": (["--calib-data", "c.txt", "--percentile", "99.9"],
                                     "--percentile applies to --calib-method percentile"),
    "accuracy samples without a budget": (["--accuracy-samples", "4"],
                                          "--accuracy-samples sets how many samples"),
}


@pytest.mark.parametrize("case", INCOMPATIBLE)
def test_incompatible_convert_options_are_usage_errors_before_any_work(case, tmp_path, run_cli):
    args, message = INCOMPATIBLE[case]
    r = run_cli("convert", tmp_path / "no-such-checkpoint", "-o", tmp_path / "out", *args)
    assert r.exit_code == EXIT_USAGE, r.output
    assert message in r.stderr
    assert "Try 'fp8export convert --help'" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_library_users_get_the_same_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot hold per-channel"):
        ConvertConfig(checkpoint=tmp_path, format="vllm", weight_granularity="channel")


@pytest.mark.parametrize("options", [
    {"scales": "weights", "calib_data": "c.txt", "kv_cache": "fp8"},  # KV scales need the data
    {"scales": "weights", "calib_data": "c.txt", "accuracy_budget": 0.01},  # measured on it
    {"calib_data": "c.txt", "calib_method": "percentile", "percentile": 99.9},
    {"format": "modelopt", "calib_data": "c.txt"},
    {"calib_amax": "a.json", "calib_data": "c.txt", "weight_rounding": "gptq"},  # GPTQ reads it
    {"calib_amax": "a.json", "calib_data": "c.txt", "kv_cache": "fp8"},
])
def test_combinations_that_work_are_accepted(tmp_path, options):
    ConvertConfig(checkpoint=tmp_path, **options)


def test_scaled_mm_on_the_cpu_is_a_usage_error_before_any_work(tmp_path, run_cli):
    r = run_cli("verify", tmp_path / "no-ref", tmp_path / "no-cand", "--fp8-mode", "scaled_mm",
                "--device", "cpu", "--report-dir", tmp_path / "r")
    assert r.exit_code == EXIT_USAGE, r.output
    assert "--fp8-mode scaled_mm runs torch._scaled_mm on a CUDA GPU" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_convert_config_gives_calibration_what_it_reads():
    """calibration sits below convert: it reads convert's options through a Protocol."""
    from fp8export.calibration.config import ConvertCalibration

    cfg = ConvertConfig(checkpoint="m", scales="calibrate", calib_data="d.txt")
    assert isinstance(cfg, ConvertCalibration)
    assert isinstance(cfg.calib_method, CalibMethod) and isinstance(cfg.device, Device)
