"""The tokenizer runs in a child process: a memory bomb, an endless match or a panic there ends
in one Fp8ExportError, and the command goes on (or stops cleanly).

Each case bypasses the static rules (it calls TokenizerProcess on a private folder directly)
to show the limits hold for what no rule foresees.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from calib_fixtures import build_tokenizer

from fp8export.errors import Fp8ExportError
from fp8export.inputs import tokenizer_process
from fp8export.inputs.tokenizer_process import TokenizerProcess

REPLACE = {"type": "Replace", "pattern": {"String": "t"}, "content": "t" * 1000}


def _private(tmp_path, **components):
    folder = tmp_path / "tok"
    build_tokenizer(folder)
    doc = json.loads((folder / "tokenizer.json").read_text())
    doc.update(components)
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    return folder


def test_encode_decode_and_facts(tmp_path):
    with TokenizerProcess(_private(tmp_path), "tok") as tok:
        assert tok.pid and tok.pid != os.getpid()
        assert tok.encode(["the cat", "", "cat"], "a test") == [[2, 4, 5], [2], [2, 5]]
        assert tok.decode([[4, 5], []], "a test") == ["the cat", ""]
        assert tok.facts == {"ok": True, "num_special": 1, "pad_token_id": 0,
                             "eos_token_id": 3}
        pid = tok.pid
    tokenizer_process._reap(wait=True)  # it exits on its own once its pipe closes
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_a_memory_bomb_ends_the_child_not_the_command(tmp_path, capfd):
    folder = _private(tmp_path, normalizer={"type": "Sequence",
                                            "normalizers": [REPLACE, REPLACE, REPLACE]})
    start = time.monotonic()
    with pytest.raises(Fp8ExportError, match="tok: the tokenizer was stopped by SIG.*memory "
                                             "limit 0.2 GiB.* while tokenising line 1"):
        with TokenizerProcess(folder, "tok", memory_bytes=256 << 20) as tok:
            tok.encode(["the cat"], "tokenising line 1")
    assert time.monotonic() - start < 60
    out, err = capfd.readouterr()
    assert "backtrace" not in err and "memory allocation" not in err  # the child is quiet


def test_an_endless_match_is_stopped_by_the_cpu_limit(tmp_path):
    folder = _private(tmp_path, model={"type": "WordPiece", "unk_token": "<unk>",
                                       "continuing_subword_prefix": "##",
                                       "max_input_chars_per_word": 1 << 20,
                                       "vocab": {"<pad>": 0, "<unk>": 1, "a": 2, "##a": 3}},
                      pre_tokenizer={"type": "WhitespaceSplit"})
    start = time.monotonic()
    with pytest.raises(Fp8ExportError, match="ran longer than its limit \\(2 s of CPU time"):
        with TokenizerProcess(folder, "tok", seconds=2) as tok:
            tok.encode(["a" * 20000 + "b"], "a test")  # ~3 minutes of WordPiece unguarded
    assert time.monotonic() - start < 30


def test_a_panic_comes_back_as_a_message(tmp_path):
    folder = _private(tmp_path, pre_tokenizer={
        "type": "Split", "pattern": {"Regex": "([a-zA-Z ]+)+$"}, "behavior": "Isolated",
        "invert": False})
    with TokenizerProcess(folder, "tok") as tok:
        with pytest.raises(Fp8ExportError, match="failed while a test \\(PanicException: "
                                                 "Onig.*retry-limit"):
            tok.encode(["t" * 40 + "!"], "a test")


def test_a_tokenizer_that_does_not_load_is_one_message(tmp_path):
    folder = _private(tmp_path, model={"type": "NoSuchModel"})
    tok = TokenizerProcess(folder, "tok")  # loads in the background: fails on first use
    with pytest.raises(Fp8ExportError, match="failed while loading it"):
        tok.encode(["hello"], "encoding a line")
    assert tok.pid == 0  # the child is gone, reaped


def test_open_tokenizer_returns_at_once_and_removes_its_private_copy(tmp_path, monkeypatch):
    """The child loads while the caller goes on (verify loads its models meanwhile); the
    private copy it loads from is gone once it has loaded, and on close in any case."""
    from fp8export.inputs.tokenizer import open_tokenizer

    build_tokenizer(tmp_path / "model")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    tok = open_tokenizer(tmp_path / "model")
    with tok:
        assert tok._facts is None  # not waited for
        assert tok.encode(["the cat"], "a test") == [[2, 4, 5]]
        assert list((tmp_path / "tmp").iterdir()) == []
    never_used = open_tokenizer(tmp_path / "model")
    never_used.close()
    assert list((tmp_path / "tmp").iterdir()) == []
