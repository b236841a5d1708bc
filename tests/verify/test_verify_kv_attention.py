"""verify --kv-cache fp8 / --attention fp8 on the trained tiny Llama: the cost table in
report.json / report.md and on the console (each configuration, in order, with intervals that
hold their value), and that each configuration measures what it names: a k_scale or v_scale
too small (the largest keys or values clip) must show in the KV-cache row and not before it,
and FP8 attention must differ from the KV-cache-only row."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fp8_folders import markov_tokens

pytestmark = pytest.mark.slow  # four verify runs of the tiny Llama (~1-2 min on 2 cores)

LINEARS = "FP8 linears only (bf16 KV cache and attention)"
KV = "+ FP8 KV cache (bf16 attention)"
METRICS = ("kl_mean", "top1_agreement", "kl_p99")


def _damage_kv(folder, which: str, factor: float) -> None:
    """Divide every layer's ``k_scale`` (or ``v_scale``) by ``factor`` in the shard and the
    manifest alike: a consistent folder whose keys (values) clip at 448, as a calibration that
    missed the outliers would write it."""
    from safetensors.torch import load_file, save_file

    manifest_path = folder / "fp8export.json"
    manifest = json.loads(manifest_path.read_text())
    names = {}
    for entry in manifest["kv_cache"]["layers"].values():
        entry[which] = entry[which] / factor
        names[entry[f"{which}_tensor"]] = entry[which]
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(str(shard))
        hit = {n for n in names if n in tensors}
        for n in hit:
            tensors[n] = tensors[n] / factor
        if hit:
            save_file(tensors, str(shard), metadata={"format": "pt"})
    manifest_path.write_text(json.dumps(manifest, indent=2))


@pytest.fixture(scope="module")
def runs(tiny_llama, eval_npz, tmp_path_factory):
    """verify of the healthy folder with --attention fp8 and with --kv-cache fp8, and of the
    folders whose k_scale / v_scale clip, with --kv-cache fp8: their reports and consoles."""
    from click.testing import CliRunner

    from fp8export import api
    from fp8export.cli import cli
    from fp8export.convert.config import ConvertConfig

    root = tmp_path_factory.mktemp("kv-attention")
    calib = root / "calib.npz"
    np.savez(calib, input_ids=markov_tokens(256, 32, 48, seed=7).numpy())
    api.convert(ConvertConfig(checkpoint=tiny_llama, output=root / "fp8", calib_data=calib,
                              kv_cache="fp8"))
    for which in ("k_scale", "v_scale"):
        shutil.copytree(root / "fp8", root / which)
        _damage_kv(root / which, which, 64.0)
    out = {}
    for name, folder, option in (("attention", "fp8", ("--attention", "fp8")),
                                 ("kv", "fp8", ("--kv-cache", "fp8")),
                                 ("k_scale", "k_scale", ("--kv-cache", "fp8")),
                                 ("v_scale", "v_scale", ("--kv-cache", "fp8"))):
        reports = root / f"report-{name}"
        res = CliRunner().invoke(cli, [str(a) for a in (
            "verify", tiny_llama, root / folder, "--data", eval_npz, "--no-noise-floor",
            "--device", "cpu", "--report-dir", reports, *option)], catch_exceptions=False)
        assert res.exit_code in (0, 3), res.output
        out[name] = {"report": json.loads((reports / "report.json").read_text()),
                     "console": res.output, "md": (reports / "report.md").read_text()}
    return out


def _rows(report: dict) -> dict[str, dict]:
    return {r["configuration"]: r for r in report["attention_cost"]["rows"]}


def test_cost_table_lists_each_configuration_with_its_interval(runs):
    out = runs["attention"]
    rep = out["report"]
    rows = rep["attention_cost"]["rows"]
    judged = "+ FP8 KV cache + FP8 attention (judged)"
    assert [r["configuration"] for r in rows] == [LINEARS, KV, judged]
    for row in rows:
        for k in METRICS:
            lo, hi = row[f"{k}_interval"]
            assert lo <= row[k] <= hi, (row["configuration"], k, row[k], lo, hi)
    # the verdict judges the last row: its numbers are the report's own metrics
    assert rows[-1]["kl_mean"] == pytest.approx(rep["metrics"]["kl_mean"])
    assert rows[-1]["top1_agreement"] == pytest.approx(rep["metrics"]["top1_agreement"])
    # each step quantizes more: the rows are different measurements, none a copy of another
    kls = [r["kl_mean"] for r in rows]
    assert len(set(kls)) == 3 and min(kls) > 0
    assert "## What the FP8 KV cache and attention cost" in out["md"]
    for row in rows:
        assert row["configuration"] in out["md"] and row["configuration"] in out["console"]

    kv_only = runs["kv"]["report"]
    assert [r["configuration"] for r in kv_only["attention_cost"]["rows"]] == [
        LINEARS, "+ FP8 KV cache (judged)"]
    # the same batches, the same FP8-linears-only model: the same first row
    assert _rows(kv_only)[LINEARS]["kl_mean"] == pytest.approx(_rows(rep)[LINEARS]["kl_mean"])
    assert _rows(kv_only)["+ FP8 KV cache (judged)"]["kl_mean"] == pytest.approx(
        _rows(rep)[KV]["kl_mean"])


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_a_clipping_kv_scale_shows_in_the_kv_row(runs, which):
    good, bad = _rows(runs["kv"]["report"]), _rows(runs[which]["report"])
    judged = "+ FP8 KV cache (judged)"
    # the FP8-linears-only row does not read the KV scales: unchanged
    assert bad[LINEARS]["kl_mean"] == pytest.approx(good[LINEARS]["kl_mean"])
    # keys (values) clipped at 1/64 of their range: far worse than the healthy cache, with
    # intervals that do not overlap
    assert bad[judged]["kl_mean"] > 2 * good[judged]["kl_mean"], (bad[judged], good[judged])
    assert bad[judged]["kl_mean_interval"][0] > good[judged]["kl_mean_interval"][1]
