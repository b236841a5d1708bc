"""Mutation fuzzing of VALID files, end to end: only Fp8ExportError, never another exception.

Extends (does not repeat) the existing fuzz tests, which cover the safetensors header parser
against safetensors' own (tests/checkpoint/test_bad_inputs_fuzz.py), random/truncated Keras
bytes and zip-directory flips (tests/checkpoint/test_keras_bad_input.py), and the TE unpickler
on random/truncated/flipped payloads (tests/checkpoint/training/test_te_fuzz.py). Here:

* safetensors: byte flips, splices, insertions and cuts of a real file (weighted to the
  header), opened through the reader registry and every tensor loaded; and through the whole
  ``convert`` pipeline, which must then either succeed completely or leave nothing behind;
* Keras: byte flips of the HDF5 member inside a real float8 ``.keras`` archive (and of a
  standalone ``.weights.h5``), and structure-aware mutations of its ``config.json``;
* Transformer Engine: structure-aware mutations of a decoded 2.x extra state (wrong shapes,
  wrong types, NaN/negative/huge values, missing or extra keys, bogus recipes) re-serialised
  exactly as TE does, then converted with ``--scales history``; and byte mutations of a whole
  TE ``.pt`` file opened through the registry.

``max_examples`` is modest by default (derandomized: CI is reproducible); each property has a
``*_slow`` twin (``--run-slow``, which CI runs: an exploring pass of as many fresh random
examples, so it finds what the fixed examples miss in bounded time). For long campaigns
FP8EXPORT_FUZZ_EXAMPLES=N sets the default tests' count and FP8EXPORT_FUZZ_SLOW_EXAMPLES=N the
exploring pass's (2000 each was the first campaign's). Each property also counts its outcomes
(hypothesis ``event``), shown with ``--hypothesis-show-statistics``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from reliability_helpers import REPO, make_corpus
from safetensors.torch import save_file

from fp8export.checkpoint import source as _source
from fp8export.errors import Fp8ExportError

_source._load_builtin_readers()
import fp8export.checkpoint.training.te_reader  # noqa: E402,F401  (registers on import)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")




def _settings(n: int, derandomize: bool):
    return settings(max_examples=n, deadline=None, derandomize=derandomize,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


def fuzz(default: int):
    """Two tests from one property: ``test_x`` (``default`` examples, derandomized, so CI is
    reproducible; FP8EXPORT_FUZZ_EXAMPLES=N overrides) and ``test_x_slow`` (marked slow: as
    many fresh random examples; FP8EXPORT_FUZZ_SLOW_EXAMPLES=N overrides)."""
    n = int(os.environ.get("FP8EXPORT_FUZZ_EXAMPLES") or default)
    n_slow = int(os.environ.get("FP8EXPORT_FUZZ_SLOW_EXAMPLES") or default)

    def deco(fn):
        fast = _settings(n, derandomize=True)(given(data=st.data())(fn))
        slow = pytest.mark.slow(_settings(n_slow, derandomize=False)(
            given(data=st.data())(fn)))
        return fast, slow

    return deco


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _open_all(path: Path) -> int:
    from fp8export.checkpoint.source import open_checkpoint

    n = 0
    with open_checkpoint(path) as ckpt:
        for info in ckpt.tensors():
            ckpt.load(info.name)
            n += 1
        ckpt.training_state()
    return n


def _convert(path: Path, out: Path, **kw):
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    return api.convert(ConvertConfig(checkpoint=path, output=out, **kw))


def _only_ours_and_clean(path: Path, out: Path, **kw) -> str:
    """Convert; Fp8ExportError must leave no output and no temporary sibling."""
    shutil.rmtree(out, ignore_errors=True)
    try:
        _convert(path, out, **kw)
        assert (out / "fp8export.json").is_file()
        json.loads((out / "fp8export.json").read_text())
        outcome = "converted"
    except Fp8ExportError as exc:
        assert str(exc)
        assert not out.exists(), f"{out} left behind after: {exc}"
        outcome = "refused"
    left = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not left, left
    shutil.rmtree(out, ignore_errors=True)
    return outcome


# ------------------------------------------------------------------------------ mutations

@st.composite
def mutations(draw, size: int, header_end: int | None = None):
    """A list of byte edits: flip/set a byte, cut, insert, or duplicate a slice."""
    edits = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["set", "set", "xor", "cut", "insert", "splice"]))
        hi = size - 1
        if header_end and draw(st.booleans()):
            hi = header_end - 1  # aim at the header half the time
        pos = draw(st.integers(0, max(hi, 0)))
        edits.append((kind, pos, draw(st.integers(0, 255)), draw(st.integers(1, 64))))
    return edits


def apply(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for kind, pos, byte, n in edits:
        if not b:
            break
        pos %= len(b)
        if kind == "set":
            b[pos] = byte
        elif kind == "xor":
            b[pos] ^= byte or 1
        elif kind == "cut":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = bytes([byte]) * n
        elif kind == "splice":
            b[pos:pos] = b[max(0, pos - n):pos]
    return bytes(b)


# ------------------------------------------------------------------------------ safetensors

@pytest.fixture(scope="module")
def st_valid(work) -> tuple[bytes, int]:
    path = work / "valid.safetensors"
    save_file(make_corpus.llama_tensors(seed=4), str(path), metadata={"format": "pt"})
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data, 8 + n


def _test_safetensors_mutated_open_and_load(work, st_valid, data):
    valid, header_end = st_valid
    blob = apply(valid, data.draw(mutations(len(valid), header_end)))
    path = work / "m.safetensors"
    path.write_bytes(blob)
    try:
        _open_all(path)
        event("opened")
    except Fp8ExportError as exc:
        assert "m.safetensors" in str(exc), str(exc)
        event("refused")


test_safetensors_mutated_open_and_load, test_safetensors_mutated_open_and_load_slow = \
    fuzz(500)(_test_safetensors_mutated_open_and_load)


def _test_safetensors_mutated_convert(work, st_valid, data):
    valid, header_end = st_valid
    blob = apply(valid, data.draw(mutations(len(valid), header_end)))
    d = work / "conv"
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(blob)
    (d / "config.json").write_text(json.dumps(make_corpus.LLAMA_CONFIG))
    event(_only_ours_and_clean(d, work / "conv-out"))


test_safetensors_mutated_convert, test_safetensors_mutated_convert_slow = \
    fuzz(200)(_test_safetensors_mutated_convert)


# ------------------------------------------------------------------------------ Keras

@pytest.fixture(scope="module")
def keras_valid(tmp_path_factory):
    """A real float8-trained Keras model (tests/checkpoint/test_keras_fixtures.py builds it)."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "checkpoint"))
    from test_keras_fixtures import saved_tiny  # noqa: E402

    saved = saved_tiny(tmp_path_factory)
    with zipfile.ZipFile(saved["keras"]) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    return saved, members


