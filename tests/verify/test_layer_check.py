"""The layer check in the default gate: one layer's weight scale x2 or x8 fails verify (exit 3)
with that layer named, in every folder format; clean folders pass with a wide margin; where it
cannot run (an ONNX candidate, a thresholds file without it) it says so or costs nothing."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fp8_folders import DAMAGED, damage_scale, markov_tokens

from fp8export import api
from fp8export.errors import VerificationFailed
from fp8export.verify.config import VerifyConfig

# name -> ConvertConfig options (static formats calibrated on Markov text)
FORMATS = {
    "compressed-tensors": {"format": "compressed-tensors", "calib": True},
    "vllm": {"format": "vllm", "calib": True},
    "modelopt": {"format": "modelopt", "calib": True},
    "block": {"format": "vllm", "weight_granularity": "block", "block_size": "32x32"},
}
CLEAN_MARGIN_DB = 20.0  # clean layers measure ~30 dB (E4M3 rounding); the bound is 10


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory):
    from fp8export.convert.config import ConvertConfig

    root = tmp_path_factory.mktemp("formats")
    calib = root / "calib.npz"
    np.savez(calib, input_ids=markov_tokens(256, 16, 32, seed=5).numpy())
    out = {}
    for name, opts in FORMATS.items():
        opts = dict(opts)
        data = calib if opts.pop("calib", False) else None
        api.convert(ConvertConfig(checkpoint=tiny_llama, output=root / name, calib_data=data,
                                  **opts))
        out[name] = root / name
    return out


def _verify(reference, candidate, **kw):
    kw = {"samples": 8, "seq_len": 32, "noise_floor": False, "write_reports": False,
          "device": "cpu", **kw}
    return api.verify(VerifyConfig(reference=reference, candidate=candidate, **kw))


def _scaled(folder, tmp_path, factor):
    bad = tmp_path / f"x{factor:g}"
    shutil.copytree(folder, bad)
    try:
        damage_scale(bad, DAMAGED, factor)
    except KeyError:  # a block folder: the grid is weight_scale_inv, every block's scale
        damage_scale(bad, DAMAGED, factor, name="weight_scale_inv")
    return bad


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_clean_folder_passes_with_margin(tiny_llama, folders, fmt):
    res = _verify(tiny_llama, folders[fmt])
    assert res.passed, res.failures
    worst = res.metrics["layer_sqnr_min"]
    assert worst > CLEAN_MARGIN_DB, res.layer_check
    assert res.layer_check["measured"] == res.layer_check["layers"] == 14


@pytest.mark.parametrize("factor", [2.0, 8.0])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_one_scaled_layer_fails_naming_it(tiny_llama, folders, fmt, factor, tmp_path):
    bad = _scaled(folders[fmt], tmp_path, factor)
    with pytest.raises(VerificationFailed) as err:
        _verify(tiny_llama, bad)
    check = next(c for c in err.value.result.checks if c["metric"] == "layer_sqnr_min")
    assert check["status"] == "failed" and check["layers"] == [DAMAGED]
    # 2x: -20 log10(1) = 0 dB; 8x: -20 log10(7) = -16.9 dB, whatever the data
    expected = -20 * np.log10(factor - 1)
    assert check["value"] == pytest.approx(expected, abs=1.5)
    assert DAMAGED in str(err.value) and "layer_sqnr_min" in str(err.value)


def test_cli_exit_3_names_the_layer(run_cli, tiny_llama, folders, tmp_path):
    bad = _scaled(folders["compressed-tensors"], tmp_path, 2.0)
    r = run_cli("verify", tiny_llama, bad, "--samples", 8, "--seq-len", 32, "--no-noise-floor",
                "--device", "cpu", "--report-dir", tmp_path / "rep")
    assert r.exit_code == 3, r.output
    failed = [ln for ln in r.stderr.splitlines() if ln.startswith("Verification failed:")]
    assert len(failed) == 1 and DAMAGED in failed[0] and "0.0 dB" in failed[0]
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["layer_check"]["worst"][0]["module"] == DAMAGED
    assert any(f["metric"] == "layer_sqnr_min" for f in rep["failures"])
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Layer check failed" in md and DAMAGED.replace("_", "\\_") in md


def test_strict_and_loose_fail_it_too(tiny_llama, folders, tmp_path):
    bad = _scaled(folders["compressed-tensors"], tmp_path, 2.0)
    for preset in ("strict", "loose"):
        with pytest.raises(VerificationFailed, match=DAMAGED):
            _verify(tiny_llama, bad, thresholds=preset)


def test_without_the_bound_no_layer_is_measured(tiny_llama, folders, tmp_path):
    thr = tmp_path / "t.json"
    thr.write_text(json.dumps({"preset": "default", "layer_sqnr_min": None}))
    res = _verify(tiny_llama, folders["compressed-tensors"], thresholds=str(thr))
    assert "layer_sqnr_min" not in res.metrics and res.layer_check is None


def test_onnx_candidate_says_why_the_check_is_skipped(tiny_llama, folders, tmp_path):
    from fp8export.onnx.export import ExportOnnxConfig

    onnx = tmp_path / "m.onnx"
    api.export_onnx(ExportOnnxConfig(fp8_dir=folders["compressed-tensors"], output=onnx,
                                     dtype="fp32"))
    res = _verify(tiny_llama, onnx)
    check = next(c for c in res.checks if c["metric"] == "layer_sqnr_min")
    assert check["status"] == "skipped" and "needs an FP8 folder" in check["message"]
    assert res.passed


def test_streamed_run_fails_the_same_layer(tiny_llama, folders, tmp_path):
    """Layer by layer (--offload layers) the check measures what the whole run measures, and
    the one scaled layer fails it there too."""
    clean = _verify(tiny_llama, folders["compressed-tensors"])
    streamed = _verify(tiny_llama, folders["compressed-tensors"], offload="layers",
                       max_memory="cpu=2MiB")
    assert streamed.metrics["layer_sqnr_min"] == clean.metrics["layer_sqnr_min"]
    bad = _scaled(folders["compressed-tensors"], tmp_path, 2.0)
    with pytest.raises(VerificationFailed) as err:
        _verify(tiny_llama, bad, offload="layers", max_memory="cpu=2MiB")
    check = next(c for c in err.value.result.checks if c["metric"] == "layer_sqnr_min")
    assert check["status"] == "failed" and check["layers"] == [DAMAGED]
    assert any(n.startswith("Layer streaming") for n in err.value.result.notes)
