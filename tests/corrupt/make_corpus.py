"""Build the corrupt/hostile-input corpus: every reader, every command, one net.

    python tests/corrupt/make_corpus.py OUT_DIR      # writes the files and OUT_DIR/cases.json

Nothing here is committed as a binary: every file is crafted byte by byte (or written by the
library that normally writes it, then damaged) at test time. Each :class:`Case` declares

* ``argv``     the fp8export command line (without the program name);
* ``exit``     the exit code the CLI contract requires (1 = bad input; 0 only for documented
               fallbacks such as an all-zero weight, which is kept in high precision);
* ``expect``   substrings the single ``Error:`` message must contain: the file (or tensor)
               name and the problem;
* ``marker``   a file the hostile payload would create if anything ever ran it (must never
               appear), or None;
* ``outputs``  paths that must not exist afterwards (the output folder / engine / report),
               checked together with hidden temporary siblings (``.<name>.tmp-*``).

Builders use only torch, safetensors, numpy, h5py and onnx (no Keras, no transformers), so
building the whole corpus takes a second or two.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import zipfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from corpus_files import (
    FFN,
    KERAS_CONFIG,
    LLAMA_CONFIG,
    REPO,
    TE_FIXTURES,
    Case,
    H,
    V,
    _WriteMarker,
    fp8_folder,
    hf_folder,
    keras_members,
    llama_tensors,
    onnx_model,
    raw_safetensors,
    sha256_file,
    sharded_folder,
    st_header,
    te_fixtures,
    tiny_h5,
    write_index,
    write_zip,
)
from safetensors.torch import save_file

# The helpers are re-exported: tests and reliability_helpers use make_corpus.<name>.
__all__ = ["BUILDERS", "Case", "build_corpus", "main", "FFN", "KERAS_CONFIG", "LLAMA_CONFIG",
           "REPO", "TE_FIXTURES", "V", "H", "fp8_folder", "hf_folder", "keras_members",
           "llama_tensors", "onnx_model", "raw_safetensors", "sha256_file", "sharded_folder",
           "st_header", "te_fixtures", "tiny_h5", "write_index", "write_zip"]


# ------------------------------------------------------------------------------- builders
# Each builder gets (root, case id) and returns a Case. The output of every convert goes to
# root/out/<id>, so "no output and no temporary sibling" is checked by listing root/out.

BUILDERS = []


def case(fn):
    BUILDERS.append(fn)
    return fn


def _convert(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", str(ckpt), "-o", str(out), *extra]


def _st_case(root, cid, path: Path, expect, note="", reader="safetensors", *, name=True):
    out = root / "out" / cid
    return Case(cid, reader, _convert(path, out), [path.name, *expect] if name else list(expect),
                outputs=[str(out)], note=note)


# --- safetensors: single files -----------------------------------------------------------
@case
def st_truncated(root, cid):
    p = root / cid
    hf_folder(p)
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(data[: len(data) // 2])
    return _st_case(root, cid, p, ["model.safetensors", "truncated"],
                    "valid file cut in the middle of its data area")


@case
def st_header_cut(root, cid):
    p = root / f"{cid}.safetensors"
    save_file(llama_tensors(), str(p))
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p.write_bytes(raw[: 8 + n // 2])
    return _st_case(root, cid, p, ["header"], "file ends inside the JSON header")


@case
def st_zero_bytes(root, cid):
    p = root / f"{cid}.safetensors"
    p.write_bytes(b"")
    return _st_case(root, cid, p, ["too small"], "empty file")


@case
def st_offsets_beyond_file(root, cid):
    p = root / f"{cid}.safetensors"
    raw_safetensors(p, {"model.layers.0.mlp.up_proj.weight": {
        "dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
        "x": {"dtype": "F32", "shape": [1000], "data_offsets": [64, 4064]}}, bytes(64))
    return _st_case(root, cid, p, ["'x'", "truncated"],
                    "header claims 4064 data bytes, file holds 64")


@case
def st_overlapping_offsets(root, cid):
    p = root / f"{cid}.safetensors"
    raw_safetensors(p, {"a.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
                        "b.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [32, 96]}},
                    bytes(96))
    return _st_case(root, cid, p, ["overlap"], "two tensors share bytes 32..64")


@case
def st_huge_declared_header(root, cid):
    p = root / f"{cid}.safetensors"
    raw_safetensors(p, None, header_bytes=b'{"a": {}}', declared=100 * 2**20)
    return _st_case(root, cid, p, ["header"], "8-byte prefix declares a 100 MiB header")


@case
def st_huge_real_header(root, cid):
    """A header that really is > 100 MB would need 100 MB on disk; a sparse file does it."""
    p = root / f"{cid}.safetensors"
    n = 100 * 2**20 + 17
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", n) + b'{"__metadata__": {"x": "')
        f.truncate(8 + n)  # sparse: the rest reads as NUL bytes, no disk used
    return _st_case(root, cid, p, ["header"], "a 100 MiB header really present (sparse file)")


@case
def st_shape_dtype_mismatch(root, cid):
    p = root / f"{cid}.safetensors"
    raw_safetensors(p, {"w.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}},
                    bytes(32))
    return _st_case(root, cid, p, ["w.weight", "need 64 bytes"],
                    "F32 [4, 4] needs 64 bytes, offsets give 32")


@case
def st_unknown_dtype(root, cid):
    p = root / f"{cid}.safetensors"
    raw_safetensors(p, {"w.weight": {"dtype": "F13", "shape": [4], "data_offsets": [0, 8]}},
                    bytes(8))
    return _st_case(root, cid, p, ["w.weight", "F13"], "a dtype no one defines")


@case
def st_header_not_json(root, cid):
    p = root / f"{cid}.safetensors"
    raw_safetensors(p, None, header_bytes=b"\xff\xfe not json at all \x00")
    return _st_case(root, cid, p, ["header"], "header bytes are not UTF-8 JSON")


@case
def st_duplicate_names_in_header(root, cid):
    p = root / f"{cid}.safetensors"
    spec = '{"dtype": "F32", "shape": [2, 2], "data_offsets": [%d, %d]}'
    h = ('{"w.weight": ' + spec % (0, 16) + ', "w.weight": ' + spec % (16, 32) + "}").encode()
    raw_safetensors(p, None, bytes(32), header_bytes=h)
    return _st_case(root, cid, p, ["w.weight", "duplicate"], "the same name twice in the JSON")


@case
def st_nan_weight(root, cid):
    t = llama_tensors()
    t["model.layers.0.self_attn.o_proj.weight"][3, 5] = float("nan")
    p = hf_folder(root / cid, t)
    return _st_case(root, cid, p, ["model.layers.0.self_attn.o_proj.weight", "NaN or Inf"],
                    "one NaN in a linear weight (the message names the tensor)", name=False)


@case
def st_inf_weight(root, cid):
    t = llama_tensors()
    t["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    p = hf_folder(root / cid, t)
    return _st_case(root, cid, p, ["model.layers.0.mlp.down_proj.weight", "NaN or Inf"],
                    "one +Inf in a linear weight (the message names the tensor)", name=False)


@case
def st_integer_weight(root, cid):
    t = llama_tensors()
    t["model.layers.0.self_attn.o_proj.weight"] = torch.ones(H, H, dtype=torch.int32)
    p = hf_folder(root / cid, t)
    return _st_case(root, cid, p, ["model.layers.0.self_attn.o_proj.weight", "model.safetensors",
                                   "I32"],
                    "an integer tensor where a linear weight is expected", name=False)


@case
def st_all_zero_weight(root, cid):
    """Documented fallback (DESIGN: an amax of zero never becomes a scale): exit 0, the layer
    stays in high precision and the manifest says why."""
    t = llama_tensors()
    t["model.layers.0.self_attn.o_proj.weight"].zero_()
    p = hf_folder(root / cid, t)
    out = root / "out" / cid
    return Case(cid, "safetensors", _convert(p, out), [], exit=0, outputs=[str(out)],
                note="all-zero weight: kept in high precision (fallback, exit 0)",
                manifest=[[["excluded", "model.layers.0.self_attn.o_proj.weight"],
                           "all-zero weight (amax 0)"]])


# --- Hugging Face folders: shards, index, symlinks ----------------------------------------
@case
def folder_duplicate_across_shards(root, cid):
    p = sharded_folder(root / cid)
    t = llama_tensors(seed=3)
    name = "model.layers.0.mlp.up_proj.weight"
    # the second shard also holds a tensor the first one has
    second = p / "model-00002-of-00002.safetensors"
    first = p / "model-00001-of-00002.safetensors"
    from safetensors.torch import load_file
    a, b = load_file(str(first)), load_file(str(second))
    dup = name if name in a else next(iter(a))
    b[dup] = t.get(dup, a[dup])
    save_file(b, str(second))
    return _st_case(root, cid, p, [dup, "also in"], "one tensor name in two shards",
                    "hf-folder")


@case
def index_missing_shard(root, cid):
    p = sharded_folder(root / cid)
    (p / "model-00002-of-00002.safetensors").unlink()
    return _st_case(root, cid, p, ["model-00002-of-00002.safetensors", "missing"],
                    "the index names a shard that is not there", "hf-folder")


@case
def index_parent_path(root, cid):
    p = sharded_folder(root / cid)
    outside = root / f"{cid}-outside.safetensors"
    (p / "model-00002-of-00002.safetensors").rename(outside)
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: (f"../{outside.name}" if v.startswith("model-00002") else v)
                         for k, v in idx["weight_map"].items()}
    (p / "model.safetensors.index.json").write_text(json.dumps(idx))
    return _st_case(root, cid, p, ["model.safetensors.index.json", outside.name, "outside"],
                    "the index points at ../file (outside the folder)", "hf-folder")


@case
def index_absolute_path(root, cid):
    p = sharded_folder(root / cid)
    outside = root / f"{cid}-outside.safetensors"
    (p / "model-00001-of-00002.safetensors").rename(outside)
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: (str(outside) if v.startswith("model-00001") else v)
                         for k, v in idx["weight_map"].items()}
    (p / "model.safetensors.index.json").write_text(json.dumps(idx))
    return _st_case(root, cid, p, ["model.safetensors.index.json", outside.name, "outside"],
                    "the index points at an absolute path", "hf-folder")


@case
def index_not_json(root, cid):
    p = sharded_folder(root / cid)
    (p / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"a": ')
    return _st_case(root, cid, p, ["model.safetensors.index.json", "not valid JSON"],
                    "index JSON cut short",
                    "hf-folder")


@case
def symlink_shard_escapes(root, cid):
    p = hf_folder(root / cid)
    outside = root / f"{cid}-secret.safetensors"
    (p / "model.safetensors").rename(outside)
    (p / "model.safetensors").symlink_to(outside)
    return _st_case(root, cid, p, ["model.safetensors", "outside"],
                    "model.safetensors is a symlink to a file outside the folder", "hf-folder")


@case
def symlink_config_escapes(root, cid):
    p = hf_folder(root / cid)
    outside = root / f"{cid}-secret.json"
    outside.write_text(json.dumps(LLAMA_CONFIG))
    (p / "config.json").unlink()
    (p / "config.json").symlink_to(outside)
    return _st_case(root, cid, p, ["config.json", "outside"],
                    "config.json is a symlink to a file outside the folder", "hf-folder")


@case
def folder_no_weights(root, cid):
    p = root / cid
    p.mkdir()
    (p / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    return _st_case(root, cid, p, ["no weights"], "config.json only", "hf-folder")


# --- torch pickles ---------------------------------------------------------------------
@case
def bin_malicious_pickle(root, cid):
    p = root / cid
    p.mkdir()
    (p / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    marker = root / f"{cid}.PWNED"
    sd = dict(llama_tensors())
    sd["model.evil"] = _WriteMarker(marker)
    torch.save(sd, p / "pytorch_model.bin")
    c = _st_case(root, cid, p, ["pytorch_model.bin", "refused"],
                 "pytorch_model.bin whose unpickling runs os.system('touch MARKER')", "torch")
    c.marker = str(marker)
    return c


@case
def pt_malicious_pickle(root, cid):
    p = root / f"{cid}.pt"
    marker = root / f"{cid}.PWNED"
    torch.save({"fc.weight": torch.ones(H, H), "x": _WriteMarker(marker)}, p)
    c = _st_case(root, cid, p, ["refused"], "a .pt state dict with a payload", "torch")
    c.marker = str(marker)
    return c


@case
def pt_truncated_zip(root, cid):
    p = root / f"{cid}.pt"
    torch.save(llama_tensors(), p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) * 2 // 3])
    return _st_case(root, cid, p, ["not a readable torch checkpoint"],
                    "a torch.save zip cut at two thirds", "torch")


@case
def pt_not_a_state_dict(root, cid):
    p = root / f"{cid}.pt"
    torch.save([torch.ones(3), torch.ones(3)], p)
    return _st_case(root, cid, p, ["not a state dict"],
                    "a list of tensors, not a name → tensor dict", "torch")


@case
def pt_zip64_multidisk(root, cid):
    p = root / f"{cid}.pt"
    torch.save(llama_tensors(), p)
    data = bytearray(p.read_bytes())
    i = data.rfind(b"PK\x06\x07")  # the ZIP64 end-of-central-directory locator torch writes
    data[i + 4] = 2  # "disk number": a multi-disk archive
    p.write_bytes(bytes(data))
    return _st_case(root, cid, p, [], "one byte of the ZIP64 locator changed (found by "
                    "tests/reliability/test_fuzz.py)", "torch")


# (was a known bug: zipfile.is_zipfile raising BadZipFile; fixed by torch_reader.is_zip)


# --- Transformer Engine _extra_state ----------------------------------------------------
def _te_case(root, cid, fixture: str, expect, note, extra=("--scales", "history"), name=True):
    mf = te_fixtures()
    d = root / "te"
    marker = root / "te.PWNED"
    if not d.exists():
        mf.write_fixtures(d, marker)
    p = d / f"{fixture}.pt"
    out = root / "out" / cid
    return Case(cid, "transformer-engine", _convert(p, out, *extra),
                [p.name, *expect] if name else list(expect), marker=str(marker),
                outputs=[str(out)], note=note)


@case
def te2_malicious_extra_state(root, cid):
    return _te_case(root, cid, "te2_malicious", ["fc._extra_state", "refused"],
                    "TE 2.x pickled _extra_state whose unpickling writes the marker", name=False)


@case
def te1_malicious_extra_state(root, cid):
    return _te_case(root, cid, "te1_malicious", ["fc._extra_state", "refused"],
                    "TE 1.x BytesIO(torch.save) _extra_state with a payload inside", name=False)


@case
def te_malicious_outer(root, cid):
    return _te_case(root, cid, "te_malicious_outer", ["refused"],
                    "payload in the outer state dict next to a TE layer", extra=())


@case
def te2_unknown_global(root, cid):
    return _te_case(root, cid, "te2_unknown_global", ["fc._extra_state", "numpy.ndarray"],
                    "TE 2.x extra state naming numpy.ndarray (not allowlisted)", name=False)


@case
def te2_nonfinite_history(root, cid):
    mf = te_fixtures()
    rng = np.random.default_rng(5)
    tensors, _ = mf._fwd_bwd(1, 16, 20, rng)
    hist = tensors["amax_history_fwd"]
    hist[:, 0] = torch.where(hist[:, 0] > 0, float("inf"), float("nan"))  # every input step
    value = mf.serialize_2x(tensors, 1, mf.DelayedScaling(amax_history_len=16))
    p = root / f"{cid}.pt"
    torch.save({"fc.weight": mf._w(rng, mf.H, mf.H), "fc._extra_state": value}, p)
    out = root / "out" / cid
    return Case(cid, "transformer-engine", _convert(p, out, "--scales", "history"),
                ["fc", "non-finite"], outputs=[str(out)],
                note="every input amax of a TE history is NaN/Inf (training overflowed)")


@case
def te2_partly_nonfinite_history(root, cid):
    """Documented policy: non-finite entries are overflowed steps and are skipped (exit 0); the
    manifest counts them."""
    mf = te_fixtures()
    rng = np.random.default_rng(6)
    tensors, _ = mf._fwd_bwd(1, 16, 20, rng)
    tensors["amax_history_fwd"][-1, 0] = float("nan")
    value = mf.serialize_2x(tensors, 1, mf.DelayedScaling(amax_history_len=16))
    p = root / f"{cid}.pt"
    torch.save({"fc.weight": mf._w(rng, mf.H, mf.H), "fc._extra_state": value}, p)
    out = root / "out" / cid
    return Case(cid, "transformer-engine", _convert(p, out, "--scales", "history"), [], exit=0,
                outputs=[str(out)], note="one NaN among 16 history rows: skipped, counted",
                manifest=[[["quantized", "fc", "input_details", "nonfinite_entries"], 1],
                          [["quantized", "fc", "input_scale_source"], "history"]])


# --- Keras -------------------------------------------------------------------------------
def _keras_case(root, cid, members, expect, note, compression=zipfile.ZIP_STORED):
    p = root / f"{cid}.keras"
    write_zip(p, members, compression)
    out = root / "out" / cid
    return Case(cid, "keras", _convert(p, out), [p.name, *expect], outputs=[str(out)],
                note=note)


@case
def keras_dotdot_entry(root, cid):
    marker = root / f"{cid}-escaped.json"
    name = f"../{marker.name}"
    c = _keras_case(root, cid, keras_members(root) + [(name, b"{}")], ["unsafe zip entry"],
                    "an entry named ../X (would land outside the extraction folder)")
    c.marker = str(marker)
    return c


@case
def keras_absolute_entry(root, cid):
    marker = root / f"{cid}-abs.json"
    c = _keras_case(root, cid, keras_members(root) + [(str(marker), b"{}")],
                    ["unsafe zip entry"], "an entry with an absolute path")
    c.marker = str(marker)
    return c


@case
def keras_zip_bomb(root, cid):
    members = keras_members(root) + [("assets/bomb.bin", bytes(300 * 2**20))]
    return _keras_case(root, cid, members, ["assets/bomb.bin", "zip bomb"],
                       "300 MiB of zeros deflated to ~300 KB", zipfile.ZIP_DEFLATED)


@case
def keras_truncated_archive(root, cid):
    p = root / f"{cid}.keras"
    write_zip(p, keras_members(root))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    out = root / "out" / cid
    return Case(cid, "keras", _convert(p, out), [p.name, "not a readable zip"],
                outputs=[str(out)], note=".keras archive cut in half (no central directory)")


@case
def keras_truncated_h5(root, cid):
    d = root / cid
    d.mkdir()
    p = tiny_h5(d / "model.weights.h5")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    (d / "config.json").write_text(json.dumps(KERAS_CONFIG))
    out = root / "out" / cid
    return Case(cid, "keras", _convert(p, out), [p.name, "not a readable HDF5"],
                outputs=[str(out)], note="HDF5 .weights.h5 cut in half (config.json beside it)")


@case
def keras_h5_superblock_overflow(root, cid):
    p = root / f"{cid}.keras"
    members = []
    for name, data in keras_members(root):
        if name == "model.weights.h5":
            data = bytearray(data)
            data[48] = 0  # damages the superblock's end-of-file address
            data = bytes(data)
        members.append((name, data))
    write_zip(p, members)
    out = root / "out" / cid
    return Case(cid, "keras", _convert(p, out), [p.name, "HDF5"], outputs=[str(out)],
                note="one byte of the HDF5 superblock zeroed inside a .keras archive "
                     "(found by tests/reliability/test_fuzz.py)")


# (was a known bug: h5py OverflowError escaping keras_reader._open_h5; fixed)


@case
def keras_h5_garbage(root, cid):
    d = root / cid
    d.mkdir()
    p = d / "model.weights.h5"
    p.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 8)
    (d / "config.json").write_text(json.dumps(KERAS_CONFIG))
    out = root / "out" / cid
    return Case(cid, "keras", _convert(p, out), [p.name, "not a readable HDF5"],
                outputs=[str(out)], note="HDF5 signature followed by garbage")


# --- calibration data -----------------------------------------------------------------
def _calib_case(root, cid, data_name: str, content: bytes, expect, note):
    ckpt = root / "calib-model"
    if not ckpt.exists():
        hf_folder(ckpt)
    data = root / cid / data_name
    data.parent.mkdir()
    data.write_bytes(content)
    out = root / "out" / cid
    return Case(cid, "calibration-data",
                _convert(ckpt, out, "--scales", "calibrate", "--calib-data", str(data)),
                [data.name, *expect], outputs=[str(out)], note=note)


@case
def calib_empty_txt(root, cid):
    return _calib_case(root, cid, "calib.txt", b"", ["empty"], "0-byte calibration file")


@case
def calib_binary_txt(root, cid):
    return _calib_case(root, cid, "calib.txt", bytes(range(256)) * 16, ["binary"],
                       "binary bytes in a .txt calibration file")


@case
def calib_binary_jsonl(root, cid):
    return _calib_case(root, cid, "calib.jsonl", b"\x00\x01{\"text\": \xff\xfe}\n" * 10, ["binary"],
                       "binary bytes in a .jsonl calibration file")


@case
def calib_garbage_npz(root, cid):
    return _calib_case(root, cid, "calib.npz", b"PK\x03\x04" + bytes(range(200)), ["cannot read"],
                       "an .npz that is not a zip")


@case
def calib_npz_float_ids(root, cid):
    buf = io.BytesIO()
    np.savez(buf, input_ids=np.full((2, 4), 0.5, dtype=np.float32))
    return _calib_case(root, cid, "calib.npz", buf.getvalue(), ["input_ids"],
                       "input_ids stored as float32")


@case
def calibrate_cmd_binary_data(root, cid):
    ckpt = root / "calib-model"
    if not ckpt.exists():
        hf_folder(ckpt)
    data = root / f"{cid}.txt"
    data.write_bytes(b"\x00\x01\x02\xff" * 64)
    out = root / "out" / f"{cid}-amax.json"
    return Case(cid, "calibration-data",
                ["calibrate", str(ckpt), "--calib-data", str(data), "-o", str(out)],
                [data.name, "binary"], outputs=[str(out)],
                note="`fp8export calibrate` on a binary .txt file")


# --- FP8 folders: export-onnx -----------------------------------------------------------
@case
def export_onnx_truncated_fp8(root, cid):
    d = fp8_folder(root, cid)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = root / "out" / f"{cid}.onnx"
    return Case(cid, "fp8-folder/export-onnx", ["export-onnx", str(d), "-o", str(out)],
                [f"{cid}/model.safetensors"], outputs=[str(out)],
                note="an FP8 folder whose weights file was cut in half")


@case
def export_onnx_bad_manifest(root, cid):
    d = fp8_folder(root, cid)
    (d / "fp8export.json").write_text('{"quantized": 5')
    out = root / "out" / f"{cid}.onnx"
    return Case(cid, "fp8-folder/export-onnx", ["export-onnx", str(d), "-o", str(out)],
                ["fp8export.json", "not valid JSON"], outputs=[str(out)],
                note="an FP8 folder whose manifest is cut JSON")


# --- ONNX: build-engine and verify -----------------------------------------------------
def _onnx_for(root, cid, **kw) -> Path:
    return onnx_model(root / f"{cid}.onnx", **kw)


@case
def engine_custom_op(root, cid):
    p = _onnx_for(root, cid, custom=True)
    out = root / "out" / f"{cid}.engine"
    return Case(cid, "onnx/build-engine", ["build-engine", str(p), "-o", str(out)],
                [p.name, "com.evil"], outputs=[str(out)],
                note="a custom-domain op TensorRT would need a plugin for")


@case
def engine_wrong_opset(root, cid):
    p = _onnx_for(root, cid, opset=17)
    out = root / "out" / f"{cid}.engine"
    return Case(cid, "onnx/build-engine", ["build-engine", str(p), "-o", str(out)],
                [p.name, "opset"], outputs=[str(out)],
                note="opset 17: FP8 Q/DQ needs >= 19")


@case
def engine_garbage_onnx(root, cid):
    p = root / f"{cid}.onnx"
    p.write_bytes(b"\x08\x0a\x12" + bytes(range(256)) * 4)
    out = root / "out" / f"{cid}.engine"
    return Case(cid, "onnx/build-engine", ["build-engine", str(p), "-o", str(out)],
                [p.name, "not a readable ONNX"], outputs=[str(out)],
                note="bytes that are not an ONNX protobuf")


def _verify_case(root, cid, onnx_kw, expect, note):
    ref = root / "verify-ref"
    if not ref.exists():
        hf_folder(ref)
    p = _onnx_for(root, cid, **onnx_kw)
    report = root / "out" / f"{cid}-report"
    return Case(cid, "onnx/verify", ["verify", str(ref), str(p), "--report-dir", str(report)],
                [p.name, *expect], outputs=[str(report)], note=note)


@case
def verify_custom_op(root, cid):
    return _verify_case(root, cid, {"custom": True}, ["com.evil"],
                        "candidate ONNX with a custom-domain op")


@case
def verify_wrong_opset(root, cid):
    return _verify_case(root, cid, {"opset": 17}, ["opset"],
                        "candidate ONNX at opset 17")


# --- untrusted checkpoints, second round: code, paths, sizes, outputs, ONNX -------------
from corpus_untrusted import BUILDERS as _UNTRUSTED  # noqa: E402

BUILDERS.extend(_UNTRUSTED)

# --- third round: outputs and edited FP8 folders; resource bombs and faults --------------
from corpus_outputs import BUILDERS as _OUTPUTS  # noqa: E402

BUILDERS.extend(_OUTPUTS)
from corpus_bombs import BUILDERS as _BOMBS  # noqa: E402

BUILDERS.extend(_BOMBS)

# --- fourth round: sizes, internal errors, what convert writes, the earlier rounds' classes
from corpus_fourth import BUILDERS as _FOURTH  # noqa: E402

BUILDERS.extend(_FOURTH)


# ------------------------------------------------------------------------------- driver

def build_corpus(root: Path) -> list[Case]:
    """Write every case's files under ``root``; returns the cases (root/out stays empty)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "out").mkdir(exist_ok=True)
    cases = [fn(root, fn.__name__) for fn in BUILDERS]
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.split("\n\n")[1])
        return 2
    root = Path(args[0]).resolve()
    cases = build_corpus(root)
    (root / "cases.json").write_text(json.dumps([asdict(c) for c in cases], indent=1))
    for c in cases:
        print(f"{c.id:34s} exit {c.exit}  fp8export {' '.join(c.argv[:2])} ...")
    print(f"{len(cases)} cases in {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
