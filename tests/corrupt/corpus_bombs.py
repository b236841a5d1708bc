"""Corpus cases, third round (2 of 2): resource bombs, tracebacks, faults, provenance, the second
round's leftovers.

Registered into ``make_corpus.BUILDERS`` (same :class:`Case` contract). Classes:

* **tokenizer** — ``tokenizer.json`` shapes that take all memory or time once the native
  tokenizer runs: a normalizer / decoder chain of ``Replace("w" → 1000×"w")``, 40 chained
  ``Split`` regexes, ``([a-zA-Z ]+)+$`` (a panic), a special token of 10^6 ids.
* **bounds** — an ``.npz`` that inflates to more token data than any run uses, a manifest far
  larger than its model's tensors, a Keras ``.weights.h5`` of never-written (fill-value)
  datasets, 1 121 shards under ``ulimit -n 1024``, a 200 GB sparse file beside the model.
* **tracebacks** — an ``.npy`` of shape (-2, -4), a structured ``attention_mask``, a lone
  surrogate in ``.jsonl``, heads that ``num_key_value_heads`` does not divide, a full disk
  under the private tokenizer copy.
* **provenance** — FP8 codes flipped after convert; ``--calib-amax`` of another checkpoint.
* **leftovers** — a Hub attention kernel in config.json, a pad id outside the vocabulary, a
  safetensors dimension of 2^63 beside a 0, Transformer Engine histories with stride 0 and with
  a tensor as the recipe's algorithm.

Verify cases run with ``--no-noise-floor`` and a lenient bound (the cases are about inputs, not
accuracy), so each costs one model load less.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import torch
from corpus_files import (
    LLAMA_CONFIG,
    Case,
    H,
    hf_folder,
    llama_tensors,
    raw_safetensors,
    te_fixtures,
    write_index,
)
from corpus_untrusted import calib_text, model_with_tokenizer, valid_fp8, valid_ref

BUILDERS = []
LENIENT = '{"kl_mean": 1.0}'


def case(fn):
    BUILDERS.append(fn)
    return fn


def _out(root: Path, cid: str, suffix: str = "") -> Path:
    return root / "out" / f"{cid}{suffix}"


def _lenient(root: Path) -> Path:
    path = root / "lenient-thresholds.json"
    if not path.exists():
        path.write_text(LENIENT)
    return path


def _verify(root: Path, cid: str, ref: Path, cand: Path, *extra: str) -> tuple[list[str], Path]:
    report = _out(root, cid, "-report")
    return (["verify", str(ref), str(cand), "--report-dir", str(report), "--device", "cpu",
             "--no-noise-floor", "--thresholds", str(_lenient(root)), *extra], report)


def _calibrate(root: Path, cid: str, ckpt: Path, data: Path | None = None) -> tuple[list, Path]:
    out = _out(root, cid, "-amax.json")
    data = data or calib_text(root / f"{cid}-data" / "calib.txt")
    return ["calibrate", str(ckpt), "--calib-data", str(data), "-o", str(out)], out


# ---------------------------------------------------------------------------- tokenizer bombs

def _hostile_tokenizer(root: Path, cid: str, **components) -> Path:
    ckpt = model_with_tokenizer(root / cid)
    doc = json.loads((ckpt / "tokenizer.json").read_text())
    doc.update(components)
    (ckpt / "tokenizer.json").write_text(json.dumps(doc))
    return ckpt


GROW = {"type": "Replace", "pattern": {"String": "w"}, "content": "w" * 1000}


@case
def tok_normalizer_replace_chain(root, cid):
    ckpt = _hostile_tokenizer(root, cid, normalizer={"type": "Sequence",
                                                     "normalizers": [GROW, GROW, GROW]})
    argv, report = _verify(root, cid, ckpt, valid_fp8(root))
    return Case(cid, "tokenizer", argv, ["tokenizer.json", "normalizer Replace",
                                         "1000 characters"],
                outputs=[str(report)], isolate=True,
                note="3 chained Replace(w → 1000×w): verify's built-in sentences grow 10^9-fold "
                     "(unguarded: 5 GB, then SIGABRT)")


@case
def tok_decoder_replace_chain(root, cid):
    """Token-id data needs no encoding; only the report's decoding meets the bomb: the report
    shows ids instead, and says why (a documented fallback, exit 0)."""
    ckpt = _hostile_tokenizer(root, cid, decoder={"type": "Sequence",
                                                  "decoders": [GROW, GROW, GROW]})
    data = root / f"{cid}-data" / "ids.npz"
    data.parent.mkdir()
    np.savez(data, input_ids=np.arange(4, 36, dtype=np.int64).reshape(4, 8))
    argv, report = _verify(root, cid, ckpt, valid_fp8(root), "--data", str(data))
    return Case(cid, "tokenizer", argv, ["token ids instead of text", "decoder Replace"],
                exit=0, outputs=[str(report)], isolate=True,
                note="the same chain in the decoder, verify --data ids.npz (unguarded: hangs "
                     "while writing the report)")


@case
def tok_split_chain(root, cid):
    split = {"type": "Split", "pattern": {"Regex": "\\s*\\s*x"}, "behavior": "Isolated",
             "invert": False}
    ckpt = _hostile_tokenizer(root, cid, pre_tokenizer={"type": "Sequence",
                                                        "pretokenizers": [split] * 40})
    argv, out = _calibrate(root, cid, ckpt)
    return Case(cid, "tokenizer", argv, ["tokenizer.json", "more than 8 regex splits"],
                outputs=[str(out)], isolate=True,
                note="40 chained Split regexes (unguarded: seconds per split per line)")


@case
def tok_split_panic(root, cid):
    ckpt = _hostile_tokenizer(root, cid, pre_tokenizer={
        "type": "Split", "pattern": {"Regex": "([a-zA-Z ]+)+$"}, "behavior": "Isolated",
        "invert": False})
    argv, report = _verify(root, cid, ckpt, valid_fp8(root))
    return Case(cid, "tokenizer", argv, ["tokenizer.json", "repeated group that itself repeats"],
                outputs=[str(report)],
                note="([a-zA-Z ]+)+$ (unguarded: a PanicException traceback)")


@case
def tok_template_special_ids(root, cid):
    ids = [2] * 1_000_000
    ckpt = _hostile_tokenizer(root, cid, post_processor={
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": ids, "tokens": ["<s>"] * len(ids)}}})
    argv, out = _calibrate(root, cid, ckpt)
    return Case(cid, "tokenizer", argv, ["tokenizer.json", "expands to 1000000 ids"],
                outputs=[str(out)], isolate=True,
                note="a template special token of 10^6 ids (unguarded: GBs, then a panic)")


# ------------------------------------------------------------------------------------ bounds

def _inflating_npz(path: Path, shape: tuple[int, int]) -> Path:
    """An .npz whose ``input_ids.npy`` member declares ``shape`` int64 ids (its zip entry says so
    too) over 1.2 MB of deflated data: ~900:1, inside any ratio a real token file might reach.
    Only the .npy header is ever decompressed by a guarded reader, so the rest is filler."""
    from numpy.lib import format as npy

    head = io.BytesIO()
    npy.write_array_header_1_0(head, {"descr": "<i8", "fortran_order": False, "shape": shape})
    filler = np.random.default_rng(0).integers(0, 256, 1_200_000, dtype=np.uint8).tobytes()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("input_ids.npy", head.getvalue() + filler)
    real = len(head.getvalue()) + len(filler)
    declared = len(head.getvalue()) + shape[0] * shape[1] * 8
    raw = bytearray(path.read_bytes())
    for sig, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # local, central headers
        at = raw.find(sig)
        assert struct.unpack_from("<I", raw, at + offset)[0] == real
        struct.pack_into("<I", raw, at + offset, declared)
    path.write_bytes(bytes(raw))
    return path


@case
def bounds_npz_inflation(root, cid):
    data = root / f"{cid}-data" / "data.npz"
    data.parent.mkdir()
    _inflating_npz(data, (1 << 17, 1040))  # 1.04 GiB of int64 ids, from 1.2 MB
    argv, out = _calibrate(root, cid, valid_ref(root), data)
    return Case(cid, "bounds", argv, ["data.npz", "input_ids", "bytes of token data"],
                outputs=[str(out)], isolate=True,
                note="an .npz member inflating ~900:1 to 1.04 GiB of token ids (the reviewer's: "
                     "4.5 MB to 3.9 GB, 870:1, then MemoryError)")


@case
def bounds_manifest_of_empty_lists(root, cid):
    folder = root / cid
    shutil.copytree(valid_fp8(root), folder)
    (folder / "fp8export.json").write_bytes(b"[" + b"[]," * 1_000_000 + b"[]]")
    return Case(cid, "bounds", ["inspect", str(folder)],
                ["fp8export.json", "more than any real fp8export manifest for 19 tensors"],
                note="a 3 MB manifest of [] for a 19-tensor model (the reviewer's 250 MB took "
                     "6.5 GB in inspect): manifests are sized by the model's tensors")


@case
def bounds_keras_fill_value(root, cid):
    import h5py
    from corpus_files import KERAS_CONFIG

    d = root / cid
    d.mkdir()
    p = d / "model.weights.h5"
    with h5py.File(p, "w") as f:
        g = f.create_group("layers/dense/vars")
        g.create_dataset("0", shape=(H, 8), dtype="float32")  # never written: fill value
        g.create_dataset("1", data=np.zeros(8, "float32"))
        for i in range(64):
            f.create_group(f"layers/pad{i}/vars").create_dataset("0", shape=(2048, 2048),
                                                                 dtype="float32")
    (d / "config.json").write_text(json.dumps(KERAS_CONFIG))
    out = _out(root, cid)
    return Case(cid, "bounds", ["convert", str(p), "-o", str(out)],
                ["model.weights.h5", "never written"], outputs=[str(out)],
                note="a small .weights.h5 of datasets never written (1 GiB of fill values)")


@case
def bounds_shards_beyond_open_files(root, cid):
    folder = root / cid
    folder.mkdir()
    weight_map = {}
    for i in range(1121):
        name, file = f"blocks.{i}.fc.weight", f"model-{i + 1:05d}-of-01121.safetensors"
        raw_safetensors(folder / file, {name: {"dtype": "F32", "shape": [2, 2],
                                               "data_offsets": [0, 16]}},
                        np.full(4, i + 1, np.float32).tobytes())
        weight_map[name] = file
    write_index(folder, weight_map)
    out = _out(root, cid)
    return Case(cid, "bounds", ["convert", str(folder), "-o", str(out)],
                [cid, "1121 weight files", "files open at once", "ulimit -n"],
                outputs=[str(out)], rlimits={"nofile": 1024},
                note="1 121 shards under ulimit -n 1024 (was: Too many open files traceback)")


@case
def bounds_sparse_file_beside_the_model(root, cid):
    ckpt = root / cid
    shutil.copytree(valid_ref(root), ckpt)
    with open(ckpt / "optimizer_state.bin", "wb") as f:
        f.truncate(200 << 30)  # 200 GB, sparse: no disk used, hours to hash
    argv, report = _verify(root, cid, ckpt, valid_fp8(root))
    return Case(cid, "bounds", argv, [], exit=0, outputs=[str(report)], isolate=True,
                note="a 200 GB sparse optimizer_state.bin beside the reference: verify hashes "
                     "only what it reads")


# -------------------------------------------------------------------------------- tracebacks

def _npz_case(root, cid, members: dict, expect, note) -> Case:
    data = root / f"{cid}-data" / "data.npz"
    data.parent.mkdir()
    with zipfile.ZipFile(data, "w") as zf:
        for name, raw in members.items():
            zf.writestr(name, raw)
    argv, out = _calibrate(root, cid, valid_ref(root), data)
    return Case(cid, "tracebacks", argv, ["data.npz", *expect], outputs=[str(out)], note=note)


def _npy(array: np.ndarray | None = None, *, header: dict | None = None,
         body: bytes = b"") -> bytes:
    from numpy.lib import format as npy

    buf = io.BytesIO()
    if array is not None:
        npy.write_array(buf, array)
        return buf.getvalue()
    npy.write_array_header_1_0(buf, header)
    return buf.getvalue() + body


@case
def trace_npy_negative_shape(root, cid):
    raw = _npy(header={"descr": "<i8", "fortran_order": False, "shape": (-2, -4)},
               body=np.ones(8, np.int64).tobytes())
    return _npz_case(root, cid, {"input_ids.npy": raw}, ["input_ids", "(-2, -4)", ">= 0"],
                     ".npy header of shape (-2, -4) over 8 ids (was: ValueError in reshape)")


@case
def trace_structured_attention_mask(root, cid):
    mask = np.zeros((2, 8), dtype=[("a", "<i4"), ("b", "<i4")])
    return _npz_case(root, cid, {"input_ids.npy": _npy(np.ones((2, 8), np.int64)),
                                 "attention_mask.npy": _npy(mask)},
                     ["attention_mask", "structured dtype"],
                     "a structured-dtype attention_mask (was: a numpy traceback)")


@case
def trace_jsonl_lone_surrogate(root, cid):
    data = root / f"{cid}-data" / "calib.jsonl"
    data.parent.mkdir()
    data.write_text('{"text": "w1 w2"}\n{"text": "w3 \\ud800 w4"}\n')
    argv, out = _calibrate(root, cid, valid_ref(root), data)
    return Case(cid, "tracebacks", argv, ["calib.jsonl:2", "lone surrogate"],
                outputs=[str(out)], note="a .jsonl line whose text escapes a lone surrogate")


def _kv_heads_checkpoint(root: Path, cid: str) -> Path:
    t = llama_tensors()
    for n in ("k_proj", "v_proj"):  # 3 key/value heads of 4 dims: shapes agree with config
        t[f"model.layers.0.self_attn.{n}.weight"] = torch.randn(12, H).to(torch.bfloat16)
    ckpt = model_with_tokenizer(root / cid, {**LLAMA_CONFIG, "num_key_value_heads": 3})
    hf_folder(ckpt, t, config={**LLAMA_CONFIG, "num_key_value_heads": 3})
    return ckpt


@case
def trace_kv_heads_calibrate(root, cid):
    argv, out = _calibrate(root, cid, _kv_heads_checkpoint(root, cid))
    return Case(cid, "tracebacks", argv, ["config.json", "num_key_value_heads",
                                          "a divisor of num_attention_heads"],
                outputs=[str(out)], note="4 heads, 3 key/value heads (was: a RuntimeError in "
                                         "attention)")


@case
def trace_kv_heads_verify(root, cid):
    argv, report = _verify(root, cid, _kv_heads_checkpoint(root, cid), valid_fp8(root))
    return Case(cid, "tracebacks", argv, ["config.json", "num_key_value_heads"],
                outputs=[str(report)], note="the same through verify")


@case
def trace_full_disk_under_tokenizer_copy(root, cid):
    argv, out = _calibrate(root, cid, valid_ref(root))
    return Case(cid, "tracebacks", argv, ["cannot prepare the tokenizer", "TMPDIR"],
                outputs=[str(out)], rlimits={"fsize": 512},
                note="writes beyond 512 bytes fail (EFBIG, like a full TMPDIR) while the "
                     "tokenizer is copied to its private folder (was: an OSError traceback)")


# -------------------------------------------------------------------------------- provenance

@case
def prov_fp8_codes_flipped(root, cid):
    folder = root / cid
    shutil.copytree(valid_fp8(root), folder)
    path = folder / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    begin = header["model.layers.0.mlp.up_proj.weight"]["data_offsets"][0]
    for i in range(16):
        raw[8 + n + begin + i] ^= 1
    path.write_bytes(bytes(raw))
    argv, report = _verify(root, cid, valid_ref(root), folder)
    return Case(cid, "provenance", argv, ["edited after convert", "model.safetensors"],
                exit=0, outputs=[str(report)],
                note="16 FP8 codes XOR 1 after convert: not 'converted from the reference'")


@case
def prov_amax_of_another_checkpoint(root, cid):
    ref = valid_ref(root)
    other = root / f"{cid}-other"
    hf_folder(other, llama_tensors(seed=7))
    amax = {"format": "fp8export-amax", "version": 1, "method": "max", "samples": 4,
            "tokens": 32, "checkpoint": {"path": str(other), "files": {
                "model.safetensors": __import__("hashlib").sha256(
                    (other / "model.safetensors").read_bytes()).hexdigest()}},
            "modules": {"model.layers.0.self_attn.q_proj": {"amax": 2000.0}}}
    path = root / f"{cid}-amax.json"
    path.write_text(json.dumps(amax))
    out = _out(root, cid)
    return Case(cid, "provenance", ["convert", str(ref), "-o", str(out), "--scales", "calibrate",
                                    "--calib-amax", str(path)],
                [path.name, "recorded for another checkpoint", "model.safetensors"],
                outputs=[str(out)], note="--calib-amax written for another checkpoint's weights")


# --------------------------------------------------------------------------------- leftovers

@case
def left_attention_hub_kernel(root, cid):
    ckpt = model_with_tokenizer(root / cid, {**LLAMA_CONFIG,
                                             "attn_implementation": "kernels-community/flash-attn"})
    argv, out = _calibrate(root, cid, ckpt)
    return Case(cid, "leftovers", argv, ["attn_implementation", "Hub kernel", "ignored"],
                exit=0, outputs=[str(out)],
                note="a Hub attention kernel (code fetched at run time): ignored, said")


@case
def left_pad_outside_vocabulary(root, cid):
    ckpt = model_with_tokenizer(root / cid)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    doc = json.loads((ckpt / "tokenizer.json").read_text())
    doc["added_tokens"] = [{"id": 70000, "content": "<pad70000>", "single_word": False,
                            "lstrip": False, "rstrip": False, "normalized": False,
                            "special": True}]
    (ckpt / "tokenizer.json").write_text(json.dumps(doc))
    cfg["pad_token"] = "<pad70000>"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    argv, out = _calibrate(root, cid, ckpt)
    return Case(cid, "leftovers", argv, ["pad token id 64", "outside the model's vocabulary"],
                exit=0, outputs=[str(out)],
                note="a pad token id beyond the 64-row embedding: batches padded with id 0 "
                     "instead, said")


@case
def left_dimension_two_to_the_63(root, cid):
    p = root / f"{cid}.safetensors"
    raw_safetensors(p, {"a.weight": {"dtype": "F32", "shape": [2**63, 0],
                                     "data_offsets": [0, 0]},
                        "b.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}},
                    bytes(64))
    out = _out(root, cid)
    return Case(cid, "leftovers", ["convert", str(p), "-o", str(out)],
                [p.name, "a.weight", "above 2^40"], outputs=[str(out)],
                note="a dimension of 2^63 beside a 0 (0 elements, so the byte count matched)")


def _te_case(root, cid, tensors_edit, recipe, note) -> Case:
    mf = te_fixtures()
    rng = np.random.default_rng(5)
    tensors, _ = mf._fwd_bwd(1, 16, 20, rng)
    tensors_edit(tensors)
    value = mf.serialize_2x(tensors, 1, recipe(mf))
    p = root / f"{cid}.pt"
    torch.save({"fc.weight": mf._w(rng, mf.H, mf.H), "fc._extra_state": value}, p)
    out = _out(root, cid)
    return Case(cid, "leftovers", ["convert", str(p), "-o", str(out), "--scales", "history"], [],
                exit=0, outputs=[str(out)], note=note,
                manifest=[[["quantized", "fc", "input_scale_source"], "history"]])


@case
def left_te_history_stride0(root, cid):
    def edit(t):
        t["amax_history_fwd"] = torch.tensor([1.0, 2.0, 3.0]).expand(16, 3)

    return _te_case(root, cid, edit, lambda mf: mf.DelayedScaling(amax_history_len=16),
                    "a TE history whose rows are one stride-0 row: read as 16 equal steps")


@case
def left_te_algorithm_tensor(root, cid):
    return _te_case(root, cid, lambda t: None,
                    lambda mf: mf.DelayedScaling(amax_history_len=16,
                                                 amax_compute_algo=torch.tensor([1.0])),
                    "a TE recipe whose amax_compute_algo is a tensor: --amax-algo decides")

