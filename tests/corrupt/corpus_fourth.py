"""Corpus cases, fourth round: sizes that ask for more than their data, internal errors that
must be ``Error:`` lines, convert writing only what its own reader opens, leftovers, and the
second and third rounds' remaining classes.

Registered into ``make_corpus.BUILDERS`` (same :class:`Case` contract). Classes:

* **sizes** — ``--block-size 65536`` over 16x16 weights (a 1x1 block grid: correct, in bounded
  memory), ``--block-size 1000000x1`` (no FP8 folder can record it), a 200 GB sparse
  ``generation_config.json`` in the reference and a 200 GB sparse file that an edited manifest
  lists (one verify), a Transformer Engine history of 10^9 stride-0 rows.
* **internal** — ``--include`` of MoE routers, ``num_experts_per_tok`` above the expert count,
  the ONNX level record nested, forged and mistyped.
* **represent** — a layer scaled by 1e-20 / 1e20, an activation range of 1e30 from an amax file,
  an MoE checkpoint missing one expert: refused before anything is written.
* **leftovers** — a convert that fails on a full disk (a file-size limit) leaves no parent folder.
* **third** — ``modules.json`` naming the root as ``./``; an amax file of another model.
* **second** — a 2^62 dimension beside a 0 in a torch file and in a Keras ``.weights.h5``, a
  config ``pad_token_id`` beyond the vocabulary, an attention kernel chosen per sub-config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from corpus_files import (
    FFN,
    KERAS_CONFIG,
    LLAMA_CONFIG,
    Case,
    H,
    V,
    hf_folder,
    llama_tensors,
    onnx_model,
    te_fixtures,
)
from corpus_untrusted import calib_text, model_with_tokenizer, valid_fp8, valid_ref

BUILDERS = []
LENIENT = '{"kl_mean": 1.0}'
EXPERTS = 4
MOE_CONFIG = {**LLAMA_CONFIG, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
              "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0}


def case(fn):
    BUILDERS.append(fn)
    return fn


def _out(root: Path, cid: str, suffix: str = "") -> Path:
    return root / "out" / f"{cid}{suffix}"


def _convert(root: Path, cid: str, ckpt: Path, *extra: str) -> tuple[list[str], Path]:
    out = _out(root, cid)
    return ["convert", str(ckpt), "-o", str(out), *extra], out


def _verify(root: Path, cid: str, ref: Path, cand: Path) -> tuple[list[str], Path]:
    report = _out(root, cid, "-report")
    thresholds = root / "fourth-lenient.json"
    if not thresholds.exists():
        thresholds.write_text(LENIENT)
    return (["verify", str(ref), str(cand), "--report-dir", str(report), "--device", "cpu",
             "--no-noise-floor", "--thresholds", str(thresholds)], report)


def moe_tensors(seed: int = 0, drop: str | None = None) -> dict[str, torch.Tensor]:
    """A one-layer Mixtral-shaped state dict, one tensor per expert projection (the names
    transformers saves); ``drop``: names containing it are left out."""
    g = torch.Generator().manual_seed(seed)
    t = {k: v for k, v in llama_tensors(seed).items() if ".mlp." not in k}
    p = "model.layers.0.block_sparse_moe."
    t[p + "gate.weight"] = (torch.randn(EXPERTS, H, generator=g) * 0.5).to(torch.bfloat16)
    for e in range(EXPERTS):
        for leaf, shape in (("w1", (FFN, H)), ("w3", (FFN, H)), ("w2", (H, FFN))):
            t[f"{p}experts.{e}.{leaf}.weight"] = (torch.randn(*shape, generator=g)
                                                  * 0.05).to(torch.bfloat16)
    return {k: v for k, v in t.items() if drop is None or drop not in k}


# --------------------------------------------------------------------------------- sizes

@case
def size_block_larger_than_every_weight(root, cid):
    argv, out = _convert(root, cid, valid_ref(root), "--weight-granularity", "block",
                         "--block-size", "65536")
    return Case(cid, "sizes", argv, ["partial"], exit=0, outputs=[str(out)], isolate=True,
                manifest=[[["block_size"], [65536, 65536]],
                          [["quantized", "model.layers.0.mlp.up_proj", "weight_scale_source"],
                           "weights"]],
                note="blocks of 65536x65536 over 16x16 weights: one partial block each, computed "
                     "in the weight's own memory (was: 16 GiB asked for a 64x64 weight)")


@case
def size_block_beyond_any_folder(root, cid):
    argv, out = _convert(root, cid, valid_ref(root), "--weight-granularity", "block",
                         "--block-size", "1000000x1")
    return Case(cid, "sizes", argv, ["--block-size", "at most 65536"], exit=2,
                outputs=[str(out)],
                note="a block no FP8 folder can record: a usage error before anything is read "
                     "(was: 25 s, 1.2 GB, and a folder its own reader refused)")


@case
def size_sparse_files_verify_does_not_read(root, cid):
    """One verify for both sparse files (each costs a verify run): the reference's and the
    candidate's."""
    ref, folder = root / f"{cid}-ref", root / cid
    shutil.copytree(valid_ref(root), ref)
    with open(ref / "generation_config.json", "wb") as f:
        f.truncate(200 << 30)  # 200 GB, sparse: no disk used, hours to hash
    shutil.copytree(valid_fp8(root), folder)
    with open(folder / "optimizer.bin", "wb") as f:
        f.truncate(200 << 30)
    manifest = json.loads((folder / "fp8export.json").read_text())
    manifest["files"].append({"name": "optimizer.bin", "sha256": "0" * 64, "bytes": 200 << 30})
    (folder / "fp8export.json").write_text(json.dumps(manifest))
    argv, report = _verify(root, cid, ref, folder)
    return Case(cid, "sizes", argv, [], exit=0, outputs=[str(report)], isolate=True,
                note="a 200 GB sparse generation_config.json in the reference, and one more "
                     "entry in the candidate's fp8export.json files naming a 200 GB sparse "
                     "file: verify hashes only what it reads (was: 214 GB hashed)")