def _zip(path: Path, members: dict) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for n, b in members.items():
            zf.writestr(n, b)
    return path


def _test_keras_mutated_h5_member(work, keras_valid, warm_keras_probe, data):
    _, members = keras_valid
    h5 = members["model.weights.h5"]
    mutated = dict(members, **{"model.weights.h5": apply(h5, data.draw(mutations(len(h5))))})
    path = _zip(work / "m.keras", mutated)
    try:
        _open_all(path)
        event("opened")
    except Fp8ExportError as exc:
        assert "m.keras" in str(exc), str(exc)
        event("refused")


test_keras_mutated_h5_member, test_keras_mutated_h5_member_slow = \
    fuzz(150)(_test_keras_mutated_h5_member)


def _test_keras_mutated_weights_h5_file(work, keras_valid, warm_keras_probe, data):
    saved, _ = keras_valid
    d = work / "h5"
    if not d.exists():
        d.mkdir()
        shutil.copy(saved["h5"].parent / "config.json", d / "config.json")
    h5 = saved["h5"].read_bytes()
    (d / "m.weights.h5").write_bytes(apply(h5, data.draw(mutations(len(h5)))))
    try:
        _open_all(d / "m.weights.h5")
        event("opened")
    except Fp8ExportError as exc:
        assert "m.weights.h5" in str(exc) or "config.json" in str(exc), str(exc)
        event("refused")


test_keras_mutated_weights_h5_file, test_keras_mutated_weights_h5_file_slow = \
    fuzz(100)(_test_keras_mutated_weights_h5_file)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    if not path:
        return value
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


_DELETE = object()


