"""The restricted unpickler of TE ``_extra_state``: every layout decodes, nothing else runs."""

from __future__ import annotations

import collections
import io
import pickle

import numpy as np
import pytest
import torch
from te_helpers import fixtures_module

from fp8export.checkpoint.training.te_unpickle import (
    FormatStandIn,
    RecipeStandIn,
    UnresolvedGlobal,
    decode_extra_state,
    unpickle_extra_state,
)
from fp8export.errors import Fp8ExportError

mf = fixtures_module()
LAYER = "blk.fc._extra_state"


def _tensors(seed=0, num_gemms=1, length=8):
    tensors, sim = mf._fwd_bwd(num_gemms, length, 12, np.random.default_rng(seed))
    return tensors, sim


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_te2_uint8_pickle_decodes_with_recipe_stand_in():
    tensors, _ = _tensors()
    recipe = mf.DelayedScaling(amax_history_len=8, margin=1, amax_compute_algo="most_recent")
    state, layout = decode_extra_state(mf.serialize_2x(tensors, 1, recipe), LAYER)
    assert layout == "te-uint8-pickle"
    assert isinstance(state["recipe"], RecipeStandIn)
    assert state["recipe"].recipe_name == "DelayedScaling"
    assert state["recipe"].get("amax_history_len") == 8
    assert state["recipe"].get("margin") == 1
    assert state["recipe"].get("amax_compute_algo") == "most_recent"
    fmt = state["recipe"].get("fp8_format")
    assert isinstance(fmt, FormatStandIn) and fmt.name == "HYBRID"
    assert (fmt.max_fwd, fmt.max_bwd) == (448.0, 57344.0)
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert _same(state[key], tensors[key]), key
    assert state["extra_fp8_variables"]["num_gemms"] == 1


def test_te1_bytesio_decodes():
    tensors, _ = _tensors(1)
    state, layout = decode_extra_state(mf.serialize_1x(tensors), LAYER)
    assert layout == "te-1.x-bytesio"
    assert _same(state["amax_history_fwd"], tensors["amax_history_fwd"])
    assert torch.allclose(state["scale_inv_fwd"], 1.0 / tensors["scale_fwd"])
    assert "recipe" not in state


def test_te06_uint8_pickle_without_recipe():
    tensors, _ = _tensors(2)
    state, layout = decode_extra_state(mf.serialize_06(tensors, 1), LAYER)
    assert layout == "te-uint8-pickle" and "recipe" not in state
    assert _same(state["scale_fwd"], tensors["scale_fwd"])


def test_te05_raw_dict_is_taken_as_is():
    tensors, _ = _tensors(3)
    state, layout = decode_extra_state(dict(tensors), LAYER)
    assert layout == "te-0.5-dict" and state["scale_fwd"] is tensors["scale_fwd"]


@pytest.mark.parametrize("value", [
    torch.empty(0, dtype=torch.uint8),  # TE 2.4+ (and 2.18 stateless)
    torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8),  # TE 2.0–2.3
    None,
], ids=["empty-2.4", "pickled-none-2.0", "none"])
def test_empty_states_decode_to_none(value):
    assert decode_extra_state(value, LAYER)[0] is None


def test_torch_save_none_in_bytesio_is_empty():
    assert decode_extra_state(mf.serialize_1x(None), LAYER) == (None, "te-1.x-bytesio")


def test_stateless_recipe_keeps_only_recipe():
    state, _ = decode_extra_state(mf._stateless(), LAYER)
    assert state["recipe"].recipe_name == "Float8CurrentScaling"
    assert "scale_fwd" not in state


def test_malicious_pickle_is_refused_and_writes_nothing(tmp_path):
    marker = tmp_path / "pwned"
    value = mf.malicious_2x(marker)["fc._extra_state"]
    with pytest.raises(Fp8ExportError) as err:
        decode_extra_state(value, LAYER)
    assert LAYER in str(err.value) and "builtins.exec" in str(err.value)
    assert not marker.exists()
    # control: the same bytes really would write the file under plain pickle
    pickle.loads(value.numpy().tobytes())
    assert marker.exists()


def test_malicious_torch_save_in_bytesio_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(Fp8ExportError) as err:
        decode_extra_state(mf.malicious_1x(marker)["fc._extra_state"], LAYER)
    assert LAYER in str(err.value) and "exec" in str(err.value)
    assert not marker.exists()


class _OsSystem:
    def __reduce__(self):
        import os
        return (os.system, ("echo hi",))


@pytest.mark.parametrize("payload", [
    _OsSystem(), np.float64(1.0), collections.Counter(a=1), {1, 2}.__class__.__call__,
], ids=["os.system", "numpy-scalar", "counter", "builtin-method"])
def test_unknown_globals_are_refused_naming_the_layer(payload):
    try:
        data = pickle.dumps({"scale_fwd": torch.ones(3), "x": payload})
    except Exception:  # noqa: BLE001 — some objects cannot be pickled at all; not a case
        pytest.skip("not picklable")
    with pytest.raises(Fp8ExportError) as err:
        unpickle_extra_state(data, LAYER)
    assert LAYER in str(err.value) and "refused" in str(err.value)