@case
def size_te_history_billion_rows(root, cid):
    mf = te_fixtures()
    rng = np.random.default_rng(5)
    tensors, _ = mf._fwd_bwd(1, 16, 20, rng)
    tensors["amax_history_fwd"] = torch.tensor([1.0, 2.0, 3.0]).expand(10**9, 3)
    value = mf.serialize_2x(tensors, 1, mf.DelayedScaling(amax_history_len=16))
    p = root / f"{cid}.pt"
    torch.save({"fc.weight": mf._w(rng, mf.H, mf.H), "fc._extra_state": value}, p)
    argv, out = _convert(root, cid, p, "--scales", "history")
    return Case(cid, "sizes", argv, [p.name, "fc._extra_state", "amax_history_fwd",
                                     "more values than any Transformer Engine state"],
                outputs=[str(out)], isolate=True,
                note="a TE history of 10^9 stride-0 rows in a 6 KB file (was: 11 GiB asked, then "
                     "MemoryError or the OOM killer)")


# ------------------------------------------------------------------------------ internal

def _moe(root: Path, name: str, config: dict | None = None, **kw) -> Path:
    path = root / name
    if not path.exists():
        model_with_tokenizer(path, config or MOE_CONFIG)
        hf_folder(path, moe_tensors(**kw), config=config or MOE_CONFIG)
    return path


@case
def internal_include_moe_router(root, cid):
    argv, out = _convert(root, cid, _moe(root, "fourth-moe"), "--include",
                         "*block_sparse_moe.gate")
    return Case(cid, "internal", argv, ["--include", "MoE router",
                                        "model.layers.0.block_sparse_moe.gate"],
                outputs=[str(out)],
                note="--include of the routers: engines build them unquantized (was: exit 0, "
                     "then an internal error in verify)")


@case
def internal_topk_beyond_experts(root, cid):
    ckpt = _moe(root, cid, {**MOE_CONFIG, "num_experts_per_tok": EXPERTS + 5})
    out = _out(root, cid, "-amax.json")
    data = calib_text(root / f"{cid}-data" / "calib.txt")
    return Case(cid, "internal", ["calibrate", str(ckpt), "--calib-data", str(data), "-o",
                                  str(out)],
                ["config.json", "num_experts_per_tok", "at most num_local_experts"],
                outputs=[str(out)],
                note="9 experts per token of 4 (was: RuntimeError in torch.topk, exit 4)")


