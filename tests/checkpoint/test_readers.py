"""Readers on real files written and read back: HF folders (single, sharded, .bin shards),
single safetensors files, torch state dicts (wrapped, nested, legacy format)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from fp8export.checkpoint import source as _source
from fp8export.checkpoint.source import open_checkpoint
from fp8export.errors import Fp8ExportError

# Stopgap: open_checkpoint loads the built-in readers only while its registry is empty, so a
# reader registered earlier (importing the Transformer Engine reader does) hides them. Loading
# them here keeps these tests independent of collection order until source.py uses a flag.
_source._load_builtin_readers()


AUX = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
       "merges.txt", "chat_template.jinja")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama saved by transformers in bf16: one file and sharded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    root = tmp_path_factory.mktemp("llama")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    for folder in ("single", "sharded"):
        for name in AUX:
            (root / folder / name).write_text("{}")
    (root / "single" / "README.md").write_text("not an aux file")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return root, state


def _assert_matches(ck, state):
    names = [t.name for t in ck.tensors()]
    assert len(names) == len(set(names))
    # transformers ties nothing here, so every state-dict tensor is stored
    assert set(names) == set(state)
    for info in ck.tensors():
        t = ck.load(info.name)
        assert info.dtype == "BF16" and t.dtype == torch.bfloat16
        assert tuple(t.shape) == info.shape
        assert torch.equal(t, state[info.name]), info.name


def test_hf_folder_single_file(llama):
    root, state = llama
    with open_checkpoint(root / "single") as ck:
        assert ck.kind == "hf-folder"
        assert ck.config["model_type"] == "llama"
        assert [p.name for p in ck.source_files] == ["model.safetensors"]
        aux = {p.name for p in ck.aux_files}
        assert aux == {*AUX, "generation_config.json"}
        _assert_matches(ck, state)


def test_hf_folder_sharded_with_index(llama):
    root, state = llama
    with open_checkpoint(root / "sharded") as ck:
        files = [p.name for p in ck.source_files]
        assert files[-1] == "model.safetensors.index.json"
        shards = files[:-1]
        assert len(shards) >= 2 and shards == sorted(shards)
        groups = ck.shard_groups()
        assert [g for g, _ in groups] == shards
        assert sum(len(n) for _, n in groups) == len(state)
        _assert_matches(ck, state)
    # the index file itself opens its folder
    with open_checkpoint(root / "sharded" / "model.safetensors.index.json") as ck:
        assert len(ck.tensors()) == len(state)


def test_single_safetensors_dtypes_and_config_beside(tmp_path):
    tensors = {
        "a.weight": torch.randn(8, 4, dtype=torch.float16),
        "b.weight": torch.randn(3, 5, dtype=torch.float32),
        "c.weight": torch.randn(2, 2).to(torch.float8_e4m3fn),
        "c.weight_scale": torch.tensor([0.5], dtype=torch.float32),
        "pos_ids": torch.arange(6, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
    }
    save_file(tensors, tmp_path / "w.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    with open_checkpoint(tmp_path / "w.safetensors") as ck:
        assert ck.kind == "safetensors" and ck.config == {"model_type": "x"}
        dtypes = {t.name: t.dtype for t in ck.tensors()}
        assert dtypes == {"a.weight": "F16", "b.weight": "F32", "c.weight": "F8_E4M3",
                          "c.weight_scale": "F32", "pos_ids": "I64", "mask": "BOOL"}
        for name, ref in tensors.items():
            got = ck.load(name)
            assert got.dtype == ref.dtype
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                               ref.view(torch.uint8) if ref.dtype == torch.float8_e4m3fn else ref)


def test_single_safetensors_without_config(tmp_path):
    save_file({"w": torch.ones(2, 2, dtype=torch.bfloat16)}, tmp_path / "m.safetensors")
    with open_checkpoint(tmp_path / "m.safetensors") as ck:
        assert ck.config is None and ck.info("w").shape == (2, 2)
        with pytest.raises(Fp8ExportError, match="no tensor named 'nope'"):
            ck.load("nope")


@pytest.mark.parametrize("wrap", ["state_dict", "model", "module", "model_state_dict"])
def test_torch_state_dict_unwrapped(tmp_path, wrap):
    sd = {"layer.weight": torch.randn(4, 4), "layer.bias": torch.randn(4)}
    path = tmp_path / "ckpt.pt"
    torch.save({wrap: sd, "epoch": 3, "optimizer": {"lr": 0.1}}, path)
    with open_checkpoint(path) as ck:
        assert ck.kind == "torch"
        assert {t.name for t in ck.tensors()} == set(sd)
        assert torch.equal(ck.load("layer.weight"), sd["layer.weight"])
        assert any(wrap in n and "epoch" in n for n in ck.notes)


def test_torch_nested_and_non_tensor_leaves(tmp_path):
    path = tmp_path / "nested.pth"
    torch.save({"enc": {"proj": {"weight": torch.ones(2, 3, dtype=torch.float16)}},
                "step": 7, "name": "x"}, path)
    with open_checkpoint(path) as ck:
        got = [(t.name, t.dtype, t.shape) for t in ck.tensors()]
        assert got == [("enc.proj.weight", "F16", (2, 3))]
        assert any("step" in n and "name" in n for n in ck.notes)


def test_torch_dataparallel_prefix_stripped(tmp_path):
    path = tmp_path / "dp.pt"
    torch.save({"module.fc.weight": torch.ones(2, 2), "module.fc.bias": torch.zeros(2)}, path)
    with open_checkpoint(path) as ck:
        assert {t.name for t in ck.tensors()} == {"fc.weight", "fc.bias"}


def test_torch_legacy_format(tmp_path):
    path = tmp_path / "legacy.pt"
    w = torch.randn(3, 3, dtype=torch.bfloat16)
    torch.save({"w": w}, path, _use_new_zipfile_serialization=False)
    with open_checkpoint(path) as ck:
        assert torch.equal(ck.load("w"), w)


def test_bin_shards_with_index(tmp_path):
    a = {"model.embed.weight": torch.randn(8, 4, dtype=torch.bfloat16)}
    b = {"model.layers.0.q_proj.weight": torch.randn(4, 4, dtype=torch.bfloat16),
         "lm_head.weight": torch.randn(8, 4, dtype=torch.bfloat16)}
    torch.save(a, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save(b, tmp_path / "pytorch_model-00002-of-00002.bin")
    weight_map = {**{k: "pytorch_model-00001-of-00002.bin" for k in a},
                  **{k: "pytorch_model-00002-of-00002.bin" for k in b}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with open_checkpoint(tmp_path) as ck:
        assert ck.kind == "hf-folder"
        assert [p.name for p in ck.source_files] == [
            "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
            "pytorch_model.bin.index.json"]
        for name, ref in {**a, **b}.items():
            assert torch.equal(ck.load(name), ref)
            assert ck.info(name).file.name == weight_map[name]


def test_single_pytorch_model_bin_folder(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with open_checkpoint(tmp_path) as ck:
        assert ck.kind == "hf-folder" and ck.config is None
        assert [t.name for t in ck.tensors()] == ["w"]


def test_hub_cache_snapshot_symlinks_are_allowed(tmp_path):
    # huggingface_hub stores snapshot files as symlinks into <repo>/blobs/
    repo = tmp_path / "models--x--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save_file({"w": torch.ones(2, 2)}, blobs / "deadbeef")
    os.symlink("../../blobs/deadbeef", snap / "model.safetensors")
    with open_checkpoint(snap) as ck:
        assert ck.load("w").sum() == 4
