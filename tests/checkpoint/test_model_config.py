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
