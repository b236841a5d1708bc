"""Keras float8 training state: history order, scale meaning and lag, checked against Keras."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fp8export.checkpoint.source import open_checkpoint
from fp8export.checkpoint.training.keras import (
    FLOAT8_VARIABLES,
    Float8Layer,
    keras_training_state,
    newest_first,
)
from fp8export.errors import Fp8ExportError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
os.environ.setdefault("KERAS_BACKEND", "torch")


@pytest.fixture(scope="module")
def keras_history(tmp_path_factory):
    """A float8 Dense with a 4-step window, trained 6 steps on inputs of amax 1, 2, …, 6."""
    if os.environ["KERAS_BACKEND"] != "torch":
        pytest.skip("runs Keras on the torch backend")
    keras = pytest.importorskip("keras")
    from keras.dtype_policies import QuantizedFloat8DTypePolicy

    keras.utils.set_random_seed(0)
    policy = QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=4)
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Dense(2, dtype=policy, name="d")(inp))
    model.compile(optimizer="sgd", loss="mse")
    steps = 6
    x = np.concatenate([np.full((2, 3), t + 1.0, "float32") for t in range(steps)])
    model.fit(x, np.zeros((2 * steps, 2), "float32"), batch_size=2, shuffle=False, verbose=0)
    path = tmp_path_factory.mktemp("keras-state") / "d.keras"
    model.save(path)
    layer = model.get_layer("d")
    return path, {v: np.array(getattr(layer, v).numpy()) for v in FLOAT8_VARIABLES}


def test_newest_first_matches_keras_training(keras_history):
    path, raw = keras_history
    # Keras's ring after 6 steps of amax 1..6 with L=4: h[0] newest, then h[3], h[2], h[1].
    np.testing.assert_array_equal(raw["inputs_amax_history"], [6, 3, 4, 5])
    np.testing.assert_array_equal(newest_first(raw["inputs_amax_history"]), [6, 5, 4, 3])
    with open_checkpoint(path) as ckpt:
        state = ckpt.training_state()
    assert state.framework == "keras" and state.version.startswith("keras-3.")
    inputs = state.for_role("input")["d"]
    np.testing.assert_array_equal(inputs.history, [6, 5, 4, 3])
    # Keras's scale is already amax/448 (a dequantization factor) and lags one step: it was
    # computed from the window before step 6 (amax 5), not from the newest entry (6).
    assert inputs.stored_scale == pytest.approx(5 / 448, rel=1e-6)
    assert inputs.stored_scale == pytest.approx(float(raw["inputs_scale"]))
    weight = state.for_role("weight")["d"]
    kernel_amax = float(np.abs(ckpt_kernel(path)).max())
    assert weight.history.shape == (4,) and weight.history.max() > 0
    assert weight.history[0] == pytest.approx(kernel_amax, rel=0.05)  # sgd moved it a little
    assert {h.role for h in state.histories} == {"input", "weight"}  # E5M2 grads ignored
    assert "outputs_grad" in state.details["ignored"]


def ckpt_kernel(path):
    with open_checkpoint(path) as ckpt:
        return ckpt.load("d.weight").numpy()


def _layer(hist, scale=0.5, kernel_hist=None):
    hist = np.asarray(hist, np.float32)
    return Float8Layer(module="blk.fc", where="model.keras: layer 'blk.fc'", variables={
        "inputs_scale": np.float32(scale), "inputs_amax_history": hist,
        "kernel_scale": np.float32(1.0),
        "kernel_amax_history": np.zeros_like(hist) if kernel_hist is None else kernel_hist,
        "outputs_grad_scale": np.float32(1.0), "outputs_grad_amax_history": np.zeros_like(hist)})


def test_unused_slot_has_no_stored_scale():
    state = keras_training_state([_layer([0, 0, 0], scale=1.0)], "keras-3.15.1")
    inp = state.for_role("input")["blk.fc"]
    assert inp.stored_scale is None and any("never updated" in n for n in inp.notes)


def test_lag_mismatch_is_noted():
    # window [3, 2, 0, 0] newest-first (ring [3, 0, 0, 2]): the lagged scale should be 2/448
    ok = keras_training_state([_layer([3, 0, 0, 2], scale=2 / 448)], None)
    bad = keras_training_state([_layer([3, 0, 0, 2], scale=3 / 448)], None)
    assert not any("differs" in n for n in ok.for_role("input")["blk.fc"].notes)
    assert any("differs" in n for n in bad.for_role("input")["blk.fc"].notes)


def test_non_finite_entries_are_kept_for_the_policy():
    """Overflowed steps stay in the history; the shared policy skips them or refuses."""
    from fp8export.scales.history import ranges_from_history

    state = keras_training_state([_layer([1.0, np.nan, 0.5])], None)
    assert any("NaN/Inf" in n for n in state.for_role("input")["blk.fc"].notes)
    ranges, _notes = ranges_from_history(state, ["blk.fc"])
    assert ranges["blk.fc"].amax == 1.0
    with pytest.raises(Fp8ExportError, match=r"blk\.fc.*NaN/Inf"):
        ranges_from_history(keras_training_state([_layer([np.inf, np.nan, 0])], None),
                            ["blk.fc"])


def test_negative_history_names_the_layer():
    with pytest.raises(Fp8ExportError, match=r"layer 'blk\.fc'.*negative"):
        keras_training_state([_layer([1.0, -2.0, 0.0])], None)


@pytest.mark.parametrize("hist", [np.zeros((2, 3)), np.zeros(0)])
def test_wrong_history_shape_names_the_layer(hist):
    with pytest.raises(Fp8ExportError, match=r"layer 'blk\.fc'.*shape"):
        keras_training_state([_layer(hist)], None)
