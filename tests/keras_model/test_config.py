"""The Keras config parser: what it accepts, and that it refuses everything else clearly.

Pure JSON in, no Keras: configs are the shipped samples' own, edited to be hostile or absurd.
"""

from __future__ import annotations

import copy
import json
import sys
import zipfile
from pathlib import Path

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.keras_model.config import SUPPORTED, parse_keras_config

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
LOOKALIKE = SAMPLES / "keras-float8" / "model" / "config.json"
HUB = SAMPLES / "keras-hub-float8" / "model" / "float8_model.keras"


def _lookalike() -> dict:
    return json.loads(LOOKALIKE.read_text())


def _hub() -> dict:
    with zipfile.ZipFile(HUB) as z:
        return json.loads(z.read("config.json"))


def _layer(cfg: dict, name: str) -> dict:
    return next(e for e in cfg["config"]["layers"] if e["config"]["name"] == name)


@pytest.mark.parametrize("load", [_lookalike, _hub], ids=["look-alike", "keras_hub"])
def test_the_tutorial_model_parses(load):
    graph = parse_keras_config(load(), "m")
    kinds = [s.kind for s in graph.layers]
    assert kinds == ["InputLayer", "TokenAndPositionEmbedding", "Dropout", "TransformerDecoder",
                     "GlobalAveragePooling1D", "Dropout", "Dense", "Dropout", "Dense"]
    assert [c.layer for c in graph.calls] == [s.name for s in graph.layers[1:]]
    assert graph.output.layer == "dense_1" and graph.input_dtype == "int32"
    decoder = graph.layer("transformer_decoder")
    assert decoder["activation"] == "relu" and decoder["layer_norm_epsilon"] == 1e-5
    assert decoder["normalize_first"] is False and decoder["num_heads"] == 2


def test_unknown_layer_is_refused_naming_it_and_the_supported_set():
    cfg = _hub()
    _layer(cfg, "dense")["registered_name"] = "my_pkg>FancyDense"
    with pytest.raises(Fp8ExportError) as err:
        parse_keras_config(cfg, "m.keras: config.json")
    msg = str(err.value)
    assert "m.keras: config.json" in msg and "'dense'" in msg and "my_pkg>FancyDense" in msg
    assert all(name in msg for name in SUPPORTED)


@pytest.mark.parametrize("entry", [
    {"module": "keras.layers", "class_name": "Lambda", "registered_name": None},
    {"module": "os", "class_name": "system", "registered_name": None},
    {"module": "builtins", "class_name": "eval", "registered_name": "builtins>eval"},
    {"module": "keras_hub.src.models", "class_name": "GemmaBackbone",
     "registered_name": "keras_hub>GemmaBackbone"},
    {"module": "keras.layers", "class_name": "Dense", "registered_name": "evil>Dense"},
])
def test_code_bearing_or_foreign_classes_are_refused_without_importing(entry):
    cfg = _lookalike()
    before = set(sys.modules)
    layer = _layer(cfg, "dense")
    layer.update(entry)
    with pytest.raises(Fp8ExportError, match="cannot rebuild .* Supported layers"):
        parse_keras_config(cfg, "m")
    assert not {"os.system", "keras", "keras_hub"} & (set(sys.modules) - before)


@pytest.mark.parametrize("layer, key, value, match", [
    ("token_and_position_embedding", "vocabulary_size", 10**12, "vocabulary_size"),
    ("token_and_position_embedding", "embedding_dim", -32, "embedding_dim"),
    ("token_and_position_embedding", "sequence_length", "128", "sequence_length"),
    ("transformer_decoder", "num_heads", 0, "num_heads"),
    ("transformer_decoder", "intermediate_dim", 2**40, "intermediate_dim"),
    ("transformer_decoder", "layer_norm_epsilon", float("nan"), "layer_norm_epsilon"),
    ("transformer_decoder", "activation", "my_activation", "activation"),
    ("transformer_decoder", "encoder_sequence_shape", [None, None, 32], "cross-attention"),
    ("dense", "units", True, "units"),
    ("dense", "lora_rank", 4, "LoRA"),
    ("global_average_pooling1d", "data_format", "channels_first", "data_format"),
])
def test_absurd_or_unsupported_values_are_refused(layer, key, value, match):
    cfg = _hub()
    _layer(cfg, layer)["config"][key] = value
    with pytest.raises(Fp8ExportError, match=match) as err:
        parse_keras_config(cfg, "m")
    assert f"'{layer}'" in str(err.value)


def test_graph_shape_errors():
    cfg = _lookalike()
    bad = copy.deepcopy(cfg)
    bad["config"]["input_layers"] = [["input_ids", 0, 0], ["other", 0, 0]]
    with pytest.raises(Fp8ExportError, match="exactly one input"):
        parse_keras_config(bad, "m")
    bad = copy.deepcopy(cfg)  # a layer reading a layer that is not there
    node = _layer(bad, "dense")["inbound_nodes"][0]["args"][0]
    node["config"]["keras_history"] = ["ghost", 0, 0]
    with pytest.raises(Fp8ExportError, match="ghost"):
        parse_keras_config(bad, "m")
    bad = copy.deepcopy(cfg)  # a cycle: dropout_2 reads dense_1's output
    node = _layer(bad, "dropout_2")["inbound_nodes"][0]["args"][0]
    node["config"]["keras_history"] = ["dense_1", 0, 0]
    with pytest.raises(Fp8ExportError, match="cycle"):
        parse_keras_config(bad, "m")
    bad = copy.deepcopy(cfg)
    _layer(bad, "dense")["config"]["name"] = "dense.evil"
    with pytest.raises(Fp8ExportError, match="without '.'"):
        parse_keras_config(bad, "m")
    bad = copy.deepcopy(cfg)
    _layer(bad, "input_ids")["config"]["dtype"] = "float32"
    with pytest.raises(Fp8ExportError, match="integer token ids"):
        parse_keras_config(bad, "m")
    with pytest.raises(Fp8ExportError, match="Keras model config"):
        parse_keras_config({"model_type": "llama"}, "m")


def test_a_sequential_model_is_a_chain():
    cfg = {"class_name": "Sequential", "config": {"name": "seq", "layers": [
        {"module": "keras.layers", "class_name": "InputLayer",
         "config": {"name": "ids", "batch_shape": [None, 16], "dtype": "int32"}},
        {"module": "keras.layers", "class_name": "Embedding",
         "config": {"name": "emb", "input_dim": 50, "output_dim": 8}},
        {"module": "keras.layers", "class_name": "GlobalMaxPooling1D", "config": {"name": "p"}},
        {"module": "keras.layers", "class_name": "Dense",
         "config": {"name": "out", "units": 3, "activation": "softmax"}}]}}
    graph = parse_keras_config(cfg, "m")
    assert [c.layer for c in graph.calls] == ["emb", "p", "out"]
    assert [c.inputs[0].layer for c in graph.calls] == ["ids", "emb", "p"]
    assert graph.output.layer == "out"