def _onnx_with_levels(root: Path, cid: str, value: str) -> Path:
    import onnx

    from fp8export.onnx.levels import METADATA_KEY

    path = onnx_model(root / f"{cid}.onnx")
    model = onnx.load(str(path))
    model.metadata_props.add(key=METADATA_KEY, value=value)
    onnx.save(model, str(path))
    return path


@case
def internal_levels_nested(root, cid):
    p = _onnx_with_levels(root, cid, "[" * 5000 + "]" * 5000)
    return Case(cid, "internal", ["inspect", str(p)], [p.name, "onnxruntime_levels",
                                                       "nests deeper"],
                note="the level record nested 5000 deep (was: RecursionError)")


@case
def internal_levels_forged(root, cid):
    p = _onnx_with_levels(root, cid, json.dumps({
        "onnxruntime": "1.22.0", "levels": {"ORT_DISABLE_ALL": "same", "ORT_ENABLE_ALL": "differs"},
        "wrong": ["ORT_ENABLE_ALL"], "use": "ORT_ENABLE_EVERYTHING"}))
    return Case(cid, "internal", ["inspect", str(p)], [p.name, "onnxruntime_levels", "'use'"],
                note="a record naming a level onnxruntime does not have (was: StopIteration)")


@case
def internal_levels_mistyped(root, cid):
    p = _onnx_with_levels(root, cid, json.dumps({
        "onnxruntime": "1.22.0", "levels": [1, 2], "wrong": [1, 2], "use": None}))
    return Case(cid, "internal", ["inspect", str(p)], [p.name, "onnxruntime_levels",
                                                       "'levels'"],
                note="levels as a list of numbers (was: TypeError)")


# ----------------------------------------------------------------------------- represent

def _scaled(root: Path, cid: str, factor: float) -> Path:
    t = llama_tensors()
    name = "model.layers.0.self_attn.o_proj.weight"
    t[name] = (t[name].float() * factor).to(torch.bfloat16)
    return hf_folder(root / cid, t)


@case
def represent_layer_scaled_tiny(root, cid):
    argv, out = _convert(root, cid, _scaled(root, cid, 1e-20))
    return Case(cid, "represent", argv, ["model.layers.0.self_attn.o_proj", "outside 1e-12",
                                         "--exclude"], outputs=[str(out)],
                note="a layer scaled by 1e-20 (was: exit 0, then the folder refused as damaged)")


@case
def represent_layer_scaled_huge(root, cid):
    argv, out = _convert(root, cid, _scaled(root, cid, 1e20))
    return Case(cid, "represent", argv, ["model.layers.0.self_attn.o_proj", "outside 1e-12"],
                outputs=[str(out)], note="a layer scaled by 1e20")


@case
def represent_input_range_huge(root, cid):
    amax = {"format": "fp8export-amax", "version": 1, "method": "max", "samples": 4,
            "tokens": 32, "modules": {"model.layers.0.self_attn.o_proj": {"amax": 1e30}}}
    path = root / f"{cid}-amax.json"
    path.write_text(json.dumps(amax))
    argv, out = _convert(root, cid, valid_ref(root), "--calib-amax", str(path))
    return Case(cid, "represent", argv, ["input scale", "model.layers.0.self_attn.o_proj",
                                         "outside 1e-12"], outputs=[str(out)],
                note="an activation range of 1e30 from an amax file")


@case
def represent_moe_expert_missing(root, cid):
    ckpt = _moe(root, cid, drop="experts.2.w1.")
    argv, out = _convert(root, cid, ckpt)
    return Case(cid, "represent", argv, ["block_sparse_moe.experts", "num_local_experts",
                                         "expert(s) 2 have no w1.weight"], outputs=[str(out)],
                note="one expert's w1 missing (was: exit 0, and no command or loader took the "
                     "folder)")


# ----------------------------------------------------------------------------- leftovers

