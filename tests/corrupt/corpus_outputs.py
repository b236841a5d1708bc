"""Corpus cases, third round (1 of 2): careless outputs, edited FP8 folders, thresholds that
check nothing, provenance, terminal escapes.

Registered into ``make_corpus.BUILDERS`` (same :class:`Case` contract). Classes:

* **data-loss** — an output path that is, or holds, an input (the data being read, the
  thresholds file), ``--force`` over a folder fp8export did not write, over a FIFO, over a
  symlinked ``.data`` sibling, over a hard link to the input. Each keeps every byte
  (``unchanged``).
* **fp8-edited** — an FP8 folder edited after convert: a layer dropped from the manifest, a
  layer pointed at another's weight, a stray ``input_scale``, a BOOL or 3e38 ``weight_scale``,
  an E5M2 embedding, config.json without (or ignoring everything in) its
  ``quantization_config``.
* **thresholds** — files that check nothing (only ``kl_mean: null``; only ``accuracy_drop`` on
  a causal LM).
* **provenance** — FP8 codes flipped after convert; ``--calib-amax`` recorded for another
  checkpoint.
* **escapes** — terminal control sequences in manifest notes and tensor names.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from corpus_files import Case, hf_folder, llama_tensors, sha256_file
from corpus_untrusted import calib_text, valid_fp8, valid_ref

BUILDERS = []


def case(fn):
    BUILDERS.append(fn)
    return fn


def _out(root: Path, cid: str, suffix: str = "") -> Path:
    return root / "out" / f"{cid}{suffix}"


def _keep(*paths: Path) -> dict[str, str]:
    return {str(p): sha256_file(p) for p in paths}


# ------------------------------------------------------------------------------ data loss

@case
def loss_force_foreign_folder(root, cid):
    """``convert ck -o precious --force``: a folder of someone else's files."""
    precious = root / cid
    precious.mkdir()
    (precious / "important.txt").write_text("quarterly numbers\n")
    (precious / "notes.md").write_text("# notes\n")
    return Case(cid, "data-loss", ["convert", str(valid_ref(root)), "-o", str(precious),
                                   "--force"],
                [cid, "did not write", "important.txt", "fp8export.json"],
                unchanged=_keep(precious),
                note="--force over a folder without our manifest (would delete its files)")


@case
def loss_calibrate_over_its_data(root, cid):
    data = calib_text(root / cid / "mydata.txt")
    return Case(cid, "data-loss", ["calibrate", str(valid_ref(root)), "--calib-data", str(data),
                                   "-o", str(data), "--force"],
                ["mydata.txt", "is the input", "never writes into its input"],
                unchanged=_keep(data), note="calibrate -o DATA --force (the data it reads)")


@case
def loss_convert_holds_its_data(root, cid):
    out = root / cid / "out"
    data = calib_text(out / "calib.txt")
    return Case(cid, "data-loss", ["convert", str(valid_ref(root)), "-o", str(out), "--force",
                                   "--scales", "calibrate", "--calib-data", str(data)],
                ["contains the input", "calib.txt"], unchanged=_keep(out),
                note="convert -o OUT --force with --calib-data OUT/calib.txt")


@case
def loss_report_over_thresholds(root, cid):
    rep = root / cid / "rep"
    rep.mkdir(parents=True)
    thresholds = rep / "report.json"
    thresholds.write_text(json.dumps({"kl_mean": 0.5}))
    return Case(cid, "data-loss", ["verify", str(valid_ref(root)), str(valid_fp8(root)),
                                   "--thresholds", str(thresholds), "--report-dir", str(rep),
                                   "--device", "cpu"],
                ["--report-dir", "report.json", "never writes into its input"],
                unchanged=_keep(rep),
                note="verify --thresholds rep/report.json --report-dir rep")


@case
def loss_force_over_fifo(root, cid):
    fifo = root / cid / "dev.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    return Case(cid, "data-loss", ["calibrate", str(valid_ref(root)), "--calib-data",
                                   str(calib_text(root / f"{cid}-data" / "calib.txt")),
                                   "-o", str(fifo), "--force"],
                ["dev.json", "FIFO", "only regular files"], unchanged=_keep(fifo),
                note="-o FIFO --force (as root, -o /dev/null --force would replace the node)")


