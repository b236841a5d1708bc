"""torchao delayed-scaling buffers (0.4–0.9, float8_experimental) → TrainingState."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from te_helpers import REPO, open_ckpt

from fp8export.checkpoint.training import te_reader
from fp8export.checkpoint.training.torchao import (
    DYNAMIC_NOTE,
    is_torchao_buffer,
    torchao_training_state,
)
from fp8export.errors import Fp8ExportError
from fp8export.scales.history import ranges_from_history

REAL = REPO / "samples" / "te-fixtures" / "torchao09_delayed.pt"


def _layer(prefix: str, hist_in, amax_in, scale_in, *, names=("input", "weight", "grad_output")):
    sd = {f"{prefix}.weight": torch.randn(8, 8), f"{prefix}.bias": torch.zeros(8)}
    for role in names:
        sd[f"{prefix}.fp8_amax_{role}"] = torch.tensor([amax_in])
        sd[f"{prefix}.fp8_amax_history_{role}"] = torch.tensor(hist_in, dtype=torch.float32)
        sd[f"{prefix}.fp8_scale_{role}"] = torch.tensor([scale_in])
    return sd


def test_history_is_newest_first_and_multiplier_converted():
    sd = _layer("l1", [5.0, 3.0, 0.0, 0.0], 5.0, 448.0 / 5.0)
    state = torchao_training_state(sd)
    h = state.for_role("input")["l1"]
    np.testing.assert_array_equal(h.history, [5.0, 3.0, 0.0, 0.0])  # fp8_amax == history[0]
    assert h.stored_scale == pytest.approx(5.0 / 448.0)
    assert state.version == "torchao-0.4-0.9-delayed"
    assert "l1" not in state.for_role("grad_output")  # backward buffers are ignored
    ranges, _ = ranges_from_history(state, ["l1"])
    assert ranges["l1"].amax == 5.0 and ranges["l1"].details["stored_vs_history"] == \
        pytest.approx(1.0)


def test_newer_amax_buffer_is_put_in_front():
    state = torchao_training_state(_layer("l", [2.0, 0.0], 9.0, 448.0 / 9.0))
    h = state.for_role("input")["l"]
    np.testing.assert_array_equal(h.history, [9.0, 2.0, 0.0])
    assert any("newer than the saved history" in n for n in h.notes)
    assert state.details["history_len"]["l"] == 2


def test_initial_values_are_not_information():
    state = torchao_training_state(_layer("l", [0.0, 0.0], 448.0, 1.0))
    h = state.for_role("input")["l"]
    assert h.stored_scale is None and h.history.tolist() == [0.0, 0.0]
    ranges, notes = ranges_from_history(state, ["l"])
    assert ranges == {} and "all-zero" in notes[0]


def test_float8_experimental_names():
    sd = {"fc.weight": torch.randn(4, 4), "fc.fp8_amax_history_x": torch.tensor([1.5, 0.5]),
          "fc.fp8_scale_x": torch.tensor([448 / 1.5]), "fc.fp8_amax_history_w": torch.tensor([0.2]),
          "fc.fp8_amax_history_dL_dY": torch.tensor([1e-3])}
    state = torchao_training_state(sd)
    assert state.version == "float8_experimental"
    assert state.for_role("input")["fc"].history.tolist() == [1.5, 0.5]
    assert "fc" in state.for_role("weight")


def test_no_buffers_means_no_state_and_a_note_exists():
    assert torchao_training_state({"fc.weight": torch.zeros(2, 2)}) is None
    assert "dynamic" in DYNAMIC_NOTE and "float8nocompile" in DYNAMIC_NOTE


@pytest.mark.parametrize("key,value,match", [
    ("l.fp8_scale_input", torch.tensor([1.0, 2.0]), "exactly one"),
    ("l.fp8_amax_history_input", torch.tensor([], dtype=torch.float32), "empty amax history"),
    ("l.fp8_amax_history_input", torch.tensor([1, 2]), "not a float"),
    ("l.fp8_scale_input", torch.tensor([float("inf")]), "multiplier"),
])
def test_corrupt_buffers_name_the_buffer(key, value, match):
    sd = _layer("l", [1.0, 0.0], 1.0, 448.0)
    sd[key] = value
    with pytest.raises(Fp8ExportError, match=match) as err:
        torchao_training_state(sd)
    assert "l.fp8_" in str(err.value)


def test_buffer_names():
    assert is_torchao_buffer("a.b.fp8_amax_history_input")
    assert is_torchao_buffer("fp8_scale_weight") and is_torchao_buffer("x.fp8_amax_dL_dY")
    assert not is_torchao_buffer("a.fp8_amax_history_inputs") and not is_torchao_buffer("a.weight")


def test_reader_hides_buffers(tmp_path):
    path = tmp_path / "ao.pt"
    torch.save(_layer("blk.fc", [3.0, 1.0], 3.0, 448 / 3.0), path)
    assert te_reader.can_open(path)
    with open_ckpt(path) as ck:
        assert [t.name for t in ck.tensors()] == ["blk.fc.weight", "blk.fc.bias"]
        assert ck.training_state().framework == "torchao"


@pytest.mark.skipif(not REAL.is_file(), reason="torchao fixture not generated")
def test_real_torchao_09_checkpoint():
    """Produced by torchao 0.9.0 itself (samples/te-fixtures/make_torchao_fixture.py)."""
    with open_ckpt(REAL) as ck:
        state = ck.training_state()
        assert {t.name for t in ck.tensors()} == {"0.weight", "0.bias", "2.weight", "2.bias"}
        ranges, notes = ranges_from_history(state, ["0", "2"])
        assert sorted(ranges) == ["0", "2"] and notes == []
        raw = torch.load(REAL, weights_only=True)
        for m in ("0", "2"):
            # torchao's stored multiplier was computed from the same window we rebuild
            assert ranges[m].amax == pytest.approx(448.0 / float(raw[f"{m}.fp8_scale_input"]),
                                                   rel=1e-6)
            assert ranges[m].details["stored_vs_history"] == pytest.approx(1.0, rel=1e-6)


DYNAMIC = REPO / "samples" / "te-fixtures" / "torchao09_dynamic_fsdp.pt"


@pytest.mark.skipif(not DYNAMIC.is_file(), reason="torchao fixture not generated")
def test_real_torchao_dynamic_fsdp_wrappers_say_there_is_no_state():
    """torchao 0.9 dynamic scaling with float8 FSDP all-gather: the weights are saved as
    WeightWithDynamicFloat8CastTensor; they are unwrapped without importing torchao."""
    with pytest.raises(Exception):  # the generic safe load refuses the torchao classes
        torch.load(DYNAMIC, weights_only=True)
    assert te_reader.can_open(DYNAMIC)
    with open_ckpt(DYNAMIC) as ck:
        assert ck.kind == "torchao" and ck.training_state() is None
        assert any("dynamic scaling" in n and "no history to reuse" in n for n in ck.notes)
        assert {t.name: t.shape for t in ck.tensors()} == {
            "0.weight": (32, 32), "0.bias": (32,), "1.weight": (16, 32), "1.bias": (16,)}
        w = ck.load("0.weight")
        assert type(w) is torch.Tensor and w.dtype == torch.float32 and torch.isfinite(w).all()
        assert float(w.abs().max()) < 1.0  # a Linear(32, 32) init, not garbage
