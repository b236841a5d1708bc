"""Writing outputs: never into (or over) an input, only regular files and our own folders
replaced, random temp names not followed, OSError as an error."""

from __future__ import annotations

import os

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.io.atomic import AtomicDir, write_file_atomic
from fp8export.io.outputs import (
    check_file_target,
    check_folder_target,
    claim_output_file,
    probe_writable,
    refuse_inside_input,
    refuse_overlap,
)


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


def test_an_output_that_is_an_input_or_holds_one_is_refused(tmp_path):
    data = tmp_path / "mydata.txt"
    data.write_text("x\n")
    with pytest.raises(Fp8ExportError, match="is the input .*mydata.txt"):
        refuse_overlap(data, [tmp_path / "ckpt", data])
    (tmp_path / "out").mkdir()
    inside = tmp_path / "out" / "calib.txt"
    inside.write_text("x\n")
    with pytest.raises(Fp8ExportError, match="contains the input .*calib.txt"):
        refuse_overlap(tmp_path / "out", [inside])
    link = tmp_path / "hard.txt"
    os.link(data, link)  # a hard link is the same file under another name
    with pytest.raises(Fp8ExportError, match="is the input"):
        refuse_overlap(link, [data])
    refuse_overlap(tmp_path / "other.json", [data, None, tmp_path / "out"])


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_only_regular_files_are_replaced_even_with_force(tmp_path, kind):
    target = tmp_path / "dev.json"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        (tmp_path / "real.json").write_text("keep")
        target.symlink_to(tmp_path / "real.json")
    else:
        target.mkdir()
    with pytest.raises(Fp8ExportError, match="FIFO|symbolic link|folder"):
        check_file_target(target, True)
    with pytest.raises(Fp8ExportError, match="FIFO|symbolic link|folder|regular files"):
        write_file_atomic(target, b"{}")  # the writer refuses too, at replace time
    assert os.path.lexists(target)
    if kind == "symlink":
        assert (tmp_path / "real.json").read_text() == "keep"


def test_a_character_device_is_never_replaced(tmp_path):
    with pytest.raises(Fp8ExportError, match="character device"):
        claim_output_file("/dev/null", inputs=[], force=True)


def test_a_regular_file_needs_force(tmp_path):
    target = tmp_path / "amax.json"
    target.write_text("old")
    with pytest.raises(Fp8ExportError, match="--force"):
        check_file_target(target, False)
    check_file_target(target, True)


def test_force_replaces_only_our_folders_or_empty_ones(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "important.txt").write_text("keep")
    (precious / "notes.md").write_text("keep")
    with pytest.raises(Fp8ExportError, match=r"did not write \(important.txt, notes.md\)"):
        check_folder_target(precious, True, "fp8export.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    check_folder_target(empty, True, "fp8export.json")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "fp8export.json").write_text("{}")
    check_folder_target(ours, True, "fp8export.json")
    with pytest.raises(Fp8ExportError, match="--force"):
        check_folder_target(ours, False, "fp8export.json")


def test_the_folder_writer_checks_again_when_it_publishes(tmp_path):
    target = tmp_path / "out"
    atomic = AtomicDir(target, True, marker="fp8export.json")
    with atomic as tmp:
        (tmp / "fp8export.json").write_text("{}")
        target.mkdir()  # someone's folder appeared while we worked
        (target / "theirs.txt").write_text("keep")
        with pytest.raises(Fp8ExportError, match="did not write"):
            atomic.publish()
    assert (target / "theirs.txt").read_text() == "keep"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
