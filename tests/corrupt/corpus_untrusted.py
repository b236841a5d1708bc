"""Corpus cases, second round: checkpoints that carry code, reach outside their folder, lie
about sizes, aim outputs at the input, or hand verify a graph that never ends.

Registered into ``make_corpus.BUILDERS`` (same :class:`Case` contract). Classes:

* **code** — a ``.py`` beside ``config.json`` / ``tokenizer_config.json`` that an ``auto_map``
  names; through calibrate, convert --scales calibrate, export-onnx, verify (reference and
  candidate, with and without --data). Every such case feeds ``y`` on stdin: a build that
  prompts runs the payload, which writes the marker.
* **paths** — tokenizer and data files that are FIFOs or links to /dev/zero, a tokenizer
  config naming a file outside the folder.
* **outputs** — -o / --report-dir aimed inside the input, unwritable locations.
* **sizes** — config sizes the weights do not have, stride-0 torch views, huge lines, token ids
  outside the vocabulary.
* **parsing** — JSON nested 100 000 deep or with 5 000-digit integers, wrong types in config,
  amax.json and the manifest, odd tensors, ONNX bytes that are not ONNX or whose external data
  escapes.
* **onnx** — a candidate with a ``Loop`` of 10^15 iterations.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import torch
from corpus_files import (
    LLAMA_CONFIG,
    Case,
    H,
    V,
    fp8_folder,
    hf_folder,
    onnx_model,
    sha256_file,
    sharded_folder,
)

BUILDERS = []
YES = "y\n" * 64  # answers "Do you wish to run the custom code? [y/N]" as often as asked


def case(fn):
    BUILDERS.append(fn)
    return fn


# ---------------------------------------------------------------------------------- files

WORDS = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(V - 4)]
# A llama-shaped model whose model_type transformers has no tokenizer class for (so a tokenizer
# auto_map is the only tokenizer code it knows: transformers prompts before running it).
HELIUM_CONFIG = {**LLAMA_CONFIG, "model_type": "helium", "architectures": ["HeliumForCausalLM"],
                 "head_dim": H // LLAMA_CONFIG["num_attention_heads"]}


def tokenizer_files(folder: Path, **config) -> Path:
    """A word-level tokenizer over the model's 64 ids (tokenizers' own format, no transformers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>",
           "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", **config}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                              if v is not None}))
    return folder


def model_with_tokenizer(folder: Path, config: dict | None = None, **tok_config) -> Path:
    hf_folder(folder, config=config or LLAMA_CONFIG)
    return tokenizer_files(folder, **tok_config)


def calib_text(path: Path, lines: int = 6) -> Path:
    rng = np.random.default_rng(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(" ".join(WORDS[4 + i] for i in rng.integers(0, V - 4, 12))
                              for _ in range(lines)) + "\n")
    return path