def _test_keras_mutated_config(work, keras_valid, warm_keras_probe, data):
    """Replace or delete any node of config.json with arbitrary JSON (dtype policies, layer
    lists, shapes, names): the reader must refuse it cleanly or read it."""
    _, members = keras_valid
    config = json.loads(members["config.json"])
    paths = list(_paths(config))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        value = data.draw(st.one_of(JSON_VALUES, st.just(_DELETE))) if path else \
            data.draw(JSON_VALUES)
        try:
            config = _set(config, path, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit removed the path
        paths = list(_paths(config))
    raw = json.dumps(config, allow_nan=True).encode()
    path = _zip(work / "c.keras", dict(members, **{"config.json": raw}))
    try:
        _open_all(path)
        event("opened")
    except Fp8ExportError as exc:
        assert "c.keras" in str(exc) or "config" in str(exc), str(exc)
        event("refused")


test_keras_mutated_config, test_keras_mutated_config_slow = \
    fuzz(150)(_test_keras_mutated_config)


# ------------------------------------------------------------------------------ Transformer Engine

@pytest.fixture(scope="module")
def te():
    return make_corpus.te_fixtures()


def _te_value():
    """A value TE state could hold, or one it must not: tensors of odd shapes/dtypes/values."""
    shapes = st.lists(st.integers(0, 5), max_size=3)
    fills = st.sampled_from([0.0, 1.0, -1.0, float("nan"), float("inf"), 1e38, 1e-45])
    tensors = st.builds(lambda s, f, dt: torch.full(s, f).to(dt), shapes, fills,
                        st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8]))
    return st.one_of(tensors, st.none(), st.integers(-5, 5), st.text(max_size=4),
                     st.lists(st.integers(0, 3), max_size=3), st.floats())


def _mutate(state: dict, data) -> dict:
    state = dict(state)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(state) + ["extra_key"]))
        how = data.draw(st.sampled_from(["poke", "drop", "replace", "extra"]))
        value = state.get(key)
        if how == "poke" and isinstance(value, torch.Tensor) and value.numel() \
                and value.is_floating_point():
            t = value.clone()  # one bad entry in an otherwise valid tensor
            flat = t.view(-1)
            flat[data.draw(st.integers(0, flat.numel() - 1))] = data.draw(
                st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, 3e38]))
            state[key] = t
        elif how == "extra" and isinstance(value, dict):
            inner = dict(value)  # extra_fp8_variables: num_gemms, fp8_max_*, flags
            inner[data.draw(st.sampled_from(sorted(inner) + ["x"]))] = data.draw(_te_value())
            state[key] = inner
        elif how == "drop":
            state.pop(key, None)
        else:
            state[key] = data.draw(_te_value())
    return state


def _test_te_state_structure_mutations_convert(work, te, data):
    """Decoded TE state mutated (shapes, types, values, keys, recipe), re-serialised exactly as
    TE 2.x (pickle with the recipe) or 1.x (BytesIO of torch.save) does, then converted."""
    import pickle

    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    num_gemms = data.draw(st.integers(1, 2))
    tensors, _ = te._fwd_bwd(num_gemms, 8, 10, rng)
    layout = data.draw(st.sampled_from(["2.x", "1.x"]))
    if layout == "2.x":
        length = data.draw(st.sampled_from([8, 1, 0, -3]))
        state = {"recipe": te.DelayedScaling(amax_history_len=length), **tensors,
                 "extra_fp8_variables": te._extra_vars(num_gemms)}
        state = _mutate(state, data)
        with te.te_recipe_module():
            raw = pickle.dumps(state)
        value = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    else:
        state = {"scale_fwd": tensors["scale_fwd"], "scale_inv_fwd": 1.0 / tensors["scale_fwd"],
                 "amax_history_fwd": tensors["amax_history_fwd"],
                 "scale_bwd": tensors["scale_bwd"], "scale_inv_bwd": 1.0 / tensors["scale_bwd"],
                 "amax_history_bwd": tensors["amax_history_bwd"],
                 "extra_fp8_variables": te._extra_vars(num_gemms)}
        value = io.BytesIO()
        torch.save(_mutate(state, data), value)
    if num_gemms == 1:
        sd = {"fc.weight": te._w(rng, te.H, te.H), "fc._extra_state": value}
    else:  # LayerNormMLP: fc1 and fc2 share one extra state
        sd = {"mlp.fc1_weight": te._w(rng, te.FFN, te.H),
              "mlp.fc2_weight": te._w(rng, te.H, te.FFN), "mlp._extra_state": value}
    path = work / "te.pt"
    torch.save(sd, path)
    scales = data.draw(st.sampled_from(["history", "auto"]))
    event(f"{layout} {_only_ours_and_clean(path, work / 'te-out', scales=scales)}")


