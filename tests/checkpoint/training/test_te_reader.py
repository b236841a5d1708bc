"""The TE/torchao torch-state-dict reader: detection without unpickling, names, refusals."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch
from te_helpers import fixtures_module, open_ckpt

from fp8export.checkpoint.training import te_reader
from fp8export.errors import Fp8ExportError

mf = fixtures_module()


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    out = tmp_path_factory.mktemp("te")
    marker = out / "PWNED"
    paths = mf.write_fixtures(out, marker)
    return paths, marker


@pytest.mark.parametrize("name", ["te2_layer", "te1_layer", "te06_layer", "te2_history1",
                                  "te2_calibration", "te_empty", "te2_custom_algo"])
def test_every_layout_opens_through_the_registry(fx, name):
    paths, _ = fx
    assert te_reader.can_open(paths[name])
    with open_ckpt(paths[name]) as ck:
        assert ck.kind == "transformer-engine"
        names = [t.name for t in ck.tensors()]
        assert not any("_extra_state" in n for n in names)
        assert ck.training_state() is not None


def test_tensors_are_renamed_and_load_the_stored_data(fx):
    paths, _ = fx
    stored = torch.load(paths["te2_layer"], weights_only=False)  # our own trusted fixture
    with open_ckpt(paths["te2_layer"]) as ck:
        infos = {t.name: t for t in ck.tensors()}
        assert "layers.0.layernorm_mlp.fc1.weight" in infos
        assert "layers.0.layernorm_mlp.fc1_weight" not in infos
        assert "layers.0.experts.3.weight" in infos
        assert infos["layers.0.layernorm_mlp.fc2.weight"].shape == (mf.H, mf.FFN)
        assert infos["layers.0.layernorm_mlp.fc2.weight"].dtype == "BF16"
        assert torch.equal(ck.load("layers.0.layernorm_mlp.fc2.weight"),
                           stored["layers.0.layernorm_mlp.fc2_weight"])
        assert torch.equal(ck.load("layers.0.experts.2.weight"), stored["layers.0.experts.weight2"])
        # every input history names a module whose weight is presented
        for module in ck.training_state().for_role("input"):
            assert f"{module}.weight" in infos
        with pytest.raises(Fp8ExportError, match="no tensor named"):
            ck.load("layers.0.layernorm_mlp._extra_state")


@pytest.mark.parametrize("name", ["te2_malicious", "te1_malicious", "te_malicious_outer",
                                  "te2_unknown_global"])
def test_hostile_checkpoints_are_refused_and_write_nothing(fx, name):
    paths, marker = fx
    with pytest.raises(Fp8ExportError) as err:
        open_ckpt(paths[name])
    text = str(err.value)
    assert "refused" in text
    assert "fc._extra_state" in text or str(paths[name]) in text
    assert not marker.exists()


def test_plain_torch_file_is_left_to_the_generic_reader(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"fc.weight": torch.zeros(4, 4)}, path)
    assert not te_reader.can_open(path)
    (tmp_path / "junk.pt").write_bytes(b"PK\x03\x04 not really a zip")
    assert not te_reader.can_open(tmp_path / "junk.pt")
    assert not te_reader.can_open(tmp_path / "missing.pt")


def test_detection_does_not_unpickle(tmp_path, fx):
    # the malicious fixture is detected as TE content, and detecting it runs nothing
    paths, marker = fx
    assert te_reader.can_open(paths["te2_malicious"]) and not marker.exists()
    # a string that merely contains the marker bytes is not a key ending in _extra_state
    path = tmp_path / "lookalike.pt"
    torch.save({"fc.weight": torch.zeros(2, 2), "note": "_extra_state_is_mentioned"}, path)
    assert not te_reader.can_open(path)


def test_hf_folder_of_te_shards(tmp_path):
    fxl = mf.te_layer_state_dict("2.x")
    sd = fxl.state_dict
    names = sorted(sd)
    half = len(names) // 2
    shards = {"pytorch_model-00001-of-00002.bin": names[:half],
              "pytorch_model-00002-of-00002.bin": names[half:]}
    for shard, keys in shards.items():
        torch.save({k: sd[k] for k in keys}, tmp_path / shard)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: s for s, ks in shards.items() for k in ks}}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "te-test"}))
    assert te_reader.can_open(tmp_path)
    with open_ckpt(tmp_path) as ck:
        assert ck.kind == "transformer-engine" and ck.config == {"model_type": "te-test"}
        assert len(ck.training_state().for_role("input")) == 8
        assert {p.name for p in ck.source_files} >= set(shards)


def test_wrapped_state_dict_is_unwrapped(tmp_path):
    sd = mf.te_layer_state_dict("1.x").state_dict
    path = tmp_path / "ckpt.pt"
    torch.save({"model": sd, "iteration": 7}, path)
    with open_ckpt(path) as ck:
        assert any("under 'model'" in n for n in ck.notes)
        assert len(ck.training_state().for_role("input")) == 8


def test_truncated_file_is_a_clean_error(tmp_path, fx):
    paths, _ = fx
    data = paths["te2_layer"].read_bytes()
    path = tmp_path / "cut.pt"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(Fp8ExportError, match="cut.pt"):
        te_reader.open_fp8_state_checkpoint(path)


def test_data_pkl_is_read_only_from_the_zip(tmp_path):
    # a zip with two data.pkl members is not a torch file we scan
    path = tmp_path / "two.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a/data.pkl", b"_extra_state")
        zf.writestr("b/data.pkl", b"_extra_state")
    assert not te_reader.can_open(path)


def test_bytesio_outer_entries_need_the_te_reader(fx):
    # the generic loader refuses io.BytesIO; ours allows exactly that type
    paths, _ = fx
    with pytest.raises(Exception):
        torch.load(paths["te1_layer"], weights_only=True)
    loaded = te_reader._load(paths["te1_layer"])
    assert isinstance(loaded["layers.0.self_attention.proj._extra_state"], io.BytesIO)


def test_te2_extra_states_in_safetensors(tmp_path):
    from safetensors.torch import save_file

    sd = mf.te_layer_state_dict("2.x").state_dict
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    assert te_reader.can_open(tmp_path / "model.safetensors") and te_reader.can_open(tmp_path)
    with open_ckpt(tmp_path) as ck:
        assert ck.kind == "transformer-engine"
        assert "layers.0.layernorm_mlp.fc2.weight" in {t.name for t in ck.tensors()}
        assert torch.equal(ck.load("layers.0.experts.1.weight"), sd["layers.0.experts.weight1"])
        assert len(ck.training_state().for_role("input")) == 8


def test_plain_safetensors_is_left_to_the_generic_reader(tmp_path):
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(2, 2)}, tmp_path / "x.safetensors")
    assert not te_reader.can_open(tmp_path / "x.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    assert not te_reader.can_open(tmp_path / "bad.safetensors")
