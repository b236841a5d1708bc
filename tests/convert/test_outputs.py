"""Writing outputs: never into the input, random temp names not followed, OSError as an error."""

from __future__ import annotations

import os

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.io.atomic import probe_writable, refuse_inside_input, write_file_atomic


def test_temporary_name_is_random_and_a_planted_link_is_not_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    # the old predictable name: .<name>.tmp-<pid>
    (tmp_path / f".amax.json.tmp-{os.getpid()}").symlink_to(victim)
    write_file_atomic(tmp_path / "amax.json", b"new")
    assert (tmp_path / "amax.json").read_bytes() == b"new"
    assert victim.read_text() == "keep"
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"victim", "amax.json", f".amax.json.tmp-{os.getpid()}"}


def test_unwritable_location_is_one_error_and_leaves_nothing(tmp_path):
    target = tmp_path / "missing-folder" / "out.json"
    with pytest.raises(Fp8ExportError, match="out.json: cannot write the file"):
        write_file_atomic(target, b"x")
    with pytest.raises(Fp8ExportError, match="cannot write there"):
        probe_writable(f"/proc/fp8export-test-{os.getpid()}.json")
    assert not list(tmp_path.iterdir())


def test_probe_leaves_nothing_behind(tmp_path):
    probe_writable(tmp_path / "a" / "b" / "report")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("output", ["ckpt", "ckpt/amax.json", "ckpt/sub/x", "."])
def test_outputs_inside_a_folder_input_are_refused(tmp_path, output):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(Fp8ExportError, match="never writes into its input"):
        refuse_inside_input(tmp_path / output, tmp_path / "ckpt")


@pytest.mark.parametrize("output, refused", [
    ("model.safetensors", True), ("config.json", True), ("tokenizer.json", True),
    ("model.onnx", True), ("model.onnx.data", True), ("amax.json", False),
    ("model.engine", False)])
def test_outputs_beside_a_file_input(tmp_path, output, refused):
    for name in ("model.safetensors", "model.onnx"):
        (tmp_path / name).write_bytes(b"")
    source = tmp_path / ("model.onnx" if "onnx" in output or "engine" in output
                         else "model.safetensors")
    if refused:
        with pytest.raises(Fp8ExportError, match="never writes into its input"):
            refuse_inside_input(tmp_path / output, source)
    else:
        refuse_inside_input(tmp_path / output, source)


def test_a_link_to_the_input_is_seen_through(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "ckpt")
    with pytest.raises(Fp8ExportError):
        refuse_inside_input(tmp_path / "alias" / "amax.json", tmp_path / "ckpt")