@case
def left_full_disk_parent_folders(root, cid):
    top = _out(root, cid)
    out = top / "new" / "deeper" / "model-fp8"
    return Case(cid, "leftovers", ["convert", str(valid_ref(root)), "-o", str(out)],
                ["model-fp8", "File too large", "Nothing was written"], outputs=[str(top)],
                rlimits={"fsize": 4096},
                note="writes beyond 4 KiB fail (EFBIG, as a full disk): the output and the two "
                     "folders convert made for it are gone")


# --------------------------------------------------------------------------------- third

@case
def third_modules_json_root(root, cid):
    ckpt = root / cid
    shutil.copytree(valid_ref(root), ckpt)
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "./", "type": "sentence_transformers.models.Pooling"}]))
    (ckpt / "optimizer.pt").write_bytes(b"\0" * 64)
    (ckpt / "notes-private.txt").write_text("not for publication")
    argv, out = _convert(root, cid, ckpt)
    return Case(cid, "third", argv, [], exit=0, outputs=[str(out)],
                absent=[str(out / "optimizer.pt"), str(out / "notes-private.txt")],
                note="a Pooling module whose path './' is the checkpoint itself: its other "
                     "files are no loader's and stay behind")


@case
def third_amax_of_another_model(root, cid):
    amax = {"format": "fp8export-amax", "version": 1, "method": "max", "samples": 4,
            "tokens": 32, "modules": {"encoder.layer.0.attention.self.query": {"amax": 2.0}}}
    path = root / f"{cid}-amax.json"
    path.write_text(json.dumps(amax))
    argv, out = _convert(root, cid, valid_ref(root), "--calib-amax", str(path))
    return Case(cid, "third", argv, [path.name, "recorded for another model"],
                outputs=[str(out)],
                note="an amax file naming no layer of this checkpoint, and no checkpoint "
                     "(was: exit 0 with every layer dynamic)")


# -------------------------------------------------------------------------------- second

@case
def second_dimension_in_torch_file(root, cid):
    t = llama_tensors()
    t["a.weight"] = torch.empty((2**62, 0))
    p = root / f"{cid}.pt"
    torch.save(t, p)
    argv, out = _convert(root, cid, p)
    return Case(cid, "second", argv, [p.name, "a.weight", "above 2^40"], outputs=[str(out)],
                note="a torch file holding a [2^62, 0] tensor (was: exit 1 from read-back, "
                     "blaming SQNR)")


@case
def second_dimension_in_keras_h5(root, cid):
    import h5py

    d = root / cid
    d.mkdir()
    p = d / "model.weights.h5"
    with h5py.File(p, "w") as f:
        g = f.create_group("layers/dense/vars")
        g.create_dataset("0", data=np.ones((H, 8), "float32"))
        g.create_dataset("1", data=np.zeros(8, "float32"))
        f.create_group("layers/big/vars").create_dataset("0", shape=(2**62, 0), dtype="float32")
    (d / "config.json").write_text(json.dumps(KERAS_CONFIG))
    return Case(cid, "second", ["inspect", str(p)], [p.name, "big.vars.0", "above 2^40"],
                note="a Keras dataset of shape [2^62, 0] (was: inspect listed it)")


@case
def second_config_pad_beyond_vocabulary(root, cid):
    ckpt = hf_folder(root / cid, config={**LLAMA_CONFIG, "pad_token_id": V + 1000})
    argv, out = _convert(root, cid, ckpt)
    return Case(cid, "second", argv, ["config.json", "pad_token_id", "padding_idx"],
                outputs=[str(out)],
                note="config.json's pad_token_id beyond the vocabulary: no loader builds the "
                     "model (was: exit 0 from convert, an error at every later load)")


@case
def second_attention_kernel_per_subconfig(root, cid):
    ckpt = model_with_tokenizer(root / cid, {**LLAMA_CONFIG, "attn_implementation": {
        "text_config": "kernels-community/flash-attn"}})
    out = _out(root, cid, "-amax.json")
    data = calib_text(root / f"{cid}-data" / "calib.txt")
    return Case(cid, "second", ["calibrate", str(ckpt), "--calib-data", str(data), "-o",
                                str(out)], ["attn_implementation", "ignored"], exit=0,
                outputs=[str(out)],
                note="a Hub kernel chosen per sub-config (the dict form): dropped like the "
                     "string form, said")
