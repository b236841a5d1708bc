"""The guarded opener and JSON parser every input read goes through."""

from __future__ import annotations

import os
import time

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import (
    CONFIG,
    FileKind,
    copy_input,
    json_depth,
    open_input,
    parse_json,
    read_input,
    read_json,
)


def test_regular_file_inside_the_folder_is_read(tmp_path):
    (tmp_path / "config.json").write_text('{"a": [1, 2, {"b": null}]}')
    assert read_json(tmp_path / "config.json", CONFIG, root=tmp_path) == {"a": [1, 2, {"b": None}]}


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(Fp8ExportError, match="FIFO"):
        read_input(fifo, CONFIG, root=tmp_path)
    assert time.monotonic() - start < 5  # an unguarded open() of a FIFO blocks for ever


def test_device_is_refused(tmp_path):
    # no root: the user named the path themselves, it must still be a regular file
    with pytest.raises(Fp8ExportError, match="character device"):
        read_input("/dev/zero", CONFIG)


def test_link_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (tmp_path / "secret.json").write_text("{}")
    (folder / "config.json").symlink_to(tmp_path / "secret.json")
    (folder / "zero.json").symlink_to("/dev/zero")
    for name in ("config.json", "zero.json"):
        with pytest.raises(Fp8ExportError, match="outside"):
            read_input(folder / name, CONFIG, root=folder)


def test_link_inside_the_folder_is_followed(tmp_path):
    (tmp_path / "real.json").write_text("[]")
    (tmp_path / "config.json").symlink_to("real.json")
    assert read_json(tmp_path / "config.json", CONFIG, root=tmp_path) == []


def test_size_cap_checked_before_reading(tmp_path):
    big = tmp_path / "config.json"
    with open(big, "wb") as f:
        f.truncate(CONFIG.max_bytes + 1)  # sparse: nothing is really stored
    with pytest.raises(Fp8ExportError, match="limit"):
        read_input(big, CONFIG, root=tmp_path)
    small = FileKind("thing", 4)
    (tmp_path / "five").write_bytes(b"12345")
    with pytest.raises(Fp8ExportError, match="thing"):
        open_input(tmp_path / "five", small)


def test_copy_does_not_follow_a_planted_link(tmp_path):
    (tmp_path / "src.json").write_text("{}")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "dest.json").symlink_to(victim)
    with pytest.raises(FileExistsError):
        copy_input(tmp_path / "src.json", tmp_path / "dest.json", CONFIG, root=tmp_path)
    assert victim.read_text() == "keep"


@pytest.mark.parametrize("raw, message", [
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    (b'{"a": ' + b"9" * 5000 + b"}", "5000 digits"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": -Infinity}', "Infinity"),
    (b'{"a": 1', "not valid JSON"),
    (b'\xff\xfe{}', "not UTF-8"),
])
def test_hostile_json_is_one_clear_error(raw, message):
    with pytest.raises(Fp8ExportError, match=message) as err:
        parse_json(raw, "x.json")
    assert str(err.value).startswith("x.json:")


def test_real_json_passes_the_limits():
    # tokenizer configs carry int(1e30); brackets inside strings are not nesting
    doc = parse_json(b'{"model_max_length": 1000000000000000019884624838656, '
                     b'"s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',
                     "tokenizer_config.json")
    assert doc["model_max_length"] == int(1e30)


def test_depth_scan_is_linear_on_hostile_strings():
    # many unterminated-looking escapes: a naive string regex rescans to the end each time
    raw = b"[" * 200 + b'"\\"' * 2_000_000
    start = time.monotonic()
    assert json_depth(raw) == 200
    assert time.monotonic() - start < 10