test_te_state_structure_mutations_convert, test_te_state_structure_mutations_convert_slow = \
    fuzz(150)(_test_te_state_structure_mutations_convert)


@pytest.fixture(scope="module")
def te_file(work, te) -> bytes:
    path = work / "te_valid.pt"
    torch.save(te.te_layer_state_dict("2.x", length=4, steps=6).state_dict, path)
    return path.read_bytes()


def _test_te_file_byte_mutations_open(work, te_file, data):
    path = work / "tb.pt"
    path.write_bytes(apply(te_file, data.draw(mutations(len(te_file)))))
    try:
        _open_all(path)
        event("opened")
    except Fp8ExportError:
        event("refused")


test_te_file_byte_mutations_open, test_te_file_byte_mutations_open_slow = \
    fuzz(150)(_test_te_file_byte_mutations_open)


def test_keras_h5_superblock_overflow_is_our_error(work, keras_valid):
    """Found by test_keras_mutated_h5_member: one byte of the HDF5 superblock (offset 48, in
    the end-of-file address) set to 0 inside a valid float8 .keras archive."""
    _, members = keras_valid
    h5 = bytearray(members["model.weights.h5"])
    h5[48] = 0
    path = _zip(work / "superblock.keras", dict(members, **{"model.weights.h5": bytes(h5)}))
    with pytest.raises(Fp8ExportError, match="superblock.keras"):
        _open_all(path)


def test_keras_h5_group_count_overflow_is_our_error(work, keras_valid):
    """Found by test_keras_mutated_h5_member_slow: 16 zero bytes inserted at offset 143 of the
    weights file make h5py read a group's object count as a number past ssize_t."""
    _, members = keras_valid
    h5 = members["model.weights.h5"]
    mutated = h5[:143] + bytes(16) + h5[143:]
    path = _zip(work / "groupcount.keras", dict(members, **{"model.weights.h5": mutated}))
    with pytest.raises(Fp8ExportError, match="groupcount.keras"):
        _open_all(path)


def test_pt_zip64_multidisk_is_our_error(work, te_file):
    """Found by test_te_file_byte_mutations_open_slow: the ZIP64 end-of-central-directory
    locator's disk number set to 2 in a torch.save file (any .pt, TE or not)."""
    data = bytearray(te_file)
    i = data.rfind(b"PK\x06\x07")
    data[i + 4] = 2
    path = work / "multidisk.pt"
    path.write_bytes(bytes(data))
    with pytest.raises(Fp8ExportError, match="multidisk.pt"):
        _open_all(path)


def test_the_warm_probe_reports_a_crash_and_a_hang_as_a_cold_one(work, keras_valid,
                                                                 warm_keras_probe, monkeypatch):
    """The Keras properties' forked probe child: the weights file that segfaults HDF5 (from
    tests/checkpoint/hostile) is refused as crashed, a walk past the time limit as unfinished."""
    from fp8export.checkpoint import keras_probe

    hostile = REPO / "tests" / "checkpoint" / "hostile"
    d = work / "crash"
    d.mkdir()
    shutil.copy(hostile / "attr_segfault.weights.h5", d / "m.weights.h5")
    shutil.copy(hostile / "attr_segfault.config.json", d / "config.json")
    with pytest.raises(Fp8ExportError, match=r"m\.weights\.h5.*crashed the HDF5 library "
                                             r"\(SIGSEGV"):
        _open_all(d / "m.weights.h5")
    saved, _ = keras_valid
    assert _open_all(saved["keras"]) > 0  # a sound file still opens
    monkeypatch.setattr(keras_probe, "TIMEOUT_S", 0.001)
    with pytest.raises(Fp8ExportError, match="did not finish"):
        _open_all(saved["keras"])


def test_fuzz_targets_can_fail():
    """Guard: the properties are not vacuous — damaged inputs do raise our error."""
    with pytest.raises(Fp8ExportError):
        _open_all(_write_tmp(b"\x00" * 3, ".safetensors"))


def _write_tmp(data: bytes, suffix: str) -> Path:
    import tempfile

    f = tempfile.NamedTemporaryFile(suffix=suffix, delete=False)
    f.write(data)
    f.close()
    return Path(f.name)

