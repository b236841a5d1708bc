"""Fuzzing the TE decoding path: random, truncated and mutated input → only Fp8ExportError."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from te_helpers import fixtures_module

from fp8export.checkpoint.training import te_reader
from fp8export.checkpoint.training.te import te_training_state
from fp8export.checkpoint.training.te_unpickle import decode_extra_state, unpickle_extra_state
from fp8export.errors import Fp8ExportError

mf = fixtures_module()
LAYER = "fuzz._extra_state"
FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _valid_payload() -> bytes:
    tensors, _ = mf._fwd_bwd(2, 4, 6, np.random.default_rng(0))
    return mf.serialize_2x(tensors, 2, mf.DelayedScaling(amax_history_len=4)).numpy().tobytes()


VALID = _valid_payload()
VALID_1X = mf.serialize_1x(mf._fwd_bwd(1, 4, 6, np.random.default_rng(1))[0]).getvalue()
# opcodes that make pickles do things: a fuzzer that only sees random bytes rarely builds them
OPCODES = [pickle.GLOBAL + b"os\nsystem\n", pickle.GLOBAL + b"builtins\neval\n",
           pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n",
           pickle.GLOBAL + b"torch.storage\n_load_from_bytes\n",
           pickle.GLOBAL + b"transformer_engine.common.recipe\nDelayedScaling\n",
           pickle.GLOBAL + b"transformer_engine.common.recipe\nFormat\n",
           pickle.REDUCE, pickle.BUILD, pickle.NEWOBJ, pickle.TUPLE, pickle.EMPTY_DICT,
           pickle.MARK, pickle.SETITEMS, pickle.STOP, b"\x80\x04", pickle.BINPUT + b"\x00",
           pickle.BINGET + b"\x00", pickle.NONE, pickle.EMPTY_TUPLE, pickle.BINPERSID,
           b"K\x05", b"X\x03\x00\x00\x00abc", pickle.EXT1 + b"\x01", pickle.INST + b"os\nsystem\n"]


def _only_our_error(fn, *args):
    try:
        fn(*args)
    except Fp8ExportError:
        pass


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data):
    _only_our_error(unpickle_extra_state, data, LAYER)


@FUZZ
@given(st.lists(st.sampled_from(OPCODES), max_size=24))
def test_random_opcode_sequences(ops):
    _only_our_error(unpickle_extra_state, b"\x80\x04" + b"".join(ops), LAYER)


@FUZZ
@given(st.integers(0, len(VALID) - 1))
def test_truncated_valid_payload(cut):
    _only_our_error(unpickle_extra_state, VALID[:cut], LAYER)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1,
                max_size=8))
def test_mutated_valid_payload_through_state_mapping(flips):
    data = bytearray(VALID)
    for pos, byte in flips:
        data[pos] = byte
    value = torch.frombuffer(data, dtype=torch.uint8)
    sd = {"fuzz.fc1_weight": torch.zeros(2, 2), "fuzz.fc2_weight": torch.zeros(2, 2),
          "fuzz._extra_state": value}
    _only_our_error(te_training_state, sd)


@FUZZ
@given(st.integers(0, len(VALID_1X) - 1), st.integers(0, 255))
def test_mutated_bytesio_payload(pos, byte):
    data = bytearray(VALID_1X)
    data[pos] = byte
    _only_our_error(decode_extra_state, io.BytesIO(bytes(data)), LAYER)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 1 << 30), flips=st.lists(st.tuples(st.integers(0, 1 << 30),
                                                              st.integers(0, 255)), max_size=4))
def test_damaged_checkpoint_files(tmp_path, cut, flips):
    src = tmp_path / "src.pt"
    if not src.exists():
        torch.save(mf.te_layer_state_dict("1.x", length=4, steps=6).state_dict, src)
    data = bytearray(src.read_bytes())
    data = data[: cut % (len(data) + 1)]
    for pos, byte in flips:
        if data:
            data[pos % len(data)] = byte
    path = tmp_path / "damaged.pt"
    path.write_bytes(bytes(data))
    te_reader.can_open(path)  # never raises
    try:
        te_reader.open_fp8_state_checkpoint(path).close()
    except Fp8ExportError:
        pass


def test_fuzz_targets_really_fail_on_bad_input():
    # guard against a fuzz test that can never fail: bad input does raise our error
    with pytest.raises(Fp8ExportError):
        unpickle_extra_state(VALID[: len(VALID) // 2], LAYER)
    with pytest.raises(Fp8ExportError):
        unpickle_extra_state(b"\x80\x04" + OPCODES[0] + b"X\x02\x00\x00\x00id\x85R.", LAYER)