def payload(folder: Path, marker: Path) -> Path:
    """``evil.py``: importing it writes ``marker`` (what transformers does with auto_map code
    once the user answers "y")."""
    (folder / "evil.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('payload ran')\n"
        "from transformers import LlamaConfig as EvilConfig\n"
        "from transformers import LlamaForCausalLM as EvilModel\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    return folder


def code_config(folder: Path) -> dict:
    """A config whose causal-LM class exists only as the checkpoint's code (vit has no causal LM
    in transformers), pointing transformers at ``folder`` for it."""
    return {**LLAMA_CONFIG, "model_type": "vit", "architectures": ["EvilForCausalLM"],
            "auto_map": {"AutoConfig": "evil.EvilConfig",
                         "AutoModelForCausalLM": "evil.EvilModel"},
            "_name_or_path": str(folder.resolve())}


def with_code_config(folder: Path, marker: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    keep = {k: v for k, v in config.items() if k == "quantization_config"}
    (folder / "config.json").write_text(json.dumps({**code_config(folder), **keep}))
    return payload(folder, marker)


def with_code_tokenizer(folder: Path, marker: Path) -> Path:
    tokenizer_files(folder, tokenizer_class=None,
                    auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
    return payload(folder, marker)


def valid_fp8(root: Path) -> Path:
    """One valid FP8 folder shared by the verify cases (converted once)."""
    out = root / "untrusted-fp8"
    if not out.exists():
        fp8_folder(root, out.name)
    return out


def valid_ref(root: Path) -> Path:
    ref = root / "untrusted-ref"
    if not ref.exists():
        model_with_tokenizer(ref)
    return ref


def _out(root: Path, cid: str, suffix: str = "") -> Path:
    return root / "out" / f"{cid}{suffix}"


# ------------------------------------------------------------------------ code execution

def _calibrating_code(root, cid, *, command: str, what: str) -> Case:
    """calibrate / convert --scales calibrate on a checkpoint carrying a config or tokenizer
    payload."""
    marker = root / f"{cid}.PWNED"
    if what == "tokenizer":
        ckpt = with_code_tokenizer(model_with_tokenizer(root / cid, HELIUM_CONFIG), marker)
        expect = ["tokenizer_config.json", "auto_map", "AutoTokenizer", "never runs code"]
    else:
        ckpt = with_code_config(model_with_tokenizer(root / cid), marker)
        expect = ["config.json", "auto_map", "AutoModelForCausalLM", "never runs code"]
    data = calib_text(root / f"{cid}-data" / "calib.txt")
    if command == "calibrate":
        out = _out(root, cid, "-amax.json")
        argv = ["calibrate", str(ckpt), "--calib-data", str(data), "-o", str(out)]
    else:
        out = _out(root, cid)
        argv = ["convert", str(ckpt), "-o", str(out), "--scales", "calibrate", "--calib-data",
                str(data)]
    return Case(cid, "code", argv, expect, marker=str(marker), outputs=[str(out)], stdin=YES,
                note=f"{' '.join(argv[:1])}: {what} auto_map → evil.py, no built-in class for it")


@case
def code_calibrate_tokenizer(root, cid):
    return _calibrating_code(root, cid, command="calibrate", what="tokenizer")


@case
def code_calibrate_config(root, cid):
    return _calibrating_code(root, cid, command="calibrate", what="config")


@case
def code_convert_calibrate_config(root, cid):
    return _calibrating_code(root, cid, command="convert", what="config")


@case
def code_convert_calibrate_tokenizer(root, cid):
    return _calibrating_code(root, cid, command="convert", what="tokenizer")


@case
def code_export_onnx(root, cid):
    marker = root / f"{cid}.PWNED"
    folder = with_code_config(fp8_folder(root, cid), marker)
    out = _out(root, cid, ".onnx")
    return Case(cid, "code", ["export-onnx", str(folder), "-o", str(out)],
                ["config.json", "auto_map", "AutoModelForCausalLM"], marker=str(marker),
                outputs=[str(out)], stdin=YES, note="FP8 folder whose config.json names code")


def _verify_code(root, cid, *, side: str, data: bool, what: str = "config"):
    marker = root / f"{cid}.PWNED"
    if what == "config" and side == "reference":
        ref, cand = with_code_config(model_with_tokenizer(root / cid), marker), valid_fp8(root)
    elif what == "config":
        ref, cand = valid_ref(root), with_code_config(fp8_folder(root, cid), marker)
    else:  # tokenizer payload in the reference (verify tokenises with the reference's)
        from fp8export import api
        from fp8export.convert.config import ConvertConfig

        ref = with_code_tokenizer(model_with_tokenizer(root / cid, HELIUM_CONFIG), marker)
        cand = root / f"{cid}-fp8"
        api.convert(ConvertConfig(checkpoint=ref, output=cand, scales="weights"))
    expect = (["config.json", "auto_map", "AutoModelForCausalLM"] if what == "config"
              else ["tokenizer_config.json", "auto_map", "AutoTokenizer"])
    report = _out(root, cid, "-report")
    argv = ["verify", str(ref), str(cand), "--report-dir", str(report), "--device", "cpu"]
    if data:
        argv += ["--data", str(calib_text(root / f"{cid}-data" / "eval.txt"))]
    return Case(cid, "code", argv, expect, marker=str(marker), outputs=[str(report)],
                stdin=YES, note=f"verify, {what} payload in the {side}"
                                f"{' with --data' if data else ' (built-in samples)'}")


@case
def code_verify_reference(root, cid):
    return _verify_code(root, cid, side="reference", data=False)


@case
def code_verify_reference_data(root, cid):
    return _verify_code(root, cid, side="reference", data=True)


@case
def code_verify_candidate(root, cid):
    return _verify_code(root, cid, side="candidate", data=False)


@case
def code_verify_candidate_data(root, cid):
    return _verify_code(root, cid, side="candidate", data=True)


@case
def code_verify_reference_tokenizer(root, cid):
    return _verify_code(root, cid, side="reference", data=False, what="tokenizer")


@case
def code_verify_reference_tokenizer_data(root, cid):
    return _verify_code(root, cid, side="reference", data=True, what="tokenizer")


# ------------------------------------------------------------------- reading outside paths

def token_npz(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, input_ids=np.arange(4, 36, dtype=np.int64).reshape(4, 8))
    return path


@case
def paths_tokenizer_fifo(root, cid):
    """``verify DIR/model.safetensors --data x.npz``: the pad id is looked up in DIR's
    tokenizer_config.json, here a FIFO (an unguarded read blocks for ever)."""
    ref = model_with_tokenizer(root / cid)
    (ref / "tokenizer_config.json").unlink()
    os.mkfifo(ref / "tokenizer_config.json")
    report = _out(root, cid, "-report")
    data = token_npz(root / f"{cid}-data" / "eval.npz")
    return Case(cid, "paths", ["verify", str(ref / "model.safetensors"), str(valid_fp8(root)),
                               "--data", str(data), "--report-dir", str(report), "--device",
                               "cpu"],
                ["tokenizer_config.json", "FIFO"], outputs=[str(report)], isolate=True,
                note="tokenizer_config.json is a named pipe")


@case
def paths_tokenizer_config_dev_zero(root, cid):
    ref = model_with_tokenizer(root / cid)
    (ref / "tokenizer_config.json").unlink()
    (ref / "tokenizer_config.json").symlink_to("/dev/zero")
    out = _out(root, cid, "-amax.json")
    data = token_npz(root / f"{cid}-data" / "calib.npz")
    return Case(cid, "paths", ["calibrate", str(ref), "--calib-data", str(data), "-o", str(out)],
                ["tokenizer_config.json", "outside"], outputs=[str(out)], isolate=True,
                note="tokenizer_config.json links to /dev/zero (reads until memory runs out)")


@case
def paths_data_fifo(root, cid):
    data = root / f"{cid}-data" / "calib.txt"
    data.parent.mkdir()
    os.mkfifo(data)
    out = _out(root, cid, "-amax.json")
    return Case(cid, "paths", ["calibrate", str(valid_ref(root)), "--calib-data", str(data),
                               "-o", str(out)], ["calib.txt", "FIFO"], outputs=[str(out)],
                note="the calibration data file is a named pipe")


@case
def paths_tokenizer_escapes(root, cid):
    ref = model_with_tokenizer(root / cid)
    outside = root / f"{cid}-outside-tokenizer.json"
    (ref / "tokenizer.json").rename(outside)
    (ref / "tokenizer.json").symlink_to(outside)
    out = _out(root, cid, "-amax.json")
    return Case(cid, "paths", ["calibrate", str(ref), "--calib-data",
                               str(calib_text(root / f"{cid}-data" / "calib.txt")), "-o", str(out)],
                ["tokenizer.json", "outside"], outputs=[str(out)],
                note="tokenizer.json is a symlink to a file outside the checkpoint")


# -------------------------------------------------------------------------------- outputs

@case
def outputs_calibrate_over_weights(root, cid):
    ckpt = model_with_tokenizer(root / cid)
    target = ckpt / "model.safetensors"
    return Case(cid, "outputs", ["calibrate", str(ckpt), "--calib-data",
                                 str(calib_text(root / f"{cid}-data" / "calib.txt")),
                                 "-o", str(target), "--force"],
                ["model.safetensors", "never writes into its input"],
                unchanged={str(target): sha256_file(target)},
                note="calibrate -o CKPT/model.safetensors --force (would replace the weights)")


@case
def outputs_calibrate_inside_checkpoint(root, cid):
    ckpt = model_with_tokenizer(root / cid)
    out = ckpt / "amax.json"
    return Case(cid, "outputs", ["calibrate", str(ckpt), "--calib-data",
                                 str(calib_text(root / f"{cid}-data" / "calib.txt")),
                                 "-o", str(out)],
                ["amax.json", "never writes into its input"], outputs=[str(out)],
                note="calibrate -o inside the checkpoint folder")


@case
def outputs_export_onnx_inside_folder(root, cid):
    folder = fp8_folder(root, cid)
    out = folder / "model.onnx"
    return Case(cid, "outputs", ["export-onnx", str(folder), "-o", str(out)],
                ["model.onnx", "never writes into its input"], outputs=[str(out)],
                note="export-onnx -o inside the FP8 folder")


@case
def outputs_report_inside_reference(root, cid):
    ref = model_with_tokenizer(root / cid)
    report = ref / "report"
    return Case(cid, "outputs", ["verify", str(ref), str(valid_fp8(root)), "--report-dir",
                                 str(report), "--device", "cpu"],
                ["--report-dir", "never writes into its input"], outputs=[str(report)],
                note="verify --report-dir inside the reference checkpoint")


@case
def outputs_engine_over_onnx(root, cid):
    p = onnx_model(root / f"{cid}.onnx")
    return Case(cid, "outputs", ["build-engine", str(p), "-o", str(p), "--force"],
                [p.name, "never writes into its input"], unchanged={str(p): sha256_file(p)},
                note="build-engine -o MODEL.onnx --force (would replace the graph)")


@case
def outputs_calibrate_unwritable(root, cid):
    out = Path("/proc") / f"fp8export-{os.getpid()}-{cid}.json"
    return Case(cid, "outputs", ["calibrate", str(valid_ref(root)), "--calib-data",
                                 str(calib_text(root / f"{cid}-data" / "calib.txt")),
                                 "-o", str(out)],
                [out.name, "cannot write"], outputs=[str(out)],
                note="-o in a location that refuses new files (/proc)")


@case
def outputs_export_onnx_unwritable(root, cid):
    out = Path("/proc") / f"fp8export-{os.getpid()}-{cid}.onnx"
    return Case(cid, "outputs", ["export-onnx", str(valid_fp8(root)), "-o", str(out)],
                [out.name, "cannot write"], outputs=[str(out)],
                note="export-onnx -o in a location that refuses new files (/proc)")


@case
def outputs_report_unwritable(root, cid):
    report = Path("/proc") / f"fp8export-{os.getpid()}-{cid}"
    return Case(cid, "outputs", ["verify", str(valid_ref(root)), str(valid_fp8(root)),
                                 "--report-dir", str(report), "--device", "cpu"],
                [report.name, "cannot write"], outputs=[str(report)],
                note="verify --report-dir in a location that refuses new folders (/proc)")


# ---------------------------------------------------------------------------------- sizes

def _config_case(root, cid, change: dict, expect, note, *, command="calibrate", raw=None):
    ckpt = model_with_tokenizer(root / cid)
    if raw is not None:
        (ckpt / "config.json").write_bytes(raw)
    else:
        (ckpt / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **change}))
    if command == "calibrate":
        out = _out(root, cid, "-amax.json")
        argv = ["calibrate", str(ckpt), "--calib-data",
                str(calib_text(root / f"{cid}-data" / "calib.txt")), "-o", str(out)]
    else:
        out = _out(root, cid)
        argv = ["convert", str(ckpt), "-o", str(out)]
    return Case(cid, "config", argv, ["config.json", *expect], outputs=[str(out)], note=note)


@case
def sizes_vocab_not_the_weights(root, cid):
    return _config_case(root, cid, {"vocab_size": 1 << 24}, ["embed_tokens", "shape"],
                        "vocab_size 2^24 for 64-row weights: 2 GiB allocated before the check")


@case
def sizes_vocab_absurd(root, cid):
    return _config_case(root, cid, {"vocab_size": 10**12}, ["vocab_size"],
                        "vocab_size 10^12")


@case
def sizes_layers_absurd(root, cid):
    return _config_case(root, cid, {"num_hidden_layers": 1000}, ["num_hidden_layers", "0..0"],
                        "1000 layers declared, 1 in the weights")


@case
def sizes_stride0_pt(root, cid):
    p = root / f"{cid}.pt"
    base = torch.ones(1, dtype=torch.bfloat16)
    torch.save({"fc.weight": base.expand(10**6, 10**6)}, p)
    out = _out(root, cid)
    return Case(cid, "sizes", ["convert", str(p), "-o", str(out)],
                [p.name, "fc.weight", "overlap"], outputs=[str(out)], isolate=True,
                note="a 2-byte storage expanded (stride 0) to 10^12 elements")


@case
def sizes_overlapping_pt(root, cid):
    p = root / f"{cid}.pt"
    torch.save({"fc.weight": torch.ones(64).as_strided((H, H), (1, 1))}, p)
    out = _out(root, cid)
    return Case(cid, "sizes", ["convert", str(p), "-o", str(out)],
                [p.name, "fc.weight", "overlap"], outputs=[str(out)],
                note="overlapping strides: 256 elements from a 64-element storage")


@case
def sizes_data_huge_line(root, cid):
    data = root / f"{cid}-data" / "calib.txt"
    data.parent.mkdir()
    data.write_text("w1 " * (1 << 20) + "\n")  # 3 MiB, one line
    out = _out(root, cid, "-amax.json")
    return Case(cid, "sizes", ["calibrate", str(valid_ref(root)), "--calib-data", str(data),
                               "-o", str(out)], ["calib.txt:1", "longer than"],
                outputs=[str(out)], note="one 3 MiB line (the tokenizer aborts on ~1.5 GB)")


def _npz_case(root, cid, arrays: dict, expect, note, command="calibrate"):
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = root / f"{cid}-data" / "data.npz"
    data.parent.mkdir()
    data.write_bytes(buf.getvalue())
    if command == "calibrate":
        out = _out(root, cid, "-amax.json")
        argv = ["calibrate", str(valid_ref(root)), "--calib-data", str(data), "-o", str(out)]
    else:
        out = _out(root, cid, "-report")
        argv = ["verify", str(valid_ref(root)), str(valid_fp8(root)), "--data", str(data),
                "--report-dir", str(out), "--device", "cpu"]
    return Case(cid, "sizes", argv, ["data.npz", *expect], outputs=[str(out)], note=note)


@case
def sizes_token_ids_beyond_vocab(root, cid):
    return _npz_case(root, cid, {"input_ids": np.full((2, 8), V + 5, dtype=np.int64)},
                     ["token id 69", "vocabulary"], "input_ids >= vocab_size")


@case
def sizes_token_ids_negative(root, cid):
    return _npz_case(root, cid, {"input_ids": np.full((2, 8), -3, dtype=np.int64)},
                     ["token id -3"], "negative input_ids")


@case
def sizes_labels_huge(root, cid):
    ids = np.ones((2, 8), dtype=np.int64)
    return _npz_case(root, cid, {"input_ids": ids, "labels": np.full((2, 8), 2**40)},
                     ["label"], "per-token labels of 2^40", command="verify")


@case
def sizes_jsonl_label_huge(root, cid):
    data = root / f"{cid}-data" / "eval.jsonl"
    data.parent.mkdir()
    data.write_text("\n".join(json.dumps({"text": "w1 w2 w3", "label": 10**30})
                              for _ in range(3)) + "\n")
    out = _out(root, cid, "-report")
    return Case(cid, "sizes", ["verify", str(valid_ref(root)), str(valid_fp8(root)), "--data",
                               str(data), "--report-dir", str(out), "--device", "cpu"],
                ["eval.jsonl", "label"], outputs=[str(out)], note="a label of 10^30")


@case
def sizes_npz_header_lies(root, cid):
    """An .npy member whose header declares 10^10 int64 ids over 64 bytes of data."""
    import zipfile

    from numpy.lib import format as npy

    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False,
                                     "shape": (100_000, 100_000)})
    buf.write(np.ones(8, dtype=np.int64).tobytes())
    data = root / f"{cid}-data" / "data.npz"
    data.parent.mkdir()
    with zipfile.ZipFile(data, "w") as zf:
        zf.writestr("input_ids.npy", buf.getvalue())
    out = _out(root, cid, "-amax.json")
    return Case(cid, "sizes", ["calibrate", str(valid_ref(root)), "--calib-data", str(data),
                               "-o", str(out)], ["data.npz", "input_ids", "declares shape"],
                outputs=[str(out)], note="npy header declares 10^10 elements, 64 bytes follow")


