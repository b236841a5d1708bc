"""TE extra state → TrainingState: slot mapping, history order, scale conversion, edge states."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from te_helpers import fixtures_module

from fp8export.checkpoint.training.te import plan_module, plan_modules, te_training_state
from fp8export.errors import Fp8ExportError

mf = fixtures_module()


def _by(state, module, role):
    hits = [h for h in state.histories if h.module == module and h.role == role]
    assert len(hits) == 1, (module, role, hits)
    return hits[0]


# ------------------------------------------------------------------------------ name mapping

def test_plan_linear_and_layernorm_linear():
    assert plan_module("a.proj", ["a.proj.weight", "a.proj.bias"]).kind == "Linear"
    p = plan_module("a.qkv", ["a.qkv.weight", "a.qkv.layer_norm_weight", "a.qkv._extra_state"])
    assert p.kind == "LayerNormLinear" and p.renames == {}
    assert p.gemms[0].modules == ("a.qkv",)


def test_plan_layernorm_mlp_renames_fc_weights():
    names = [f"m.{n}" for n in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias",
                                "layer_norm_weight", "_extra_state")]
    p = plan_module("m", names)
    assert p.kind == "LayerNormMLP"
    assert p.renames == {"m.fc1_weight": "m.fc1.weight", "m.fc1_bias": "m.fc1.bias",
                         "m.fc2_weight": "m.fc2.weight", "m.fc2_bias": "m.fc2.bias"}
    assert [(g.index, g.modules) for g in p.gemms] == [(0, ("m.fc1",)), (1, ("m.fc2",))]


def test_plan_grouped_linear_per_expert():
    names = [f"e.weight{i}" for i in range(3)] + ["e.bias1", "e._extra_state"]
    p = plan_module("e", names)
    assert p.kind == "GroupedLinear"
    assert p.renames["e.weight2"] == "e.2.weight" and p.renames["e.bias1"] == "e.1.bias"
    assert [g.index for g in p.gemms] == [0, 1, 2]


def test_plan_grouped_linear_gap_is_refused():
    with pytest.raises(Fp8ExportError, match="numbered"):
        plan_module("e", ["e.weight0", "e.weight2"])


def test_plan_parameters_split_share_one_gemm():
    p = plan_module("q", ["q.query_weight", "q.key_weight", "q.value_weight", "q.query_bias"])
    assert p.gemms[0].modules == ("q.key", "q.query", "q.value")
    assert p.renames["q.query_weight"] == "q.query.weight"
    assert p.renames["q.query_bias"] == "q.query.bias"


def test_plan_attention_and_root_module():
    assert plan_module("x.core_attention", ["x.core_attention._extra_state"]).kind == \
        "DotProductAttention"
    root = plan_modules(["weight", "_extra_state"])
    assert root[""].kind == "Linear" and root[""].gemms[0].modules == ("",)


def test_rename_collision_is_refused():
    with pytest.raises(Fp8ExportError, match="already names"):
        plan_modules(["m.fc1_weight", "m.fc2_weight", "m.fc1.weight", "m._extra_state"])


# ------------------------------------------------------------------------- order and scales

@pytest.mark.parametrize("layout", ["2.x", "1.x", "0.6"])
def test_histories_are_newest_first_and_scales_converted(layout):
    fx = mf.te_layer_state_dict(layout, length=16, steps=40)
    state = te_training_state(fx.state_dict)
    slots = {"layers.0.self_attention.layernorm_qkv": ("layers.0.self_attention.layernorm_qkv", 0),
             "layers.0.self_attention.proj": ("layers.0.self_attention.proj", 0),
             "layers.0.layernorm_mlp.fc1": ("layers.0.layernorm_mlp", 0),
             "layers.0.layernorm_mlp.fc2": ("layers.0.layernorm_mlp", 1),
             **{f"layers.0.experts.{i}": ("layers.0.experts", i) for i in range(mf.EXPERTS)}}
    for module, (te_prefix, g) in slots.items():
        sim = fx.truth[te_prefix]
        for role, slot in (("input", 3 * g), ("weight", 3 * g + 1)):
            h = _by(state, module, role)
            # the L-1 completed steps the window still holds, newest first
            expected = sim.amaxes[-(fx.history_len - 1):, slot][::-1]
            np.testing.assert_array_equal(h.history, expected)
            assert h.history[0] == sim.amaxes[-1, slot]  # newest = last step's amax
            assert h.stored_scale == pytest.approx(1.0 / float(sim.scale[slot]), rel=1e-7)
    assert state.details["history_len"]["layers.0.layernorm_mlp.fc2"] == 16


def test_version_names_layout():
    assert te_training_state(mf.te_layer_state_dict("2.x").state_dict).version == "te-2.x-pickle"
    assert te_training_state(mf.te_layer_state_dict("1.x").state_dict).version == "te-1.x-bytesio"
    assert te_training_state(mf.te_layer_state_dict("0.6").state_dict).version == \
        "te-0.6-0.11-pickle"


def test_attention_slots_are_reported_not_used_as_inputs():
    state = te_training_state(mf.te_layer_state_dict("2.x").state_dict)
    att = [h for h in state.histories if h.module.endswith("core_attention")]
    assert {h.role for h in att} == {"other"} and len(att) == 3
    assert "layers.0.self_attention.core_attention" not in state.for_role("input")


def test_mid_step_row0_is_the_newest_entry():
    fx = mf.te_layer_state_dict("2.x", partial=True, length=8, steps=20)
    state = te_training_state(fx.state_dict)
    sim = fx.truth["layers.0.self_attention.proj"]
    h = _by(state, "layers.0.self_attention.proj", "input")
    assert h.history[0] == pytest.approx(sim.amaxes[-1, 0] * 1.5)
    assert h.history[1] == sim.amaxes[-1, 0] and h.history.size == 8


def test_history_length_one_keeps_only_the_scale():
    fx = mf.megatron_history1()
    state = te_training_state(fx.state_dict)
    h = _by(state, "decoder.linear_fc1", "input")
    assert h.history.size == 0
    sim = fx.truth["decoder.linear_fc1"]
    assert h.stored_scale == pytest.approx(sim.amaxes[-1, 0] / 448.0, rel=1e-6)  # most_recent
    assert state.details["history_len"]["decoder.linear_fc1"] == 1


def test_calibration_mode_state():
    state = te_training_state(mf.calibration_state().state_dict)
    h = _by(state, "fc", "input")
    assert h.stored_scale is None and h.history[0] == 3.25
    assert any("calibration" in n for n in h.notes)


def test_empty_and_stateless_states_warn_and_give_no_history():
    state = te_training_state(mf.empty_states())
    assert state.histories == []
    text = " ".join(state.warnings)
    for name in ("empty_2_4", "none_2_0", "none_1_x"):
        assert f"{name}._extra_state: empty FP8 state" in text
    assert "Float8CurrentScaling keeps no amax history" in text


# --------------------------------------------------------------------------------- bad state

def _with_state(tensors: dict, num_gemms: int = 1, names=("fc.weight",)):
    sd = {n: torch.zeros(4, 4) for n in names}
    sd["fc._extra_state"] = mf.serialize_2x(tensors, num_gemms, mf.DelayedScaling())
    return sd


def _good(num_gemms=1, length=4):
    return {"scale_fwd": torch.full((3 * num_gemms,), 100.0),
            "amax_history_fwd": torch.ones(length, 3 * num_gemms),
            "scale_bwd": torch.ones(2 * num_gemms), "amax_history_bwd": torch.zeros(length, 2)}


@pytest.mark.parametrize("key,value,match", [
    ("amax_history_fwd", torch.ones(3), "2-D"),
    ("amax_history_fwd", torch.ones(4, 6), r"\[L, 3·num_gemms\]"),
    ("amax_history_fwd", torch.ones(4, 3, dtype=torch.int32), "float32"),
    ("scale_fwd", torch.ones(2, 3), "1-D"),
    ("scale_fwd", torch.tensor([float("nan"), 1.0, 1.0]), "multiplier"),
    ("scale_fwd", torch.tensor([-2.0, 1.0, 1.0]), "multiplier"),
    ("scale_fwd", "oops", "not a tensor"),
])
def test_corrupt_forward_state_is_refused_naming_the_layer(key, value, match):
    tensors = {**_good(), key: value}
    with pytest.raises(Fp8ExportError, match=match) as err:
        te_training_state(_with_state(tensors))
    assert "fc._extra_state" in str(err.value)


def test_gemm_count_must_match_the_module():
    names = ("fc.fc1_weight", "fc.fc2_weight")  # a LayerNormMLP needs 2 GEMMs of state
    with pytest.raises(Fp8ExportError, match="LayerNormMLP should have 2"):
        te_training_state(_with_state(_good(1), 1, names))
