"""verify's provenance hashes only what verify reads, bounded by what the files describe."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corrupt"))
from corpus_files import hf_folder, onnx_model  # noqa: E402

from fp8export.verify.provenance import content_hash, edited_files, files_read  # noqa: E402

SPARSE = 200 << 30  # 200 GB: hours to hash, no disk used


def _sparse(path: Path, size: int = SPARSE) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_only_the_files_verify_reads_are_hashed(tmp_path):
    ref = hf_folder(tmp_path / "ref")
    (ref / "tokenizer.json").write_text("{}")
    _sparse(ref / "generation_config.json")  # a loader file verify never opens
    _sparse(ref / "tokenizer.model", (256 << 20) + 1)  # beyond what the tokenizer reader opens
    files, skipped = files_read(ref)
    assert [p.name for p in files] == ["config.json", "model.safetensors", "tokenizer.json"]
    assert {"generation_config.json", "tokenizer.model"} <= set(skipped)
    # the candidate's tokenizer is not read (verify tokenises with the reference's)
    assert [p.name for p in files_read(ref, tokenizer=False)[0]] == ["config.json",
                                                                     "model.safetensors"]


def test_external_data_is_hashed_only_as_far_as_the_graph_reads_it(tmp_path):
    import onnx

    plain = onnx_model(tmp_path / "plain.onnx")
    _sparse(tmp_path / "plain.onnx.data")  # beside a graph that has no external data
    assert files_read(plain)[0] == [plain]

    model = onnx.load(str(plain))
    ext = tmp_path / "ext.onnx"
    onnx.save_model(model, str(ext), save_as_external_data=True, location="ext.onnx.data",
                    size_threshold=0)
    data = tmp_path / "ext.onnx.data"
    assert files_read(ext)[0] == [ext, data]
    h = content_hash(ext)
    assert [f["name"] for f in h["files"]] == ["ext.onnx", "ext.onnx.data"]
    _sparse(data, data.stat().st_size + SPARSE)  # the graph reads the first KBs only
    assert files_read(ext)[0] == [ext]


def test_listed_files_verify_does_not_read_are_compared_by_size(tmp_path):
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text("{}")
    (fp8 / "notes.bin").write_bytes(np.arange(8, dtype=np.uint8).tobytes())
    listed = [{"name": "config.json", "sha256": hashlib.sha256(b"{}").hexdigest(), "bytes": 2},
              {"name": "notes.bin", "sha256": "0" * 64, "bytes": 8},
              {"name": "huge.bin", "sha256": "0" * 64, "bytes": SPARSE}]
    (fp8 / "fp8export.json").write_text(json.dumps({"files": listed}))
    _sparse(fp8 / "huge.bin")
    assert [p.name for p in files_read(fp8)[0]] == ["config.json", "fp8export.json"]
    files = content_hash(fp8)["files"]  # not the two listed files: verify reads neither
    assert edited_files(fp8, files) == []
    (fp8 / "notes.bin").write_bytes(b"longer than it was")
    (fp8 / "huge.bin").unlink()
    (fp8 / "config.json").write_text('{"edited": 1}')
    assert edited_files(fp8, content_hash(fp8)["files"]) == ["config.json", "huge.bin",
                                                             "notes.bin"]
