"""Activation scales: --scales modes, fused sharing, static/mixed outputs in every format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open

from fp8export.checkpoint.training.base import AmaxHistory, TrainingState
from fp8export.config import ScaleSource
from fp8export.convert.activation import resolve_activation_ranges
from fp8export.convert.config import ConvertConfig
from fp8export.convert.pipeline import convert
from fp8export.errors import Fp8ExportError

QKV = [f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")]


def _state(amax: dict[str, list[float]]) -> TrainingState:
    return TrainingState(framework="transformer-engine", version="test", histories=[
        AmaxHistory(module=m, role="input", history=np.asarray(h, dtype=np.float32))
        for m, h in amax.items()])


def _cfg(**kw):
    return ConvertConfig(checkpoint=Path("mem"), **kw)


def test_auto_without_history_or_data_is_weights_only(dict_ckpt):
    ranges, notes = resolve_activation_ranges(_cfg(), dict_ckpt({}), QKV)
    assert ranges == {}
    assert notes == ["weights only: activations are dynamic (no training history or "
                     "calibration data)"]


def test_history_through_the_real_policy_with_fused_sharing(dict_ckpt):
    state = _state({QKV[0]: [1.0, 3.0, 0.0], QKV[1]: [2.0], QKV[2]: [0.5, float("inf")]})
    ranges, notes = resolve_activation_ranges(_cfg(), dict_ckpt({}, state=state), QKV,
                                              groups={"qkv": QKV})
    assert any("training history" in n for n in notes)
    assert {m: r.amax for m, r in ranges.items()} == {m: 3.0 for m in QKV}
    assert all(r.source is ScaleSource.HISTORY for r in ranges.values())
    assert ranges[QKV[1]].details["own_amax"] == 2.0
    alone, _ = resolve_activation_ranges(_cfg(scales="history"), dict_ckpt({}, state=state), QKV)
    assert alone[QKV[1]].amax == 2.0 and alone[QKV[2]].amax == 0.5


def test_history_mode_without_state_is_an_error(dict_ckpt):
    with pytest.raises(Fp8ExportError, match="holds no FP8 training state"):
        resolve_activation_ranges(_cfg(scales="history"), dict_ckpt({}), QKV)


def _amax_file(path: Path, amax: dict[str, float]) -> Path:
    """An amax.json in the schema of fp8export.calibration.amax_file (version 1)."""
    path.write_text(json.dumps({
        "format": "fp8export-amax", "version": 1, "method": "max", "samples": 4, "tokens": 40,
        "modules": {m: {"amax": a} for m, a in amax.items()}}))
    return path


def _linear_modules(folder: Path) -> list[str]:
    man = json.loads((folder / "fp8export.json").read_text())
    return sorted(man["quantized"])


@pytest.fixture(scope="module")
def llama_modules(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("mods") / "o"
    convert(ConvertConfig(checkpoint=tiny_llama, output=out))
    return _linear_modules(out)


def test_static_scales_from_amax_file(tiny_llama, tmp_path, llama_modules):
    amax = {m: 1.0 + i for i, m in enumerate(llama_modules)}
    amax.update({QKV[0]: 1.0, QKV[1]: 5.0, QKV[2]: 2.0})
    f = _amax_file(tmp_path / "amax.json", amax)
    out = tmp_path / "o"
    res = convert(ConvertConfig(checkpoint=tiny_llama, output=out, calib_amax=f))
    assert res.activation_scheme == "static"
    # nothing is calibrated: the notes say where the ranges came from
    assert "--scales auto: no training history; activation ranges from amax.json" in res.notes
    assert not any("calibrating" in n for n in res.notes)
    raw = (out / "fp8export.json").read_text()
    assert str(tmp_path) not in raw and "amax.json" in raw  # basenames only
    man = json.loads(raw)
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        for m in llama_modules:
            s = st.get_tensor(f"{m}.input_scale")
            assert s.dtype == torch.float32 and s.shape == (1,)
            base, leaf = m.rsplit(".", 1)
            group = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj",
                     "v_proj"), "v_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_proj": ("gate_proj", "up_proj"), "up_proj": ("gate_proj", "up_proj")
                     }.get(leaf, (leaf,))
            want = max(amax[f"{base}.{x}"] for x in group)  # fused siblings share the max
            if m in QKV:
                assert want == 5.0
            # rounded to the model's BF16, the dtype transformers holds the scale in
            assert float(s) == float(ml_dtypes.bfloat16(np.float32(want / 448)))
            assert man["quantized"][m]["input_scale_source"] == "calibration"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]


def test_mixed_ranges_give_two_groups_and_refuse_vllm(tiny_llama, tmp_path, llama_modules):
    layer0 = [m for m in llama_modules if ".layers.0." in m]
    f = _amax_file(tmp_path / "amax.json", {m: 2.0 for m in layer0})
    out = tmp_path / "o"
    res = convert(ConvertConfig(checkpoint=tiny_llama, output=out, calib_amax=f))
    assert res.activation_scheme == "mixed"
    assert res.dynamic_layers == [m for m in llama_modules if ".layers.1." in m]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == layer0
    assert qc["config_groups"]["group_1"]["input_activations"]["dynamic"] is True
    ct = pytest.importorskip("compressed_tensors.quantization")
    ct.QuantizationConfig.model_validate(qc)
    with pytest.raises(Fp8ExportError, match="one activation_scheme"):
        convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "v", calib_amax=f,
                              format="vllm"))
    assert not (tmp_path / "v").exists()


def test_dynamic_layers_are_said_to_need_static_scales_for_tensorrt(tiny_llama, tmp_path,
                                                                    llama_modules):
    weights_only = convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "w"))
    said = [n for n in weights_only.notes if "TensorRT needs static input scales" in n]
    assert len(said) == 1 and said[0].startswith("this folder has no static input scales")
    assert "--calib-data" in said[0]
    manifest = json.loads((tmp_path / "w" / "fp8export.json").read_text())
    assert said[0] in manifest["notes"]
    layer0 = [m for m in llama_modules if ".layers.0." in m]
    mixed = convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "m",
                                  calib_amax=_amax_file(tmp_path / "a.json",
                                                        {m: 2.0 for m in layer0})))
    said = [n for n in mixed.notes if "TensorRT needs static input scales" in n]
    assert len(said) == 1 and said[0].startswith(f"{len(mixed.dynamic_layers)} layer(s) have no")
    static = convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "s",
                                   calib_amax=_amax_file(tmp_path / "b.json",
                                                         dict.fromkeys(llama_modules, 2.0))))
    assert not any("TensorRT needs" in n for n in static.notes)


def test_modelopt_static(tiny_llama, tmp_path, llama_modules):
    f = _amax_file(tmp_path / "amax.json", {m: 3.0 for m in llama_modules})
    out = tmp_path / "o"
    convert(ConvertConfig(checkpoint=tiny_llama, output=out, calib_amax=f, format="modelopt"))
    hf = json.loads((out / "hf_quant_config.json").read_text())
    assert hf["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                  "exclude_modules": ["lm_head", "model.embed_tokens"]}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "FP8"
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        assert st.get_tensor(f"{QKV[0]}.weight_scale").shape == ()
        assert st.get_tensor(f"{QKV[0]}.input_scale").shape == ()


def test_accuracy_budget_keeps_the_whole_fused_group(tiny_llama, tmp_path, monkeypatch):
    import types

    seen = {}

    class Search:  # the fallback hook's interface
        def search(self, budget):
            seen["budget"] = budget
            return {"keep": ["model.layers.0.self_attn.v_proj"], "kl_all_fp8": 0.1,
                    "kl_selected": 0.01, "kept_param_fraction": 0.01, "samples": 2,
                    "data": "builtin"}

        def check_written(self, folder, kl_selected=None, budget=None):
            seen["written"] = folder
            return {"kl": 0.01, "top1_agreement": 1.0, "samples": 2, "data": "held-out",
                    "met": True}

        def cost(self):
            return {"total": 1.0}

    def start(cfg, path, layers, **_):
        seen["layers"] = {la.module: la for la in layers}
        return Search()

    def plan_split(cfg, path, config, calibration):
        return types.SimpleNamespace(calibration=calibration, search=2, check=1,
                                     to_dict=lambda: {})

    fake = types.ModuleType("fp8export.analysis.fallback")
    fake.start, fake.FallbackLayer = start, lambda *a: types.SimpleNamespace(module=a[0])
    fake.plan_split = plan_split
    monkeypatch.setitem(sys.modules, "fp8export.analysis.fallback", fake)
    res = convert(ConvertConfig(checkpoint=tiny_llama, output=tmp_path / "o",
                                accuracy_budget=0.01))
    assert seen["budget"] == 0.01 and len(seen["layers"]) == 14
    assert res.quantized == 11  # v_proj took q_proj and k_proj along (vLLM fuses them)
    for m in QKV:
        assert res.excluded[f"{m}.weight"] == "kept in high precision for --accuracy-budget 0.01"
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert set(QKV) <= set(qc["ignore"])
    man = json.loads((tmp_path / "o" / "fp8export.json").read_text())
    assert man["accuracy_budget"]["written"]["kl"] == 0.01
    assert seen["written"].name != "o"  # measured in the temporary folder, before publishing


def test_weight_scales_from_history_on_request(tmp_path, monkeypatch, dict_ckpt):
    import fp8export.convert.pipeline as conv

    torch.manual_seed(0)
    tensors = {f"{m}.weight": (torch.randn(8, 8) * 0.1).to(torch.bfloat16) for m in QKV}
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.randn(8, 8).to(torch.bfloat16)
    state = TrainingState(framework="transformer-engine", version="test", histories=[
        AmaxHistory(module=m, role="weight", history=np.asarray([a, 0.0], dtype=np.float32))
        for m, a in zip(QKV, (0.5, 0.75, 0.25))])
    ckpt = dict_ckpt(tensors, config={"model_type": "llama"}, state=state)
    monkeypatch.setattr(conv, "open_checkpoint", lambda path: ckpt)  # reader stand-in only
    (tmp_path / "src").mkdir()  # convert checks the path exists before opening it
    res = convert(ConvertConfig(checkpoint=tmp_path / "src", output=tmp_path / "o",
                                scales="weights", weight_scales_from_history=True))
    rows = {r["module"]: r for r in res.layers}
    for m in QKV:  # the group's max history amax, 0.75, over 448
        assert rows[m]["weight_scale_source"] == "history"
        assert rows[m]["weight_scale"] == float(np.float32(np.float32(0.75) / 448))
    down = rows["model.layers.0.mlp.down_proj"]
    assert down["weight_scale_source"] == "weights"
    assert any("no weight history" in n for n in res.notes)
