"""ONNX files from elsewhere: one loader, external data kept in the folder, an op allowlist."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto

from fp8export.errors import Fp8ExportError
from fp8export.onnx.check import OPS, check_model, check_ops
from fp8export.onnx.load import load_onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corrupt"))
from corpus_files import onnx_model  # noqa: E402
from corpus_untrusted import loop_model  # noqa: E402


def _external(path: Path, name: str, location: str, offset: int = 0, length: int = 4) -> Path:
    model = onnx.load(str(path))
    t = next(t for t in model.graph.initializer if t.name == name)
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = key, value
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/hostname", "a/../../x.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path, location):
    (tmp_path / "m").mkdir()
    p = _external(onnx_model(tmp_path / "m" / "model.onnx"), "w_scale", location)
    with pytest.raises(Fp8ExportError, match="outside"):
        load_onnx(p)
    with pytest.raises(Fp8ExportError, match="outside"):
        check_model(p)


def test_external_data_linked_out_or_short_is_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.bin").symlink_to(tmp_path / "secret.bin")
    p = _external(onnx_model(tmp_path / "m" / "model.onnx"), "w_scale", "w.bin")
    with pytest.raises(Fp8ExportError, match="outside"):
        load_onnx(p)
    (tmp_path / "m" / "w.bin").unlink()
    (tmp_path / "m" / "w.bin").write_bytes(b"\0" * 2)
    with pytest.raises(Fp8ExportError, match="w.bin, which holds 2"):
        load_onnx(p)


def test_external_data_inside_the_folder_is_read(tmp_path):
    import numpy as np

    p = onnx_model(tmp_path / "model.onnx")
    scale = onnx.numpy_helper.to_array(
        next(t for t in onnx.load(str(p)).graph.initializer if t.name == "w_scale"))
    (tmp_path / "w.bin").write_bytes(b"\0" * 8 + np.float32(scale).tobytes())
    _external(p, "w_scale", "w.bin", offset=8)
    model = load_onnx(p, load_data=True)
    assert check_model(p).ok
    assert any(t.name == "w_scale" for t in model.graph.initializer)


@pytest.mark.parametrize("content", [b"", b"\x08\x0a\x12" + bytes(range(256)) * 4,
                                     b"not onnx at all"])
def test_bytes_that_are_not_onnx(tmp_path, content):
    p = tmp_path / "bad.onnx"
    p.write_bytes(content)
    with pytest.raises(Fp8ExportError, match="not a readable ONNX"):
        load_onnx(p)


def test_loop_is_not_an_op_of_the_profile(tmp_path):
    model = load_onnx(loop_model(tmp_path / "loop.onnx"))
    issues = check_ops(model)
    assert [(i.rule, i.severity) for i in issues] == [("op", "error")]
    assert "Loop" in issues[0].message
    assert "Loop" not in OPS and "Scan" not in OPS and "If" not in OPS
    assert not check_model(tmp_path / "loop.onnx").ok
