"""Data files are bounded: line length, sample count, token ids, labels, .npz headers."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest

from fp8export.errors import Fp8ExportError
from fp8export.inputs import samples as samples_mod
from fp8export.inputs.samples import load_samples


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_a_line_longer_than_the_limit_is_refused_before_tokenising(tmp_path, tiny_llama):
    p = tmp_path / "calib.txt"
    p.write_text("the cat\n" + "cat " * (samples_mod.MAX_LINE_BYTES // 4 + 1) + "\n")
    with pytest.raises(Fp8ExportError, match=r"calib.txt:2: the line is longer than"):
        load_samples(p, tiny_llama)


def test_only_the_samples_needed_are_read(tmp_path, tiny_llama):
    p = tmp_path / "calib.txt"
    p.write_text("the cat\nthe dog\n" + "\x00binary tail\n")  # never reached
    assert len(load_samples(p, tiny_llama, max_samples=2)) == 2


def test_sample_count_is_bounded(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setattr(samples_mod, "MAX_SAMPLES", 3)
    p = tmp_path / "calib.txt"
    p.write_text("the cat\n" * 5)
    with pytest.raises(Fp8ExportError, match="more than 3 samples"):
        load_samples(p, tiny_llama)
    with pytest.raises(Fp8ExportError, match="more than 3 samples"):
        load_samples(_npz(tmp_path / "d.npz", input_ids=np.ones((5, 4), np.int64)), tiny_llama)


@pytest.mark.parametrize("ids, match", [(64, "token id 64"), (-1, "token id -1"),
                                        (2**62, "token id")])
def test_token_ids_outside_the_vocabulary(tmp_path, ids, match):
    p = _npz(tmp_path / "d.npz", input_ids=np.full((2, 4), ids, dtype=np.int64))
    with pytest.raises(Fp8ExportError, match=match):
        load_samples(p, None, vocab_size=64)


def test_masked_positions_may_hold_anything(tmp_path):
    ids = np.array([[5, 6, -1, -1]], dtype=np.int64)
    p = _npz(tmp_path / "d.npz", input_ids=ids, attention_mask=np.array([[1, 1, 0, 0]]))
    assert load_samples(p, None, vocab_size=64).input_ids == ((5, 6),)


def test_tokenizer_larger_than_the_model(tmp_path, tiny_llama):
    p = tmp_path / "calib.txt"
    p.write_text("the cat sat\n")
    with pytest.raises(Fp8ExportError, match="tokenizer does not match the model"):
        load_samples(p, tiny_llama, vocab_size=4)


def test_labels_are_bounded(tmp_path, tiny_llama):
    p = tmp_path / "eval.jsonl"
    p.write_text(json.dumps({"text": "the cat", "label": 10**30}) + "\n")
    with pytest.raises(Fp8ExportError, match="label"):
        load_samples(p, tiny_llama)
    p.write_text(json.dumps({"text": "the cat", "label": 3}) + "\n")
    with pytest.raises(Fp8ExportError, match=r"label 3, outside \[0, 2\)"):
        load_samples(p, tiny_llama, num_labels=2)
    tok = _npz(tmp_path / "d.npz", input_ids=np.ones((1, 4), np.int64),
               labels=np.full((1, 4), 2**40, np.int64))
    with pytest.raises(Fp8ExportError, match="per-token label"):
        load_samples(tok, None, vocab_size=64)
    ok = _npz(tmp_path / "e.npz", input_ids=np.ones((1, 4), np.int64),
              labels=np.array([[5, -100, 7, -100]]))
    assert load_samples(ok, None, vocab_size=64).labels == ((5, -100, 7, -100),)


def test_npz_header_is_checked_against_its_bytes(tmp_path):
    """A header declaring 10^10 ids over 64 bytes: np.load would allocate 80 GB first."""
    from numpy.lib import format as npy

    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False,
                                     "shape": (100_000, 100_000)})
    buf.write(np.ones(8, dtype=np.int64).tobytes())
    p = tmp_path / "d.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("input_ids.npy", buf.getvalue())
    with pytest.raises(Fp8ExportError, match=r"declares shape \(100000, 100000\)"):
        load_samples(p, None)


def test_npy_format_3_is_refused_by_name(tmp_path):
    """numpy writes format 3.0 only for structured dtypes with non-Latin-1 field names; token
    ids never need it, and numpy has no public reader of its header."""
    import struct

    header = b"{'descr': '<i8', 'fortran_order': False, 'shape': (1, 4), }"
    header += b" " * (-(len(header) + 13) % 64) + b"\n"
    member = b"\x93NUMPY\x03\x00" + struct.pack("<I", len(header)) + header
    p = tmp_path / "d.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("input_ids.npy", member + np.arange(4, dtype=np.int64).tobytes())
    with pytest.raises(Fp8ExportError, match=r"format version 3\.0"):
        load_samples(p, None)


def test_npz_member_declaring_a_bomb(tmp_path):
    p = tmp_path / "d.npz"
    buf = io.BytesIO()
    np.save(buf, np.zeros((8192, 1024), dtype=np.int64))  # 64 MiB of zeros, ~64 KiB deflated
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("input_ids.npy", buf.getvalue())
    with pytest.raises(Fp8ExportError, match="zip bomb"):
        load_samples(p, None)


def test_data_file_that_is_a_fifo(tmp_path):
    p = tmp_path / "calib.txt"
    os.mkfifo(p)
    with pytest.raises(Fp8ExportError, match="FIFO"):
        load_samples(p, None)


def test_safetensors_data_goes_through_the_validated_reader(tmp_path):
    import torch
    from safetensors.torch import save_file

    p = tmp_path / "d.safetensors"
    save_file({"input_ids": torch.ones(2, 4, dtype=torch.int64)}, str(p))
    assert len(load_samples(p, None, vocab_size=64)) == 2
    raw = bytearray(p.read_bytes())
    p.write_bytes(bytes(raw[:-8]))  # cut: the header now lies about the data
    with pytest.raises(Fp8ExportError, match="d.safetensors"):
        load_samples(p, None)