@case
def loss_onnx_data_symlink(root, cid):
    """export-onnx writes ``<graph>.data`` beside the graph: a symlink planted there leads
    elsewhere and is never replaced or written through."""
    folder = root / cid
    folder.mkdir()
    victim = folder / "victim.bin"
    victim.write_bytes(b"precious bytes")
    graph = folder / "m.onnx"
    (folder / "m.onnx.data").symlink_to(victim)
    return Case(cid, "data-loss", ["export-onnx", str(valid_fp8(root)), "-o", str(graph),
                                   "--force"],
                ["m.onnx.data", "symbolic link"], outputs=[str(graph)],
                unchanged=_keep(victim, folder / "m.onnx.data"),
                note="export-onnx --force with m.onnx.data a symlink to another file")


@case
def loss_output_hard_link_to_data(root, cid):
    data = calib_text(root / cid / "calib.txt")
    alias = root / cid / "amax.json"
    os.link(data, alias)  # the same file under a second name
    return Case(cid, "data-loss", ["calibrate", str(valid_ref(root)), "--calib-data", str(data),
                                   "-o", str(alias), "--force"],
                ["amax.json", "is the input", "calib.txt"], unchanged=_keep(data),
                note="-o a hard link to the calibration data, --force")


# ----------------------------------------------------------------- thresholds that check nothing

def _thresholds_case(root, cid, name: str, text: str, expect, note, exit_code=1):
    path = root / cid / name
    path.parent.mkdir()
    path.write_text(text)
    report = _out(root, cid, "-report")
    force = ["--force"] if exit_code == 3 else []  # its reports exist after the first run
    return Case(cid, "thresholds", ["verify", str(valid_ref(root)), str(valid_fp8(root)),
                                    "--thresholds", str(path), "--report-dir", str(report),
                                    "--device", "cpu", "--no-noise-floor", *force],
                [name, *expect] if exit_code == 1 else list(expect), exit=exit_code,
                outputs=[str(report)] if exit_code == 1 else [], note=note)


@case
def thresholds_only_null(root, cid):
    return _thresholds_case(root, cid, "t.json", '{"kl_mean": null}', ["sets no bound"],
                            "a thresholds file whose only bound is kl_mean: null")


@case
def thresholds_nothing_applies(root, cid):
    """Verification runs (the task is known only then) and fails: exit 3, reports written."""
    return _thresholds_case(root, cid, "t.yaml", "accuracy_drop: 0.01\n",
                            ["no threshold applies", "accuracy_drop"],
                            "only accuracy_drop (a classifier's metric) for a causal LM",
                            exit_code=3)


@case
def thresholds_yaml_billion_laughs(root, cid):
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 9):
        name, prev = chr(ord("a") + i), chr(ord("a") + i - 1)
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    c = _thresholds_case(root, cid, "t.yaml", "\n".join(lines) + "\nkl_mean: 0.02\n",
                         ["YAML alias"], "458 bytes of nested aliases: 9^9 nodes once expanded")
    c.isolate = True  # unguarded it expands to gigabytes: never in the test process
    return c


