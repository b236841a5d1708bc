"""The table-lookup convert path writes exactly the bytes of the torch quantizer, with and
without its C helper, on real files (scripts/hash_outputs.py checks the whole sample set)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from fp8export.api import convert
from fp8export.convert.config import ConvertConfig
from fp8export.numerics.fp8 import quantize_e4m3

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama" / "model"


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def test_written_fp8_bytes_are_the_torch_quantizers(tmp_path):
    out = tmp_path / "o"
    res = convert(ConvertConfig(checkpoint=SAMPLE, output=out))
    with safe_open(str(SAMPLE / "model.safetensors"), framework="pt") as src, \
            safe_open(str(out / "model.safetensors"), framework="pt") as dst:
        for row in res.layers:
            w = src.get_tensor(row["weight"])
            assert w.dtype == torch.bfloat16
            scale = dst.get_tensor(row["module"] + ".weight_scale").reshape(())
            want = quantize_e4m3(w, np.float32(scale.item())).view(torch.uint8)
            got = dst.get_tensor(row["weight"]).view(torch.uint8)
            assert torch.equal(got, want), row["weight"]


def test_the_numpy_fallback_writes_the_same_files(tmp_path):
    """FP8EXPORT_NO_C=1: the C helper is not loaded; every file is the same."""
    code = ("import sys; from fp8export.api import convert; from "
            "fp8export.convert.config import ConvertConfig; from fp8export.numerics import lut; "
            "assert not lut.compiled(); "
            "convert(ConvertConfig(checkpoint=sys.argv[1], output=sys.argv[2]))")
    runs = {}
    for name, env in (("c", {}), ("numpy", {"FP8EXPORT_NO_C": "1"})):
        out = tmp_path / name
        if env:
            subprocess.run([sys.executable, "-c", code, str(SAMPLE), str(out)], check=True,
                           env={**os.environ, **env}, capture_output=True)
        else:
            convert(ConvertConfig(checkpoint=SAMPLE, output=out))
        runs[name] = _hashes(out)
    assert runs["c"] == runs["numpy"] and "model.safetensors" in runs["c"]


def test_the_general_writer_gives_the_same_files(tmp_path, monkeypatch):
    """The one-tensor-at-a-time writer (torch tensors, the path per-channel and KV-cache
    conversions take) and the parallel table path agree byte for byte, manifest included."""
    import fp8export.convert.pipeline as pipeline

    convert(ConvertConfig(checkpoint=SAMPLE, output=tmp_path / "fast"))
    monkeypatch.setattr(pipeline, "fast_path_files", lambda ckpt: None)
    convert(ConvertConfig(checkpoint=SAMPLE, output=tmp_path / "general"))
    assert _hashes(tmp_path / "fast") == _hashes(tmp_path / "general")


@pytest.mark.parametrize("ckpt,workers,granularity", [
    ("tiny_llama", 1, "tensor"), ("tiny_llama_sharded", 2, "tensor"),
    ("tiny_llama_sharded", 1, "channel")])
def test_manifest_output_hashes_are_those_of_the_files_on_disk(request, tmp_path, ckpt, workers,
                                                                granularity):
    # The shards' sha256 is computed while writing (out of order on the parallel path, in
    # order on the general one for per-channel scales), never by reading them back.
    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=request.getfixturevalue(ckpt), output=out,
                          workers=workers,
                          weight_granularity=granularity))
    man = json.loads((out / "fp8export.json").read_text())
    listed = {e["name"]: e["sha256"] for e in man["files"]}
    on_disk = {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in out.rglob("*") if p.is_file() and p.name != "fp8export.json"}
    assert listed == on_disk