# -------------------------------------------------------------------------------- parsing

@case
def parse_config_deep_nesting(root, cid):
    raw = b'{"model_type": "llama", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return _config_case(root, cid, {}, ["nests deeper"], "config.json nested 100 000 deep",
                        command="convert", raw=raw)


@case
def parse_config_huge_integer(root, cid):
    raw = json.dumps(LLAMA_CONFIG).encode().replace(b'"vocab_size": 64',
                                                    b'"vocab_size": ' + b"9" * 5000)
    return _config_case(root, cid, {}, ["integer of 5000 digits"],
                        "a 5000-digit integer (beyond Python's int parsing limit)",
                        command="convert", raw=raw)


@case
def parse_config_wrong_type(root, cid):
    return _config_case(root, cid, {"num_attention_heads": "four"}, ["num_attention_heads"],
                        "a size given as a string")


@case
def parse_config_zero_heads(root, cid):
    return _config_case(root, cid, {"num_attention_heads": 0}, ["num_attention_heads"],
                        "zero attention heads")


@case
def parse_config_negative_size(root, cid):
    return _config_case(root, cid, {"intermediate_size": -5}, ["intermediate_size"],
                        "a negative size")


@case
def parse_config_unknown_activation(root, cid):
    return _config_case(root, cid, {"hidden_act": "definitely_not_an_activation"},
                        ["definitely_not_an_activation"],
                        "an activation transformers does not have")


