"""``inspect --plot``: the file type follows the extension (.svg or .png, both drawn by
matplotlib), panels only where there is data, fused groups drawn once and named, SQNR on an
axis from 0 with the E4M3 band; existing files are kept unless --force."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch
from safetensors.torch import save_file

from fp8export.checkpoint import source as _source
from fp8export.errors import Fp8ExportError
from fp8export.inspect import InspectResult, TensorRow, inspect
from fp8export.inspect.plot import figure

_source._load_builtin_readers()  # see tests/test_inspect.py: registry order stopgap

SVG = "{http://www.w3.org/2000/svg}"
PROJ = {"self_attn.q_proj": (16, 16), "self_attn.k_proj": (8, 16), "self_attn.v_proj": (8, 16),
        "self_attn.o_proj": (16, 16), "mlp.gate_proj": (24, 16), "mlp.up_proj": (24, 16),
        "mlp.down_proj": (16, 24)}


@pytest.fixture()
def llama(tmp_path):
    torch.manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(32, 16).bfloat16(),
         "model.norm.weight": torch.ones(16).bfloat16()}
    for layer in range(3):
        for name, shape in PROJ.items():
            t[f"model.layers.{layer}.{name}.weight"] = (torch.randn(*shape) * 0.1).bfloat16()
    d = tmp_path / "llama"
    d.mkdir()
    save_file(t, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"model_type": "llama",
                                               "architectures": ["LlamaForCausalLM"]}))
    return d


def _panels(svg: str) -> dict[str, list[str]]:
    """Panel title → the legend labels of that panel."""
    groups = list(ET.fromstring(svg).iter(f"{SVG}g"))

    def texts(suffix: str) -> list[str]:
        return [t.text for g in groups if g.get("id", "").endswith(suffix)
                for t in g.iter(f"{SVG}text")]

    return {texts(f"-panel-{k}-title")[0]: texts(f"-panel-{k}-legend")
            for k in range(len([g for g in groups if g.get("id", "").endswith("-plot-area")]))}


def test_svg_of_a_bf16_checkpoint(llama, tmp_path):
    out = tmp_path / "scales.svg"
    result = inspect(llama, plot=out)
    assert result.plot == str(out)
    panels = _panels(out.read_text())
    # a bf16 checkpoint has no input scales: no empty input-scale panel
    assert list(panels) == ["Weight scale (amax / 448) per layer",
                            "Weight round-trip SQNR (E4M3 → dequantized vs the original)"]
    scale_labels = panels["Weight scale (amax / 448) per layer"]
    # q/k/v and gate/up share one scale: drawn once each, named with the members
    assert "self_attn.qkv (fused: q_proj, k_proj, v_proj share one scale)" in scale_labels
    assert "mlp.gate_up (fused: gate_proj, up_proj share one scale)" in scale_labels
    assert not any(label.startswith("self_attn.q_proj") for label in scale_labels)
    # SQNR differs per member: one series each, plus the E4M3 band
    sqnr_labels = panels["Weight round-trip SQNR (E4M3 → dequantized vs the original)"]
    assert {"self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"} <= set(sqnr_labels)
    assert any(label.startswith("E4M3 rounding") for label in sqnr_labels)
    assert "no input-scale panel" in " ".join(out.read_text().split())


def test_png(llama, tmp_path):
    out = tmp_path / "scales.png"
    inspect(llama, plot=out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_existing_file_kept_without_force_and_bad_extension_refused(llama, tmp_path):
    out = tmp_path / "scales.svg"
    out.write_text("mine")
    with pytest.raises(Fp8ExportError, match="already exists.*--force"):
        inspect(llama, plot=out)
    assert out.read_text() == "mine"
    inspect(llama, plot=out, force=True)
    assert out.read_text().startswith("<svg")
    for name in ("scales.pdf", "scales"):
        with pytest.raises(Fp8ExportError, match=r"writes \.svg or \.png"):
            inspect(llama, plot=tmp_path / name)
    with pytest.raises(Fp8ExportError, match="cannot write the plot"):
        inspect(llama, plot=tmp_path / "no" / "such" / "dir" / "p.svg")


def _row(module: str, scale: float, input_scale: float | None, sqnr: float,
         group: str | None) -> TensorRow:
    return TensorRow(name=f"{module}.weight", dtype="F8_E4M3", shape=[4, 4], nbytes=16,
                     role="quantized", scale=scale, input_scale=input_scale, sqnr_db=sqnr,
                     fused_group=group)


def test_fp8_folder_figure_shows_input_scales_and_an_honest_sqnr_axis():
    rows = []
    for layer in range(2):
        g = f"model.layers.{layer}.self_attn.qkv"
        for leaf, sqnr in (("q_proj", 31.5), ("k_proj", 31.6), ("v_proj", 31.4)):
            rows.append(_row(f"model.layers.{layer}.self_attn.{leaf}", 1e-3, 2e-2, sqnr, g))
        # a group whose members disagree (edited folder): drawn per member, never merged
        g = f"model.layers.{layer}.mlp.gate_up"
        rows.append(_row(f"model.layers.{layer}.mlp.gate_proj", 1e-3, 1e-2, 31.5, g))
        rows.append(_row(f"model.layers.{layer}.mlp.up_proj", 2e-3, 1e-2, 31.5, g))
    fig = figure(InspectResult(path="x-fp8", kind="fp8-folder", tensors=rows)).drawable()
    titles = [p.title for p in fig.panels]
    assert titles[1] == "Input (activation) scale per layer" and len(titles) == 3
    weight = [s.label for s in fig.panels[0].series]
    assert weight == ["self_attn.qkv (fused: q_proj, k_proj, v_proj share one scale)",
                      "mlp.gate_proj", "mlp.up_proj"]
    inputs = [s.label for s in fig.panels[1].series]
    assert "mlp.gate_up (fused: gate_proj, up_proj share one scale)" in inputs
    sqnr = fig.panels[2]
    assert sqnr.y.include == (0.0,) and sqnr.bands and sqnr.bands[0].hi == pytest.approx(32.53,
                                                                                         abs=0.01)
    # markers of one layer sit side by side, not on top of each other
    xs = sorted(s.x[0] for s in sqnr.series)
    assert len(set(xs)) == len(xs) == 5 and xs[-1] - xs[0] < 1.0


def test_cli_plot_and_force(llama, tmp_path, run_cli):
    out = tmp_path / "p.svg"
    r = run_cli("inspect", llama, "--plot", out)
    assert r.exit_code == 0, r.output
    assert f"Plot written to {out}" in r.output
    r = run_cli("inspect", llama, "--plot", out)
    assert r.exit_code == 1 and "already exists" in r.output and "Traceback" not in r.output
    assert run_cli("inspect", llama, "--plot", out, "--force").exit_code == 0


def test_svg_reads_cleanly_in_a_browser(llama, tmp_path):
    from browser import chromium, layout_problems, measure

    if chromium() is None:
        pytest.skip("needs Chromium (apt install chromium)")
    out = tmp_path / "scales.svg"
    inspect(llama, plot=out)
    layout = measure(out, width=900)
    assert layout_problems(layout) == []
    assert [p["title"] for p in layout["figures"][0]["panels"]] == [
        "Weight scale (amax / 448) per layer",
        "Weight round-trip SQNR (E4M3 → dequantized vs the original)"]
