"""A folder holding a Keras checkpoint is recognised and read; ambiguous folders are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fp8export.api import convert
from fp8export.checkpoint.keras_files import is_keras_checkpoint, keras_file
from fp8export.checkpoint.source import open_checkpoint
from fp8export.convert.config import ConvertConfig
from fp8export.errors import Fp8ExportError

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "keras-float8" / "model"


def test_the_sample_folder_converts_like_its_keras_archive(tmp_path):
    pytest.importorskip("h5py")
    by_folder = convert(ConvertConfig(checkpoint=SAMPLE, output=tmp_path / "a"))
    by_file = convert(ConvertConfig(checkpoint=SAMPLE / "float8_model.keras",
                                    output=tmp_path / "b"))
    assert by_folder.quantized == by_file.quantized == 8
    man_a = json.loads((tmp_path / "a" / "fp8export.json").read_text())
    man_b = json.loads((tmp_path / "b" / "fp8export.json").read_text())
    assert man_a["quantized"] == man_b["quantized"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()
    assert any("read the Keras archive float8_model.keras" in n and "bf16_model.weights.h5" in n
               for n in by_folder.notes)


def test_a_folder_with_one_weights_file_uses_its_config(tmp_path):
    pytest.importorskip("h5py")
    folder = tmp_path / "k"
    folder.mkdir()
    shutil.copy(SAMPLE / "float8_model.weights.h5", folder)
    shutil.copy(SAMPLE / "config.json", folder)
    assert is_keras_checkpoint(folder)
    assert keras_file(folder)[0] == folder / "float8_model.weights.h5"
    with open_checkpoint(folder) as ck:
        assert ck.kind == "keras" and len(ck.tensors()) > 8


def test_an_ambiguous_folder_names_its_files(tmp_path):
    folder = tmp_path / "k"
    folder.mkdir()
    for name in ("a.weights.h5", "b.weights.h5"):
        shutil.copy(SAMPLE / "float8_model.weights.h5", folder / name)
    with pytest.raises(Fp8ExportError, match=r"several Keras checkpoints \(a.weights.h5, "
                                             r"b.weights.h5\).*Give the file itself"):
        keras_file(folder)


def test_a_hugging_face_folder_is_not_taken_for_keras(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "extra.weights.h5").write_bytes(b"")
    assert not is_keras_checkpoint(folder)
    assert not is_keras_checkpoint(tmp_path / "missing")