@case
def parse_config_heads_do_not_divide(root, cid):
    return _config_case(root, cid, {"num_attention_heads": 3, "num_key_value_heads": 3}, [],
                        "heads that do not divide the hidden size")


@case
def parse_config_attention_not_installed(root, cid):
    c = _config_case(root, cid, {"_attn_implementation": "flash_attention_3"}, [],
                     "an attention kernel that is not installed: ignored, sdpa used (exit 0)")
    c.exit, c.expect = 0, []
    return c


@case
def parse_index_deep_nesting(root, cid):
    p = sharded_folder(root / cid)
    (p / "model.safetensors.index.json").write_bytes(
        b'{"weight_map": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    out = _out(root, cid)
    return Case(cid, "parsing", ["convert", str(p), "-o", str(out)],
                ["model.safetensors.index.json", "nests deeper"], outputs=[str(out)],
                note="index nested 50 000 deep")


def _amax_case(root, cid, doc: dict, expect, note):
    path = root / f"{cid}-amax.json"
    path.write_text(json.dumps(doc))
    out = _out(root, cid)
    return Case(cid, "parsing", ["convert", str(valid_ref(root)), "-o", str(out), "--scales",
                                 "calibrate", "--calib-amax", str(path)],
                [path.name, *expect], outputs=[str(out)], note=note)


AMAX = {"format": "fp8export-amax", "version": 1, "method": "max", "samples": 4, "tokens": 32,
        "modules": {"model.layers.0.self_attn.q_proj": {"amax": 2.0}}}


@case
def parse_amax_options_list(root, cid):
    return _amax_case(root, cid, {**AMAX, "options": ["percentile", 99]}, ["options"],
                      "amax.json options is a list")


@case
def parse_amax_observed_string(root, cid):
    doc = {**AMAX, "modules": {"model.layers.0.self_attn.q_proj": {"amax": 2.0,
                                                                   "observed_amax": "big"}}}
    return _amax_case(root, cid, doc, ["observed_amax"], "observed_amax is a string")


@case
def parse_amax_version_huge(root, cid):
    path = root / f"{cid}-amax.json"
    path.write_text(json.dumps(AMAX).replace('"version": 1', '"version": ' + "7" * 5000))
    out = _out(root, cid)
    return Case(cid, "parsing", ["convert", str(valid_ref(root)), "-o", str(out), "--scales",
                                 "calibrate", "--calib-amax", str(path)],
                [path.name, "integer of 5000 digits"], outputs=[str(out)],
                note="a 5000-digit version number")


@case
def parse_manifest_wrong_types(root, cid):
    d = fp8_folder(root, cid)
    manifest = json.loads((d / "fp8export.json").read_text())
    first = next(iter(manifest["quantized"]))
    manifest["quantized"][first] = ["not", "an", "object"]
    (d / "fp8export.json").write_text(json.dumps(manifest))
    out = _out(root, cid, ".onnx")
    return Case(cid, "parsing", ["export-onnx", str(d), "-o", str(out)],
                ["fp8export.json", "not an object"], outputs=[str(out)],
                note="a manifest entry that is a list")


@case
def parse_tokenizer_config_deep(root, cid):
    ckpt = model_with_tokenizer(root / cid)
    (ckpt / "tokenizer_config.json").write_bytes(
        b'{"tokenizer_class": "PreTrainedTokenizerFast", "x": ' + b"[" * 100_000
        + b"]" * 100_000 + b"}")
    out = _out(root, cid, "-amax.json")
    return Case(cid, "parsing", ["calibrate", str(ckpt), "--calib-data",
                                 str(calib_text(root / f"{cid}-data" / "calib.txt")),
                                 "-o", str(out)],
                ["tokenizer_config.json", "nests deeper"], outputs=[str(out)],
                note="tokenizer_config.json nested 100 000 deep")


def _pt_case(root, cid, state, expect, note):
    p = root / f"{cid}.pt"
    torch.save(state, p)
    out = _out(root, cid)
    return Case(cid, "parsing", ["convert", str(p), "-o", str(out)], [p.name, *expect],
                outputs=[str(out)], note=note)


@case
def parse_pt_meta_tensor(root, cid):
    return _pt_case(root, cid, {"fc.weight": torch.empty(H, H, device="meta")},
                    ["fc.weight", "meta tensor"], "a meta tensor (shape without data)")


@case
def parse_pt_nested_tensor(root, cid):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.ones(2, H), torch.ones(3, H)])
    return _pt_case(root, cid, {"fc.weight": nested}, ["fc.weight", "nested tensor"],
                    "a nested (ragged) tensor")


