"""``--format vllm`` is said to be vLLM-only everywhere, and our own tools never take such a folder
for something it is not: verify/inspect name its dialect, and every place that wants a
high-precision model refuses it (its FP8 codes without their scales would run silently)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "samples" / "tiny-llama" / "model"
CALIB = REPO / "samples" / "tiny-llama" / "data" / "calib.txt"
EVAL = REPO / "samples" / "tiny-llama" / "data" / "eval.txt"


@pytest.fixture(scope="module")
def vllm_dir(tmp_path_factory):
    from click.testing import CliRunner

    from fp8export.cli import cli

    out = tmp_path_factory.mktemp("vllm") / "fp8"
    r = CliRunner().invoke(cli, ["convert", str(MODEL), "-o", str(out), "--format", "vllm"])
    assert r.exit_code == 0, r.output
    assert f"wrote {out}  [vllm: loads in vllm only]" in r.stdout
    assert "is for vLLM only: transformers reads quant_method fp8 as its block-wise" in r.stdout
    return out


def test_the_folder_says_so(vllm_dir):
    config = json.loads((vllm_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    manifest = json.loads((vllm_dir / "fp8export.json").read_text())
    assert manifest["output_format"] == "vllm" and manifest["loaded_by"] == ["vllm"]
    assert manifest["notes"][0].startswith("format vllm (quant_method fp8) is for vLLM only")


def test_default_format_names_both_loaders(tmp_path, run_cli):
    r = run_cli("convert", MODEL, "-o", tmp_path / "ct")
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "ct" / "fp8export.json").read_text())
    assert manifest["loaded_by"] == ["vllm", "transformers (with compressed-tensors)"]
    assert not any("vLLM only" in n for n in manifest["notes"])


@pytest.mark.parametrize("with_manifest", [True, False])
def test_inspect_names_the_dialect(vllm_dir, tmp_path, run_cli, with_manifest):
    folder = tmp_path / "copy"
    shutil.copytree(vllm_dir, folder)
    if not with_manifest:  # e.g. only the files vLLM needs were copied
        (folder / "fp8export.json").unlink()
    r = run_cli("inspect", folder, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kind"] == "fp8-folder"
    assert data["summary"]["output_format"] == "vllm"
    assert data["summary"]["loaded_by"] == ["vllm"]
    assert sum("is for vLLM only" in n for n in data["notes"]) == 1
    text = run_cli("inspect", folder).stdout
    assert "format        vllm (loads in vllm only)" in text


def test_verify_runs_it_as_what_it_is(vllm_dir, tmp_path, run_cli):
    rd = tmp_path / "rep"
    r = run_cli("verify", MODEL, vllm_dir, "--data", EVAL, "--samples", "4", "--report-dir", rd)
    assert r.exit_code == 0, r.output
    report = json.loads((rd / "report.json").read_text())
    assert report["candidate"]["format"] == "vllm"
    assert report["metrics"]["top1_agreement"] > 0.95  # the per-tensor scales were applied
    assert any("is for vLLM only" in n for n in report["notes"])


@pytest.mark.parametrize("with_manifest", [True, False])
def test_never_taken_for_a_high_precision_model(vllm_dir, tmp_path, run_cli, with_manifest):
    folder = tmp_path / "copy"
    shutil.copytree(vllm_dir, folder)
    if not with_manifest:
        (folder / "fp8export.json").unlink()
    runs = {
        "verify as reference": (["verify", folder, vllm_dir], "high-precision"),
        "calibrate": (["calibrate", folder, "--calib-data", CALIB, "-o", tmp_path / "a.json"],
                      "quantized checkpoint"),
        "convert": (["convert", folder, "-o", tmp_path / "again"], "already F8_E4M3"),
    }
    for what, (args, expected) in runs.items():
        r = run_cli(*args)
        assert r.exit_code == 1, (what, r.output)
        assert expected in r.stderr, (what, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]
    if not with_manifest:  # an AutoFP8-style folder another tool could have written: a candidate
        rd = tmp_path / "rep"
        r = run_cli("verify", MODEL, folder, "--data", EVAL, "--samples", "4", "--report-dir", rd)
        assert r.exit_code == 0, r.output
        notes = json.loads((rd / "report.json").read_text())["notes"]
        assert any("written by quant_method fp8 (AutoFP8 / vLLM)" in n for n in notes), notes