# ------------------------------------------------------------------------- terminal escapes
# Sequences a terminal obeys: set the window title, clear the screen, paint a green PASSED.
ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[32mPASSED\x1b[0m\x9b2J\u202e"


@case
def escapes_manifest_note_inspect(root, cid):
    folder = valid_fp8(root).parent / cid
    import shutil

    shutil.copytree(valid_fp8(root), folder)
    manifest = json.loads((folder / "fp8export.json").read_text())
    manifest["notes"] = [f"converted fine {ESCAPES}"]
    first = next(iter(manifest["quantized"]))
    (folder / "fp8export.json").write_text(json.dumps(manifest))
    c = Case(cid, "escapes", ["inspect", str(folder)], [], exit=0,
             note=f"inspect: a manifest note holding {ESCAPES!r} (layer {first})")
    return c


@case
def escapes_tensor_name_convert(root, cid):
    t = llama_tensors()
    t[f"model.layers.0.{ESCAPES}.weight"] = t["model.norm.weight"].clone()
    ckpt = hf_folder(root / cid, t)
    out = _out(root, cid)
    return Case(cid, "escapes", ["convert", str(ckpt), "-o", str(out)], [], exit=0,
                outputs=[str(out)], note="convert prints the tensors it keeps: one named with "
                                          "escape sequences")


@case
def escapes_in_an_error_message(root, cid):
    folder = root / cid / f"ck{ESCAPES[:12]}"
    hf_folder(folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = _out(root, cid)
    return Case(cid, "escapes", ["convert", str(folder), "-o", str(out)],
                ["\\x1b]0;owned\\x07", "truncated"], outputs=[str(out)],
                note="an error naming a folder whose name holds escape sequences")


# ------------------------------------------------------------------- edited FP8 folders
# The one FP8-folder reader (fp8export/fp8dir/reader.py, used by export-onnx, verify, inspect and
# the runtime) runs fp8dir/validate.py's checks on every folder convert wrote.


def _edited(root: Path, cid: str, edit_manifest=None, edit_header=None, edit_config=None,
            edit_values=None, add_f32=None) -> Path:
    """A copy of the shared FP8 folder with its manifest, safetensors header (dtypes, shapes;
    the data bytes kept), tensor values or config.json edited, or F32 ``[1]`` tensors added
    (``add_f32``: name -> value)."""
    import shutil

    import numpy as np

    folder = root / cid
    shutil.copytree(valid_fp8(root), folder)
    if edit_manifest:
        m = json.loads((folder / "fp8export.json").read_text())
        edit_manifest(m)
        (folder / "fp8export.json").write_text(json.dumps(m))
    if edit_config:
        c = json.loads((folder / "config.json").read_text())
        edit_config(c)
        (folder / "config.json").write_text(json.dumps(c))
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), bytearray(raw[8 + n:])
    if edit_values:
        for name, value in edit_values.items():
            begin, _ = header[name]["data_offsets"]
            data[begin:begin + 4] = np.float32(value).tobytes()
    if edit_header:
        edit_header(header)
    for name, value in (add_f32 or {}).items():
        header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
        data += np.float32(value).tobytes()
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + bytes(data))
    return folder


O_PROJ = "model.layers.0.self_attn.o_proj"


def _inspect(cid, folder, expect, note):
    return Case(cid, "fp8-edited", ["inspect", str(folder)], expect, note=note)


@case
def fp8_manifest_drops_a_layer(root, cid):
    folder = _edited(root, cid, edit_manifest=lambda m: m["quantized"].pop(O_PROJ))
    out = _out(root, cid, ".onnx")
    return Case(cid, "fp8-edited", ["export-onnx", str(folder), "-o", str(out)],
                ["belong to no layer", f"{O_PROJ}.weight"], outputs=[str(out)],
                note="export-onnx: a layer dropped from the manifest (its E4M3 codes were used "
                     "unscaled)")


@case
def fp8_layer_points_at_another_weight(root, cid):
    def edit(m):
        m["quantized"][O_PROJ]["weight"] = "model.layers.0.mlp.down_proj.weight"

    return _inspect(cid, _edited(root, cid, edit_manifest=edit),
                    [O_PROJ, "points it at model.layers.0.mlp.down_proj.weight"],
                    "a layer pointed at another layer's weight")


@case
def fp8_stray_input_scale(root, cid):
    folder = _edited(root, cid, add_f32={f"{O_PROJ}.input_scale": 1e-30})
    return _inspect(cid, folder, [f"{O_PROJ}.input_scale", "dynamic"],
                    "a stray input_scale of 1e-30 beside a layer with dynamic activations")


@case
def fp8_weight_scale_bool(root, cid):
    def header(h):
        h[f"{O_PROJ}.weight_scale"].update(dtype="BOOL", shape=[4])

    return _inspect(cid, _edited(root, cid, edit_header=header),
                    [f"{O_PROJ}.weight_scale", "BOOL"], "a weight_scale stored as BOOL (read "
                                                         "as 1.0)")


@case
def fp8_weight_scale_huge(root, cid):
    return _inspect(cid, _edited(root, cid, edit_values={f"{O_PROJ}.weight_scale": 3e38}),
                    [f"{O_PROJ}.weight_scale", "outside"], "a weight_scale of 3e38")


@case
def fp8_embedding_as_e5m2(root, cid):
    def header(h):
        entry = h["model.embed_tokens.weight"]
        entry.update(dtype="F8_E5M2", shape=[entry["shape"][0] * 2, entry["shape"][1]])

    return _inspect(cid, _edited(root, cid, edit_header=header),
                    ["model.embed_tokens.weight", "belong to no layer"],
                    "the embedding stored as F8_E5M2")


@case
def fp8_config_without_quantization_config(root, cid):
    folder = _edited(root, cid, edit_config=lambda c: c.pop("quantization_config"))
    report = _out(root, cid, "-report")
    return Case(cid, "fp8-edited", ["verify", str(valid_ref(root)), str(folder), "--report-dir",
                                    str(report), "--device", "cpu", "--no-noise-floor"],
                ["config.json has no quantization_config"], outputs=[str(report)],
                note="verify: config.json lost quantization_config (engines load by it)")


@case
def fp8_config_ignores_everything(root, cid):
    def edit(c):
        c["quantization_config"]["ignore"] = ["re:.*"]

    return _inspect(cid, _edited(root, cid, edit_config=edit),
                    ["quantization_config differs", "ignore"],
                    "config.json's ignore list matching every layer")
