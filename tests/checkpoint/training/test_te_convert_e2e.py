"""End to end: reproduced TE checkpoints through ``fp8export.api.convert --scales history``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from te_helpers import fixtures_module, open_ckpt

from fp8export import api
from fp8export.convert.config import ConvertConfig
from fp8export.errors import Fp8ExportError

mf = fixtures_module()

# TE's fused LayerNorm+Linear modules are named layernorm_qkv / layernorm_mlp; the default
# exclusion rule for norms matches those names anywhere in the path, so include them explicitly.
INCLUDE = ("*layernorm_qkv*", "*layernorm_mlp.fc*")


def _convert(src, out, **kw):
    open_ckpt(src).close()  # registers the readers (the TE reader included)
    return api.convert(ConvertConfig(checkpoint=src, output=out, scales="history",
                                     include=INCLUDE, **kw))


@pytest.mark.parametrize("layout", ["2.x", "1.x", "0.6"])
def test_input_scale_per_layer_is_max_history_over_448(tmp_path, layout):
    fx = mf.te_layer_state_dict(layout, length=16, steps=40)
    src = tmp_path / "te.pt"
    torch.save(fx.state_dict, src)
    with open_ckpt(src) as ck:
        histories = {m: h.history for m, h in ck.training_state().for_role("input").items()}
    _convert(src, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    manifest = json.loads((tmp_path / "out" / "fp8export.json").read_text())
    assert len(histories) == 8
    for module, hist in histories.items():
        expected = np.float32(float(hist[hist > 0].max()) / 448.0)
        got = tensors[f"{module}.input_scale"]
        assert got.dtype == torch.float32 and got.numel() == 1
        assert got.item() == pytest.approx(float(expected), rel=1e-7), module
        assert tensors[f"{module}.weight"].dtype == torch.float8_e4m3fn
        entry = manifest["quantized"][module]
        assert entry["input_scale_source"] == "history"
        assert entry["input_details"]["framework"] == "transformer-engine"
    assert not any(k.endswith("_extra_state") for k in tensors)
    assert "layers.0.layernorm_mlp.fc1_weight" not in tensors


def test_history_length_one_converts_from_stored_scale(tmp_path):
    fx = mf.megatron_history1()
    src = tmp_path / "mg.pt"
    torch.save(fx.state_dict, src)
    _convert(src, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    sim = fx.truth["decoder.linear_fc1"]
    assert tensors["decoder.linear_fc1.input_scale"].item() == pytest.approx(
        1.0 / float(sim.scale[0]), rel=1e-6)


def test_malicious_checkpoint_converts_nothing(tmp_path):
    marker = tmp_path / "PWNED"
    paths = mf.write_fixtures(tmp_path / "fx", marker)
    for name in ("te2_malicious", "te1_malicious", "te_malicious_outer"):
        out = tmp_path / f"out-{name}"
        with pytest.raises(Fp8ExportError):
            _convert(paths[name], out)
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fx"]  # no temporary sibling left
    assert not marker.exists()


def test_cli_convert_history_and_refusal(tmp_path, run_cli):
    """Through the real CLI: exit 0 with input scales; exit 1, one message, nothing run."""
    marker = tmp_path / "PWNED"
    paths = mf.write_fixtures(tmp_path / "fx", marker)
    open_ckpt(paths["te2_layer"]).close()  # registers the TE reader (until source.py lists it)
    out = tmp_path / "ok"
    result = run_cli("convert", paths["te2_layer"], "-o", out, "--scales", "history",
                     "--amax-algo", "most-recent", "--margin", "1",
                     *[a for g in INCLUDE for a in ("--include", g)])
    assert result.exit_code == 0, result.output
    tensors = load_file(out / "model.safetensors")
    with open_ckpt(paths["te2_layer"]) as ck:
        h = ck.training_state().for_role("input")["layers.0.self_attention.proj"].history
    newest = float(h[h > 0][0])
    assert tensors["layers.0.self_attention.proj.input_scale"].item() == pytest.approx(
        newest * 2 / 448.0, rel=1e-7)
    bad = run_cli("convert", paths["te2_malicious"], "-o", tmp_path / "bad", "--scales", "history")
    assert bad.exit_code == 1
    assert "fc._extra_state" in bad.output and "Traceback" not in bad.output
    assert not (tmp_path / "bad").exists() and not marker.exists()
