"""Atomic output folders: a failure leaves nothing, not even the parent folders made for them."""

from __future__ import annotations

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.io.atomic import AtomicDir, make_folders, remove_folders


def test_make_folders_returns_what_it_created_and_remove_takes_it_back(tmp_path):
    (tmp_path / "a").mkdir()
    created = make_folders(tmp_path / "a" / "b" / "c")
    assert created == [tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    (tmp_path / "a" / "b" / "theirs.txt").write_text("written meanwhile")
    remove_folders(created)  # c goes; b holds someone's file and stays
    assert sorted(p.name for p in (tmp_path / "a").rglob("*")) == ["b", "theirs.txt"]
    assert make_folders(tmp_path / "a") == []


def test_a_failed_output_leaves_no_parent_folder(tmp_path):
    out = tmp_path / "new" / "deeper" / "model-fp8"
    with pytest.raises(Fp8ExportError, match="disk full"):
        with AtomicDir(out, marker="fp8export.json") as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise Fp8ExportError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_a_published_output_keeps_its_parents(tmp_path):
    out = tmp_path / "new" / "model-fp8"
    atomic = AtomicDir(out, marker="fp8export.json")
    with atomic as tmp:
        (tmp / "fp8export.json").write_text("{}")
        atomic.publish()
    assert (out / "fp8export.json").is_file()
