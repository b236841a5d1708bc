"""A set of files published as a whole (write_files_atomic) and one run per folder
(folder_lock): never half a set, never a file that appeared meanwhile replaced without leave."""

import errno
import os

import pytest

from fp8export.errors import Fp8ExportError
from fp8export.io import atomic
from fp8export.io.atomic import folder_lock, write_files_atomic


def _listing(folder):
    return sorted(p.name for p in folder.iterdir())


def test_all_files_published(tmp_path):
    write_files_atomic({tmp_path / "a": b"1", tmp_path / "b": b"2"}, replace=False)
    assert (tmp_path / "a").read_bytes() == b"1" and (tmp_path / "b").read_bytes() == b"2"
    assert _listing(tmp_path) == ["a", "b"]


def test_a_file_that_appeared_is_kept_and_nothing_is_written(tmp_path):
    (tmp_path / "b").write_bytes(b"mine")
    with pytest.raises(Fp8ExportError, match=r"b: appeared while fp8export was working.*--force"):
        write_files_atomic({tmp_path / "a": b"1", tmp_path / "b": b"2", tmp_path / "c": b"3"},
                           replace=False)
    assert (tmp_path / "b").read_bytes() == b"mine"
    assert _listing(tmp_path) == ["b"]  # "a", placed first, was taken back; no temporaries


def test_replace_swaps_the_whole_set(tmp_path):
    for name in "ab":
        (tmp_path / name).write_bytes(b"old")
    write_files_atomic({tmp_path / "a": b"new-a", tmp_path / "b": b"new-b"}, replace=True)
    assert [(tmp_path / n).read_bytes() for n in "ab"] == [b"new-a", b"new-b"]
    assert _listing(tmp_path) == ["a", "b"]


def test_full_disk_while_staging_leaves_the_earlier_set(tmp_path, monkeypatch):
    for name in "abc":
        (tmp_path / name).write_bytes(b"earlier " + name.encode())
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    with pytest.raises(Fp8ExportError, match="No space left.*nothing was written.*unchanged"):
        write_files_atomic({tmp_path / n: b"new" for n in "abc"}, replace=True)
    assert [(tmp_path / n).read_bytes() for n in "abc"] == [b"earlier a", b"earlier b",
                                                            b"earlier c"]
    assert _listing(tmp_path) == ["a", "b", "c"]


def test_failure_while_placing_restores_the_earlier_set(tmp_path, monkeypatch):
    for name in "abc":
        (tmp_path / name).write_bytes(b"earlier " + name.encode())
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(Fp8ExportError, match="c: cannot put"):
        write_files_atomic({tmp_path / n: b"new" for n in "abc"}, replace=True)
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    assert [(tmp_path / n).read_bytes() for n in "abc"] == [b"earlier a", b"earlier b",
                                                            b"earlier c"]
    assert _listing(tmp_path) == ["a", "b", "c"]


def test_a_second_holder_of_the_folder_is_refused(tmp_path):
    with folder_lock(tmp_path, "a verify report"):
        with pytest.raises(Fp8ExportError, match="another fp8export run is writing a verify "
                                                 "report there"):
            with folder_lock(tmp_path, "a verify report"):
                pass
    with folder_lock(tmp_path, "a verify report"):  # released: free again
        pass
    assert _listing(tmp_path) == []  # no lock file left
