"""`fp8export calibrate` end to end on a tiny Llama folder; amax.json round trip."""

from __future__ import annotations

import json

import pytest

from fp8export.calibration.amax_file import read_amax_file
from fp8export.errors import Fp8ExportError


def test_calibrate_writes_deterministic_amax_json(run_cli, tiny_llama, calib_txt, tmp_path):
    out1, out2 = tmp_path / "a1.json", tmp_path / "a2.json"
    for out in (out1, out2):
        r = run_cli("calibrate", tiny_llama, "--calib-data", calib_txt, "-o", out,
                    "--calib-method", "percentile", "--batch-size", "5", "--device", "cpu")
        assert r.exit_code == 0, r.output
    assert out1.read_bytes() == out2.read_bytes()  # same data -> same bytes
    doc = json.loads(out1.read_text())
    assert doc["method"] == "percentile" and doc["options"] == {"percentile": 99.99}
    assert doc["samples"] == 24 and doc["tokens"] > 24
    assert list(doc["checkpoint"]["files"]) == ["model.safetensors"]
    mods = doc["modules"]
    assert len(mods) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    q, k, v = (mods[f"model.layers.0.self_attn.{p}_proj"]["amax"] for p in "qkv")
    assert q == k == v  # fused q/k/v share one input amax
    g, u = (mods[f"model.layers.1.mlp.{p}_proj"]["amax"] for p in ("gate", "up"))
    assert g == u
    ranges = read_amax_file(out1)
    assert set(ranges) == set(mods)
    r0 = ranges["model.layers.0.mlp.down_proj"]
    assert str(r0.source) == "calibration" and r0.details["method"] == "percentile"
    assert r0.details["samples"] == 24


def test_calibrate_refuses_to_overwrite_without_force(run_cli, tiny_llama, calib_txt, tmp_path):
    out = tmp_path / "amax.json"
    out.write_text("{}")
    r = run_cli("calibrate", tiny_llama, "--calib-data", calib_txt, "-o", out)
    assert r.exit_code == 1 and "already exists" in r.output and out.read_text() == "{}"
    r = run_cli("calibrate", tiny_llama, "--calib-data", calib_txt, "-o", out, "--force",
                "--calib-method", "max", "--calib-samples", "4")
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["samples"] == 4


@pytest.mark.parametrize("args,match", [
    (["--calib-data", "missing.txt"], "no such data file"),
    (["--calib-data", "empty.txt"], "empty"),
])
def test_calibrate_bad_input_exit_1(run_cli, tiny_llama, calib_txt, tmp_path, args, match):
    (tmp_path / "empty.txt").write_text("")
    args = [str(tmp_path / a) if a.endswith(".txt") and a != "calib.txt" else
            (str(calib_txt) if a == "calib.txt" else a) for a in args]
    r = run_cli("calibrate", tiny_llama, *args, "-o", tmp_path / "o.json")
    assert r.exit_code == 1, r.output
    assert match in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o.json").exists()


def test_calibrate_unknown_method_is_usage_error(run_cli, tiny_llama, calib_txt):
    r = run_cli("calibrate", tiny_llama, "--calib-data", calib_txt, "--calib-method", "kl")
    assert r.exit_code == 2


@pytest.mark.parametrize("args,match", [
    (["--percentile", "99"], "applies to --calib-method percentile"),
    (["--calib-method", "percentile", "--percentile", "150"], "must be in"),
])
def test_calibrate_bad_option_values_are_usage_errors(run_cli, tiny_llama, calib_txt, tmp_path,
                                                       args, match):
    r = run_cli("calibrate", tiny_llama, "--calib-data", calib_txt, *args, "-o",
                tmp_path / "o.json")
    assert r.exit_code == 2, r.output
    assert match in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o.json").exists()


def test_read_amax_file_validates(tmp_path):
    p = tmp_path / "a.json"
    base = {"format": "fp8export-amax", "version": 1, "method": "max", "samples": 3,
            "modules": {"m": {"amax": 1.5}}}
    p.write_text(json.dumps(base))
    assert read_amax_file(p)["m"].amax == 1.5
    for bad in (0.0, -1.0, "x", None):
        p.write_text(json.dumps({**base, "modules": {"m": {"amax": bad}}}))
        with pytest.raises(Fp8ExportError, match="module m has amax"):
            read_amax_file(p)
    p.write_text('{"modules": {"m": {"amax": NaN}}, "format": "fp8export-amax", "version": 1}')
    with pytest.raises(Fp8ExportError, match="finite"):
        read_amax_file(p)
    p.write_text("{}")
    with pytest.raises(Fp8ExportError, match="not an fp8export amax file"):
        read_amax_file(p)
    with pytest.raises(Fp8ExportError, match="no such amax file"):
        read_amax_file(tmp_path / "nope.json")


def test_calibrate_ranges_for_convert(tiny_llama, calib_txt, tmp_path):
    from fp8export.calibration.api import calibrate_ranges
    from fp8export.convert.config import ConvertConfig

    mods = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
            "model.layers.0.mlp.down_proj"]
    cfg = ConvertConfig(checkpoint=tiny_llama, scales="calibrate", calib_data=calib_txt,
                        calib_method="entropy", device="cpu")
    ranges, info = calibrate_ranges(cfg, mods)
    assert sorted(ranges) == sorted(mods) and info["method"] == "entropy"
    assert ranges[mods[0]].amax == ranges[mods[1]].amax  # q/k share
    assert info["samples"] == 24 and info["missing"] == []
    # --calib-amax: read back, restricted to the requested modules
    from fp8export.calibration.amax_file import write_amax_file
    from fp8export.calibration.api import calibrate
    from fp8export.calibration.config import CalibrateConfig

    res = calibrate(CalibrateConfig(checkpoint=tiny_llama, calib_data=calib_txt, device="cpu"))
    write_amax_file(res, tmp_path / "amax.json")
    cfg2 = ConvertConfig(checkpoint=tiny_llama, scales="calibrate",
                         calib_amax=tmp_path / "amax.json")
    ranges2, info2 = calibrate_ranges(cfg2, mods + ["lm_head"])
    assert sorted(ranges2) == sorted(mods) and info2["missing"] == ["lm_head"]
    assert ranges2[mods[2]].amax == res.amax[mods[2]]


def test_command_module_imports_only_click(python_exe):
    import subprocess

    code = ("import sys, fp8export.commands.calibrate as c; "
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
            "assert not heavy, heavy; assert c.command.name == 'calibrate'")
    subprocess.run([python_exe, "-c", code], check=True)
