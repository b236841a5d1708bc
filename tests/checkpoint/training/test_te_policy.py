"""The history policy: max / most-recent / margin / stored-scale fallback / corrupt histories."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from te_helpers import fixtures_module

from fp8export.checkpoint.training.base import AmaxHistory, TrainingState
from fp8export.checkpoint.training.te import te_training_state
from fp8export.config import AmaxAlgo, ScaleSource
from fp8export.errors import Fp8ExportError
from fp8export.scales.history import (
    amax_from_history,
    ranges_from_history,
    weight_scales_from_history,
)

mf = fixtures_module()


def _state(*histories: AmaxHistory) -> TrainingState:
    return TrainingState(framework="test", version="t", histories=list(histories))


def _h(values, module="m", role="input", stored=None):
    return AmaxHistory(module=module, role=role, history=np.asarray(values, np.float32),
                       stored_scale=stored)


@pytest.mark.parametrize("layout", ["2.x", "1.x", "0.6"])
def test_default_policy_is_max_of_history_over_448(layout):
    fx = mf.te_layer_state_dict(layout, length=16, steps=40)
    state = te_training_state(fx.state_dict)
    modules = sorted(state.for_role("input"))
    ranges, notes = ranges_from_history(state, modules)
    assert sorted(ranges) == modules and notes == []
    for module in modules:
        raw = state.for_role("input")[module].history
        assert ranges[module].amax == float(raw[raw > 0].max())
        assert ranges[module].source is ScaleSource.HISTORY
        scale = np.float32(ranges[module].amax / 448.0)
        assert scale == np.float32(raw.max() / 448.0)
    d = ranges["layers.0.layernorm_mlp.fc1"].details
    assert d["framework"] == "transformer-engine" and d["history_length"] == 16
    assert d["filled"] == 15 and d["staleness"] == 0 and d["derived_from"] == "history"
    # TE's own "max" scale covers the same window (+ the dropped oldest row): ratio >= 1
    assert d["stored_vs_history"] >= 1 - 1e-6


def test_most_recent_and_margin():
    state = _state(_h([0, 0, 3.0, 7.0, 0, 5.0]))
    ranges, _ = ranges_from_history(state, ["m"], amax_algo="most-recent")
    r = ranges["m"]
    assert r.amax == 3.0 and r.details["staleness"] == 2 and r.details["filled"] == 3
    ranges, _ = ranges_from_history(state, ["m"], margin=2)
    assert ranges["m"].amax == 28.0 and ranges["m"].details["margin"] == 2
    ranges, _ = ranges_from_history(state, ["m"], amax_algo=AmaxAlgo.MOST_RECENT, margin=1)
    assert ranges["m"].amax == 6.0


def test_stored_uses_the_frameworks_own_scale_else_max():
    # Keras-style: the stored scale lags one step, so it misses the newest amax (9.0)
    state = _state(_h([9.0, 0, 5.0, 7.0], stored=7.0 / 448), _h([0, 4.0], module="n"))
    ranges, notes = ranges_from_history(state, ["m", "n"], amax_algo="stored", margin=1)
    assert ranges["m"].amax == pytest.approx(14.0) and notes == []
    d = ranges["m"].details
    assert d["derived_from"] == "stored-scale" and d["amax_algo"] == "stored"
    assert d["stored_vs_history"] == pytest.approx(7.0 / 9.0)
    assert ranges["n"].amax == 8.0 and ranges["n"].details["derived_from"] == "history"
    weights = weight_scales_from_history(
        _state(_h([3.0, 2.0], role="weight", stored=2.0 / 448)), ["m"], amax_algo="stored")
    assert weights["m"] == pytest.approx(2.0 / 448)


def test_non_finite_entries_are_skipped_and_counted():
    ranges, _ = ranges_from_history(_state(_h([np.inf, 2.0, np.nan, 4.0])), ["m"])
    assert ranges["m"].amax == 4.0 and ranges["m"].details["nonfinite_entries"] == 2
    ranges, _ = ranges_from_history(_state(_h([np.nan, 2.0])), ["m"], amax_algo="most-recent")
    assert ranges["m"].amax == 2.0 and ranges["m"].details["staleness"] == 1


@pytest.mark.parametrize("values,match", [
    ([np.nan, 0.0, np.inf], "only NaN/Inf"),
    ([1.0, -3.0], "negative"),
    ([[1.0, 2.0]], "1-D"),
])
def test_corrupt_histories_name_the_layer(values, match):
    with pytest.raises(Fp8ExportError, match=match) as err:
        ranges_from_history(_state(_h(values, module="blk.7.fc")), ["blk.7.fc"])
    assert "blk.7.fc" in str(err.value)


def test_integer_history_is_refused():
    h = AmaxHistory(module="x", role="input", history=np.array([1, 2], np.int64))
    with pytest.raises(Fp8ExportError, match="x .input.*float"):
        ranges_from_history(_state(h), ["x"])


def test_stored_scale_used_when_window_is_empty():
    state = _state(_h([], stored=0.01), _h([0.0, 0.0], module="z", stored=0.5))
    ranges, notes = ranges_from_history(state, ["m", "z"])
    assert ranges["m"].amax == pytest.approx(4.48) and ranges["m"].details["derived_from"] == \
        "stored-scale"
    assert ranges["z"].amax == pytest.approx(224.0)
    assert any("stored scale was used" in n and "m, z" in n for n in notes)


def test_megatron_history1_fixture_uses_stored_scale():
    fx = mf.megatron_history1()
    ranges, _ = ranges_from_history(te_training_state(fx.state_dict), ["decoder.linear_fc1"])
    sim = fx.truth["decoder.linear_fc1"]
    assert ranges["decoder.linear_fc1"].amax == pytest.approx(448.0 / sim.scale[0], rel=1e-6)
    assert ranges["decoder.linear_fc1"].details["history_length"] == 1


def test_modules_without_usable_history_are_named():
    state = _state(_h([0.0, 0.0], module="never"), _h([1.0], module="ok"))
    ranges, notes = ranges_from_history(state, ["ok", "never", "absent"])
    assert list(ranges) == ["ok"]
    assert any("absent" in n and "no FP8 input history" in n for n in notes)
    assert any("never" in n and "all-zero" in n for n in notes)


def test_weight_scales_from_history():
    state = _state(_h([2.0, 4.48], role="weight"), _h([1.0], module="n"))
    scales = weight_scales_from_history(state, ["m", "n"])
    assert scales == {"m": pytest.approx(0.01)}


def test_bad_margin_is_refused():
    with pytest.raises(Fp8ExportError, match="--margin"):
        amax_from_history(_h([1.0]), margin=-1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(2.0 ** -10, 2.0 ** 20, width=32)), min_size=1,
                max_size=64),
       st.integers(0, 4))
def test_max_policy_property(values, margin):
    positive = [v for v in values if v > 0]
    got = amax_from_history(_h(values), margin=margin)
    if not positive:
        assert got is None
        return
    amax, details = got
    assert amax == float(np.float32(max(positive))) * 2.0 ** margin
    assert details["filled"] == len(positive)
    newest = next(i for i, v in enumerate(values) if v > 0)
    assert details["staleness"] == newest
    recent, _ = amax_from_history(_h(values), amax_algo="most-recent")
    assert recent == float(np.float32(values[newest]))
