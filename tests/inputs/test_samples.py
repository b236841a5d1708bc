"""Data loaders: the four formats, truncation, batching, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.inputs.samples import iter_batches, load_samples


@pytest.fixture(scope="module")
def tok_dir(tiny_llama):
    return tiny_llama


def _tok(tok_dir, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)(text)["input_ids"]


def test_txt_skips_blank_lines_and_uses_checkpoint_tokenizer(tok_dir, tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("the cat sat\n\n   \na dog ran far away\n", encoding="utf-8")
    s = load_samples(p, tok_dir)
    assert len(s) == 2
    assert list(s.input_ids[0]) == _tok(tok_dir, "the cat sat")
    assert s.pad_id == 0 and s.labels is None


def test_jsonl_text_and_labels(tok_dir, tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(json.dumps({"text": t, "label": i}) for i, t in
                           enumerate(["the cat", "a dog ran"])) + "\n", encoding="utf-8")
    s = load_samples(p, tok_dir)
    assert [list(x) for x in s.input_ids] == [_tok(tok_dir, "the cat"), _tok(tok_dir, "a dog ran")]
    assert s.labels == (0, 1)
    b = next(iter_batches(s, 2))
    assert b.labels.tolist() == [0, 1]


def test_npz_with_mask_and_safetensors(tmp_path):
    ids = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    np.savez(tmp_path / "a.npz", input_ids=ids, attention_mask=mask,
             labels=np.array([[1, 2, 3, 0], [4, 5, 0, 0]]))
    s = load_samples(tmp_path / "a.npz", None)
    assert s.input_ids == ((5, 6, 7), (8, 9))
    assert s.labels == ((1, 2, 3), (4, 5))
    b = next(iter_batches(s, 2))
    assert b.labels.tolist() == [[1, 2, 3], [4, 5, -100]]

    from safetensors.numpy import save_file

    save_file({"input_ids": ids[:, :3].astype(np.int32)}, str(tmp_path / "a.safetensors"))
    s2 = load_samples(tmp_path / "a.safetensors", None)
    assert s2.input_ids == ((5, 6, 7), (8, 9, 0))  # no mask: every position counts


def test_truncation_to_min_of_seq_len_and_positions_with_notice(tok_dir, tmp_path, capsys):
    p = tmp_path / "a.txt"
    p.write_text("the cat sat on a mat and dog ran far away\nthe cat\n", encoding="utf-8")
    s = load_samples(p, tok_dir, seq_len=8, max_positions=5)
    assert [len(x) for x in s.input_ids] == [5, 3]
    assert s.truncated == 1 and s.max_len == 5
    assert "truncated" in capsys.readouterr().err


def test_max_samples_and_batches_right_padded_in_order(tok_dir, tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("\n".join(["the cat", "a dog ran far", "the", "red house"]) + "\n")
    s = load_samples(p, tok_dir, max_samples=3)
    assert len(s) == 3
    batches = list(iter_batches(s, 2))
    assert [b.indices for b in batches] == [(0, 1), (2,)]
    b = batches[0]
    assert b.input_ids.dtype == torch.int64 and b.attention_mask.dtype == torch.int64
    n0 = len(s.input_ids[0])
    assert b.attention_mask[0].tolist() == [1] * n0 + [0] * (b.input_ids.shape[1] - n0)
    assert b.input_ids[0, n0:].eq(s.pad_id).all()
    # deterministic: same file, same batches
    again = list(iter_batches(load_samples(p, tok_dir, max_samples=3), 2))
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(batches, again))


@pytest.mark.parametrize("name,content,match", [
    ("missing.txt", None, "no such data file"),
    ("empty.txt", b"", "empty"),
    ("blank.txt", b"\n  \n\n", "no samples"),
    ("binary.txt", b"PK\x03\x04\x00\x00binary", "binary"),
    ("latin1.txt", "caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ("bad.jsonl", b'{"txt": "x"}\n', "'text' field"),
    ("bad2.jsonl", b'{not json\n', "not valid JSON"),
    ("a.csv", b"x\n", "unknown data format"),
    ("bad.npz", b"not a zip", "cannot read"),
])
def test_bad_inputs_name_the_file(tok_dir, tmp_path, name, content, match):
    p = tmp_path / name
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(Fp8ExportError, match=match) as e:
        load_samples(p, tok_dir)
    assert str(p) in str(e.value)


def test_npz_without_input_ids(tmp_path):
    np.savez(tmp_path / "x.npz", tokens=np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(Fp8ExportError, match="no 'input_ids'.*found: \\['tokens'\\]"):
        load_samples(tmp_path / "x.npz", None)


def test_text_that_tokenises_to_nothing(tmp_path):
    from calib_fixtures import build_tokenizer

    tdir = tmp_path / "tok"
    build_tokenizer(tdir, drop="#")  # the normaliser deletes '#': such lines give only <s>
    p = tmp_path / "x.txt"
    p.write_text("###\n# ##\n", encoding="utf-8")
    with pytest.raises(Fp8ExportError, match="tokenises to nothing"):
        load_samples(p, tdir)
    p.write_text("###\nthe cat\n", encoding="utf-8")
    assert len(load_samples(p, tdir)) == 1  # the empty line is skipped with a notice


def test_text_without_tokenizer(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("hello\n")
    with pytest.raises(Fp8ExportError, match="tokenizer"):
        load_samples(p, None)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(Fp8ExportError, match="no tokenizer files"):
        load_samples(p, tmp_path / "ckpt")
