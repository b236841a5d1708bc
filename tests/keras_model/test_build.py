"""Rebuilding from an FP8 folder: sizes are checked against the weights before anything is used.

No Keras: the shipped look-alike sample converted, then its folder's config.json edited.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from fp8export.errors import Fp8ExportError


@pytest.fixture()
def folder(keras_float8_folder):
    return keras_float8_folder


def _edited(folder: Path, tmp: Path, edit) -> Path:
    copy = tmp / "fp8"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    edit({e["config"]["name"]: e for e in cfg["config"]["layers"]}, cfg)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def _build(path: Path):
    from fp8export.keras_model.build import keras_model_from_folder
    from fp8export.keras_model.weights import read_folder

    return keras_model_from_folder(read_folder(path))


def test_the_folder_rebuilds_with_keras_float8_biases_rounded(folder):
    from fp8export.keras_model.weights import read_folder

    model = _build(folder)
    assert model.output_activation == "sigmoid" and model.vocab_size == 174
    assert model.max_positions == 128
    raw = read_folder(folder).tensors["dense.bias"]
    assert torch.equal(model.dense.bias, raw.to(torch.bfloat16).float())  # as Keras adds it
    assert not torch.equal(model.dense.bias, raw)


def test_a_huge_size_in_the_config_fails_on_the_shape_check_not_an_allocation(folder, tmp_path):
    def edit(layers, _):
        layers["token_and_position_embedding"]["config"]["vocabulary_size"] = 16_000_000

    start = time.perf_counter()
    with pytest.raises(Fp8ExportError, match=r"\[174, 32\] but the config makes the embedding "
                                             r"table \[16000000, 32\]"):
        _build(_edited(folder, tmp_path, edit))
    assert time.perf_counter() - start < 10  # a 2 GB table was never made


def test_weights_no_layer_reads_are_refused(folder, tmp_path):
    def edit(layers, cfg):  # drop `dense` and its dropout: dense_1 reads the pooled features
        cfg["config"]["layers"] = [e for e in cfg["config"]["layers"]
                                   if e["config"]["name"] not in ("dense", "dropout_3")]
        arg = layers["dense_1"]["inbound_nodes"][0]["args"][0]
        arg["config"]["keras_history"] = ["dropout_2", 0, 0]

    with pytest.raises(Fp8ExportError, match="match no layer .* dense.bias"):
        _build(_edited(folder, tmp_path, edit))


def test_a_layer_applied_to_token_ids_is_refused(folder, tmp_path):
    def edit(layers, _):
        arg = layers["transformer_decoder"]["inbound_nodes"][0]["args"][0]
        arg["config"]["keras_history"] = ["input_ids", 0, 0]

    with pytest.raises(Fp8ExportError, match="reads token ids directly"):
        _build(_edited(folder, tmp_path, edit))