def test_custom_amax_algo_is_kept_inert_not_imported():
    state, _ = decode_extra_state(mf.custom_algo_state()["fc._extra_state"], LAYER)
    algo = state["recipe"].get("amax_compute_algo")
    assert isinstance(algo, UnresolvedGlobal) and algo.name == "my_amax_algo"
    with pytest.raises(Fp8ExportError, match="refused"):
        algo(torch.ones(3))


def test_unknown_global_as_plain_data_is_refused():
    with pytest.raises(Fp8ExportError, match=r"fc\._extra_state.*numpy\.ndarray"):
        decode_extra_state(mf.unknown_global_state()["fc._extra_state"], "fc._extra_state")


class _BadView:
    """A tensor rebuilt with a size far outside its storage."""

    def __reduce__(self):
        storage = torch.ones(4).untyped_storage()
        return (torch._utils._rebuild_tensor_v2,
                (torch.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True),
                 0, (1 << 20,), (1,), False, collections.OrderedDict()))


def test_out_of_bounds_tensor_view_is_refused():
    data = pickle.dumps({"scale_fwd": _BadView()})
    with pytest.raises(Fp8ExportError, match=LAYER.replace(".", r"\.")):
        unpickle_extra_state(data, LAYER)


class _NotAStorage:
    def __reduce__(self):
        buf = io.BytesIO()
        torch.save({"a": 1}, buf, _use_new_zipfile_serialization=False)
        return (torch.storage._load_from_bytes, (buf.getvalue(),))


def test_storage_payload_must_be_a_storage():
    with pytest.raises(Fp8ExportError, match="not a storage"):
        unpickle_extra_state(pickle.dumps(_NotAStorage()), LAYER)


def test_persistent_ids_are_refused():
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "x" if isinstance(obj, str) and obj == "pid" else None

    buf = io.BytesIO()
    P(buf).dump({"k": "pid"})
    with pytest.raises(Fp8ExportError, match="persistent"):
        unpickle_extra_state(buf.getvalue(), LAYER)


@pytest.mark.parametrize("value", [torch.ones(3), torch.zeros(2, 2, dtype=torch.uint8), 3.5,
                                   "text"], ids=["float", "2d", "float-obj", "str"])
def test_wrong_extra_state_types_are_refused(value):
    with pytest.raises(Fp8ExportError, match=LAYER.replace(".", r"\.")):
        decode_extra_state(value, LAYER)


def test_cyclic_structure_with_unresolved_global_terminates():
    # a list holding itself 2**40 ways through the memo, plus a refused global
    inner: list = []
    for _ in range(40):
        inner = [inner, inner]
    data = pickle.dumps({"deep": inner, "evil": np.float64})
    with pytest.raises(Fp8ExportError, match="numpy"):
        unpickle_extra_state(data, LAYER)


@pytest.mark.parametrize("cls", ["Format", "_FormatHelper", "DelayedScaling", "QParams"])
def test_build_on_a_stand_in_class_cannot_modify_it(cls):
    # GLOBAL <stand-in class>; BUILD (None, {"__init__": OrderedDict}) would setattr on the class
    from fp8export.checkpoint.training import te_unpickle

    # the BUILD state is (None, {"__init__": OrderedDict}): slot state, applied with setattr
    data = (b"\x80\x02" + pickle.GLOBAL + f"transformer_engine.common.recipe\n{cls}\n".encode()
            + pickle.NONE + pickle.EMPTY_DICT + pickle.BINUNICODE + (8).to_bytes(4, "little")
            + b"__init__" + pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.SETITEM
            + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)
    before = {k: dict(vars(c)) for k, c in vars(te_unpickle).items() if isinstance(c, type)}
    with pytest.raises(Fp8ExportError):
        unpickle_extra_state(data, LAYER)
    after = {k: dict(vars(c)) for k, c in vars(te_unpickle).items() if isinstance(c, type)}
    assert before == after


def test_format_member_pickled_by_name():
    data = (b"\x80\x04" + pickle.GLOBAL + b"transformer_engine.common.recipe\nFormat.E4M3\n"
            + pickle.STOP)
    fmt = unpickle_extra_state(data, LAYER)
    assert isinstance(fmt, FormatStandIn) and fmt.name == "E4M3" and fmt.max_fwd == 448.0
    with pytest.raises(Fp8ExportError, match="refused"):
        unpickle_extra_state(b"\x80\x04" + pickle.GLOBAL
                             + b"transformer_engine.common.recipe\nFormat.__class__\n"
                             + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP, LAYER)
