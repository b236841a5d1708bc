"""Verify end to end on the sample LM (samples/tiny-llama): the real convert passes
``default``; one weight scale x8 fails with exit 3, named metrics, damaged layer ranked first."""

import json
import shutil

import pytest
from fp8_folders import damage_scale

SAMPLE_DAMAGED = "model.layers.3.mlp.up_proj"


@pytest.fixture(scope="module")
def sample(repo_root, tmp_path_factory):
    model = repo_root / "samples" / "tiny-llama" / "model"
    if not (model / "config.json").is_file():
        pytest.skip("samples/tiny-llama/model is not built")
    from fp8export import api
    from fp8export.config import ConvertConfig

    root = tmp_path_factory.mktemp("sample")
    data = repo_root / "samples" / "tiny-llama" / "data"
    api.convert(ConvertConfig(checkpoint=model, output=root / "fp8",
                              calib_data=data / "calib.txt", calib_samples=64))
    shutil.copytree(root / "fp8", root / "damaged")
    damage_scale(root / "damaged", SAMPLE_DAMAGED, 8.0)
    return model, root, data / "eval.txt"


@pytest.mark.slow
def test_sample_fp8_passes_and_damaged_fails(run_cli, sample, tmp_path):
    model, root, eval_txt = sample
    common = ("--data", eval_txt, "--samples", 48, "--seq-len", 256, "--batch-size", 8)
    ok = run_cli("verify", model, root / "fp8", *common, "--report-dir", tmp_path / "ok")
    assert ok.exit_code == 0, ok.output
    rep = json.loads((tmp_path / "ok" / "report.json").read_text())
    assert rep["metrics"]["kl_mean"] < 1e-3 and rep["metrics"]["ppl_ratio"] < 1.005
    bad = run_cli("verify", model, root / "damaged", *common, "--per-layer",
                  "--report-dir", tmp_path / "bad")
    assert bad.exit_code == 3, bad.output
    rep = json.loads((tmp_path / "bad" / "report.json").read_text())
    failing = {f["metric"] for f in rep["failures"]}
    assert {"kl_mean", "cosine_min", "top5_overlap", "kl_p99"} <= failing
    assert rep["per_layer"][0]["module"] == SAMPLE_DAMAGED
    assert SAMPLE_DAMAGED in (tmp_path / "bad" / "report.md").read_text()
