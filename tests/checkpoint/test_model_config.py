"""config.json validation: types and ranges of what becomes a size, auto_map shape."""

from __future__ import annotations

import json

import pytest

from fp8export.checkpoint.model_config import (
    SIZE_LIMITS,
    read_model_config,
    remote_code_entries,
    validate_config,
)
from fp8export.errors import Fp8ExportError

BASE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64,
        "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4,
        "eos_token_id": [1, 2], "rope_theta": 10000.0, "tie_word_embeddings": False}


def test_a_real_config_passes():
    assert validate_config(dict(BASE), __file__) == BASE


@pytest.mark.parametrize("key, value", [
    ("vocab_size", 10**12), ("vocab_size", 0), ("hidden_size", -16), ("hidden_size", 16.0),
    ("num_hidden_layers", "many"), ("num_attention_heads", True), ("max_position_embeddings",
                                                                   SIZE_LIMITS["n_positions"] + 1),
    ("rms_norm_eps", float("inf")), ("architectures", "LlamaForCausalLM"),
    ("model_type", 7), ("tie_word_embeddings", "yes"), ("label2id", {"a": "zero"}),
    ("auto_map", ["x"]), ("eos_token_id", "2"), ("text_config", {"vocab_size": -1}),
])
def test_bad_values_name_the_key(key, value, tmp_path):
    with pytest.raises(Fp8ExportError) as err:
        validate_config({**BASE, key: value}, tmp_path / "config.json")
    assert key in str(err.value) and "config.json" in str(err.value)


def test_keras_configs_are_left_to_the_keras_reader():
    keras = {"class_name": "Functional", "config": {"layers": []}, "dtype": {"name": "x"}}
    assert validate_config(keras, __file__) is keras


def test_auto_map_entries_are_listed_never_imported(tmp_path):
    cfg = {**BASE, "auto_map": {"AutoConfig": "evil.EvilConfig",
                                "AutoTokenizer": [None, "evil.EvilTokenizerFast"]}}
    entries = remote_code_entries(cfg, tmp_path / "config.json")
    assert [(e.entry, e.reference) for e in entries] == [
        ("AutoConfig", "evil.EvilConfig"), ("AutoTokenizer", "evil.EvilTokenizerFast")]
    assert "'auto_map' entry 'AutoConfig'" in entries[0].describe()


def test_read_model_config_is_guarded(tmp_path):
    assert read_model_config(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "vocab_size": "64"}))
    with pytest.raises(Fp8ExportError, match="vocab_size"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").unlink()
    import os

    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(Fp8ExportError, match="FIFO"):
        read_model_config(tmp_path)


@pytest.mark.parametrize("change, key", [
    ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"n_routed_experts": 256, "n_group": 7}, "n_group"),
    ({"n_routed_experts": 256, "n_group": 8, "topk_group": 9}, "topk_group"),
    ({"n_routed_experts": 16, "n_group": 8, "topk_group": 1, "num_experts_per_tok": 3},
     "num_experts_per_tok"),
    ({"pad_token_id": 64}, "pad_token_id"), ({"pad_token_id": -65}, "pad_token_id"),
])
def test_counts_that_bound_each_other(change, key, tmp_path):
    with pytest.raises(Fp8ExportError) as err:
        validate_config({**BASE, **change}, tmp_path / "config.json")
    assert repr(key) in str(err.value)


def test_real_moe_configs_pass():
    deepseek_v3 = {"n_routed_experts": 256, "n_group": 8, "topk_group": 4,
                   "num_experts_per_tok": 8}
    for change in (deepseek_v3, {"num_local_experts": 8, "num_experts_per_tok": 2},
                   {"num_experts": 128, "num_experts_per_tok": 8}, {"pad_token_id": -1},
                   {"pad_token_id": 63}, {"pad_token_id": None}):
        validate_config({**BASE, **change}, __file__)


def test_every_expert_of_every_layer_is_stored(tmp_path):
    from fp8export.checkpoint.model_config import check_experts

    names = [f"model.layers.{i}.mlp.experts.{e}.{leaf}.weight" for i in range(2)
             for e in range(4) for leaf in ("gate_proj", "up_proj", "down_proj")]
    cfg = {"num_experts": 4}
    check_experts(cfg, names, tmp_path)
    check_experts(None, names, tmp_path)
    check_experts(cfg, ["model.layers.0.mlp.shared_experts.gate_proj.weight"], tmp_path)
    gap = [n for n in names if "layers.1.mlp.experts.2.up_proj" not in n]
    with pytest.raises(Fp8ExportError, match=r"layers\.1\.mlp\.experts: config.json's "
                                             r"num_experts is 4, but expert\(s\) 2 have no "
                                             r"up_proj\.weight"):
        check_experts(cfg, gap, tmp_path)
    with pytest.raises(Fp8ExportError, match=r"numbered up to 3, but expert\(s\) 2 have no"):
        check_experts(None, gap, tmp_path)
    with pytest.raises(Fp8ExportError, match="beyond that count"):
        check_experts({"num_experts": 3}, names, tmp_path)