@case
def parse_pt_deep_nesting(root, cid):
    import sys

    state: dict = {"w": torch.ones(2, 2)}
    for _ in range(3000):
        state = {"a": state}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # torch.save pickles nested dicts recursively
    try:
        return _pt_case(root, cid, state, ["nested more than"], "dicts nested 3000 deep")
    finally:
        sys.setrecursionlimit(limit)


@case
def parse_pt_zero_size_weight(root, cid):
    p = root / f"{cid}.pt"
    torch.save({"fc.weight": torch.ones(0, H), "fc2.weight": torch.randn(H, H)}, p)
    out = _out(root, cid)
    return Case(cid, "parsing", ["convert", str(p), "-o", str(out)], [], exit=0,
                outputs=[str(out)], note="a zero-size linear weight: kept as is (fallback)",
                manifest=[[["excluded", "fc.weight"], "empty weight (no elements)"]])


@case
def parse_onnx_garbage_inspect(root, cid):
    p = root / f"{cid}.onnx"
    p.write_bytes(b"\x08\x0a\x12" + bytes(range(256)) * 4)
    return Case(cid, "parsing", ["inspect", str(p)], [p.name, "not a readable ONNX"],
                note="inspect: bytes that are not ONNX")


def _escaping_onnx(root: Path, cid: str) -> Path:
    import onnx
    from onnx import TensorProto

    p = onnx_model(root / f"{cid}.onnx")
    model = onnx.load(str(p))
    t = next(t for t in model.graph.initializer if t.name == "w_scale")  # the checker reads it
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../../../../etc/hostname"), ("offset", "0"),
                       ("length", "4")):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(p))
    return p


