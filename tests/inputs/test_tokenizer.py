"""The tokenizer is loaded from a private copy made through the guarded opener, and runs in a
child process."""

from __future__ import annotations

import json
import shutil

import pytest
from calib_fixtures import build_tokenizer

from fp8export.errors import Fp8ExportError
from fp8export.inputs.samples import load_samples
from fp8export.inputs.tokenizer import has_tokenizer, open_tokenizer


@pytest.fixture()
def folder(tmp_path):
    build_tokenizer(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _ids(folder, text):
    with open_tokenizer(folder) as tok:
        return tok.encode([text], "a test")[0]


def test_loads_the_folders_tokenizer(folder):
    with open_tokenizer(folder) as tok:
        assert tok.encode(["the cat", "cat"], "a test") == [[2, 4, 5], [2, 5]]
        assert tok.decode([[4, 5]], "a test") == ["the cat"]
        child = tok.pid
        assert child and child != __import__("os").getpid()
    assert has_tokenizer(folder)


def test_file_names_inside_tokenizer_config_are_not_followed(folder, tmp_path):
    """tokenizer_config.json may name ``tokenizer_file`` / ``vocab_file`` anywhere; a loader
    that honours it reads outside the checkpoint. The folder's own tokenizer.json is used."""
    other = tmp_path / "other"
    build_tokenizer(other, drop="aeiou")  # another vocabulary: vowels normalised away
    _edit(folder / "tokenizer_config.json", tokenizer_file=str(other / "tokenizer.json"),
          vocab_file="/dev/zero")
    calib = tmp_path / "calib.txt"
    calib.write_text("the cat sat\n")
    samples = load_samples(calib, folder)
    assert samples.input_ids == ((2, 4, 5, 6),)


def test_tokenizer_that_exists_only_as_code_is_refused(folder, tmp_path):
    marker = tmp_path / "PWNED"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    _edit(folder / "tokenizer_config.json", tokenizer_class="EvilTokenizerFast",
          auto_map={"AutoTokenizer": [None, "evil.EvilTokenizerFast"]})
    with pytest.raises(Fp8ExportError) as err:
        open_tokenizer(folder)
    assert "tokenizer_config.json: 'auto_map' entry 'AutoTokenizer'" in str(err.value)
    assert not marker.exists()


def test_auto_map_beside_a_builtin_class_is_not_imported(folder, tmp_path):
    marker = tmp_path / "PWNED"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    _edit(folder / "tokenizer_config.json",
          auto_map={"AutoTokenizer": [None, "evil.EvilTokenizerFast"]})
    assert _ids(folder, "the") == [2, 4]
    assert not marker.exists()


def test_tokenizer_files_that_are_not_regular_files_are_refused(folder):
    import os

    (folder / "special_tokens_map.json").unlink(missing_ok=True)
    os.mkfifo(folder / "special_tokens_map.json")
    with pytest.raises(Fp8ExportError, match="special_tokens_map.json.*FIFO"):
        open_tokenizer(folder)


def test_tokenizer_json_linked_out_of_the_folder_is_refused(folder, tmp_path):
    shutil.move(folder / "tokenizer.json", tmp_path / "elsewhere.json")
    (folder / "tokenizer.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(Fp8ExportError, match="tokenizer.json.*outside"):
        open_tokenizer(folder)


def test_hostile_json_in_a_tokenizer_file(folder):
    (folder / "special_tokens_map.json").write_bytes(b"[" * 10_000 + b"]" * 10_000)
    with pytest.raises(Fp8ExportError, match="special_tokens_map.json.*nests deeper"):
        open_tokenizer(folder)