@case
def parse_onnx_external_escape_inspect(root, cid):
    p = _escaping_onnx(root, cid)
    return Case(cid, "parsing", ["inspect", str(p)], [p.name, "outside"],
                note="external data at ../../../../etc/hostname")


@case
def parse_onnx_external_escape_engine(root, cid):
    p = _escaping_onnx(root, cid)
    out = _out(root, cid, ".engine")
    return Case(cid, "parsing", ["build-engine", str(p), "-o", str(out)], [p.name, "outside"],
                outputs=[str(out)], note="build-engine: external data escaping the folder")


# ----------------------------------------------------------------------------------- onnx

def loop_model(path: Path, trips: int = 10**15) -> Path:
    """A graph whose only op is a Loop of ``trips`` iterations (input_ids in, logits out)."""
    import onnx
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["x_in", "one"], ["x_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [1, 1, V])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [1, 1, V])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "cond", "x0"], ["logits"], body=body)], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, V])],
        [helper.make_tensor("trips", TensorProto.INT64, [], [trips]),
         helper.make_tensor("cond", TensorProto.BOOL, [], [True]),
         helper.make_tensor("x0", TensorProto.FLOAT, [1, 1, V], [0.0] * V)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


@case
def onnx_verify_endless_loop(root, cid):
    p = loop_model(root / f"{cid}.onnx")
    report = _out(root, cid, "-report")
    return Case(cid, "onnx/verify", ["verify", str(valid_ref(root)), str(p), "--report-dir",
                                     str(report), "--device", "cpu"],
                [p.name, "Loop", "not an op export-onnx emits"], outputs=[str(report)],
                isolate=True, note="a Loop of 10^15 iterations (verify would never end)")
