"""``export-onnx``: FP8 folder → standard ONNX Q/DQ graph (DESIGN.md "ONNX profile").

Steps: read and validate the FP8 folder (:mod:`fp8export.fp8dir.reader`); build the transformers
model from its config.json with the dequantized weights (a Keras config: the model rebuilt by
:mod:`fp8export.keras_model`, no Keras); trace it with torch's ONNX exporter
(dynamic batch and sequence, no KV cache); rewrite every quantized linear into the FP8 Q/DQ
pattern (:mod:`fp8export.onnx.qdq`); check the result with ``onnx.checker`` (full check) and our
TensorRT-rule checker (:mod:`fp8export.onnx.check`); write it atomically.

Exporter choice: the dynamo exporter (``torch.onnx.export(..., dynamo=True)``, torch.export +
onnxscript). Tried on Llama with transformers 5.23 and torch 2.13, both exporters trace with
dynamic batch/sequence axes and match eager logits, but only the dynamo one

* is the maintained path (the TorchScript exporter is deprecated since torch 2.9),
* emits opset 21/23 directly (TorchScript stops at opset 20; we would need the version
  converter for Q/DQ's opset-21 semantics),
* records, on every node, the module that produced it (``pkg.torch.onnx.name_scopes``), so each
  quantized linear binds to its MatMul by provenance, not only by content,
* folds the ``weight.T`` of ``nn.Linear`` into a pre-transposed ``[in, out]`` initializer, so
  the graph already has the "no Transpose between DQ and MatMul" shape TensorRT wants.

Known difference: for a query position whose attention mask row is all zeros (left padding),
the dynamo graph's logits differ from eager torch's (both are meaningless there; every
unmasked position matches to ~1e-7 in fp32). Compare logits on unmasked positions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import secrets
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8export._progress import stage
from fp8export.config import StrEnum
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.notes import Note, NoteKind, kind_of

DEFAULT_OPSET = 21
BF16_OPSET = 23  # bf16 activations with fp32 scales need opset 23 (Q/DQ scale type decoupled)
MIN_OPSET, MAX_OPSET = 21, 23
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's hard limit is 2 GiB; leave headroom
# The written graph runs once per onnxruntime optimization level (onnx/levels.py); above this
# much weight data four sessions cost more time and memory than the export, so it is skipped.
LEVEL_CHECK_BYTES = 1 << 30
INPUT_NAMES = ("input_ids", "attention_mask")
# Graph metadata (ModelProto.metadata_props): the longest sequence the model's positions allow,
# so build-engine's default profile stays within it.
MAX_POSITIONS_KEY = "fp8export.max_positions"
# A folder without any static input scale gives a graph whose GEMMs all run in 16-bit: said once,
# with the way to FP8 GEMMs, instead of once per layer.
WEIGHT_ONLY = ("no FP8 GEMMs: the folder has no static input scales (converted without "
               "calibration data or FP8 training history), so this graph is weight-only FP8 and "
               "TensorRT and onnxruntime run all {n} quantized GEMMs in 16-bit with dequantized "
               "weights. For FP8 GEMMs, convert with static input scales: fp8export convert CKPT "
               "--calib-data FILE (or from a checkpoint with FP8 training history).")


class OnnxDtype(StrEnum):
    """Activation dtype of the exported graph (``--dtype``)."""

    FP16 = "fp16"
    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def torch_dtype(self):
        import torch

        return {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[self.value]


@dataclass(frozen=True)
class ExportOnnxConfig:
    """Options of ``fp8export export-onnx``."""

    fp8_dir: Path
    output: Path | None = None  # default: sibling "<fp8_dir>.onnx"
    dtype: OnnxDtype | None = None  # default fp16 (fp32 for Keras sources): resolved_dtype
    opset: int | None = None  # default 21 (23 for bf16): resolved_opset
    force: bool = False

    def __post_init__(self):
        object.__setattr__(self, "fp8_dir", Path(self.fp8_dir))
        if self.output is not None:
            object.__setattr__(self, "output", Path(self.output))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", OnnxDtype.parse(self.dtype, "--dtype"))
        if self.opset is not None and not MIN_OPSET <= int(self.opset) <= MAX_OPSET:
            raise UsageError(
                f"--opset {self.opset}: supported opsets are {MIN_OPSET}..{MAX_OPSET} (FP8 Q/DQ "
                "needs >= 19; the profile uses 21, or 23 for bf16 with fp32 scales). "
                "Use --opset 21.")

    @property
    def resolved_output(self) -> Path:
        if self.output is not None:
            return self.output
        return self.fp8_dir.parent / f"{self.fp8_dir.name}.onnx"

    def resolved_dtype(self, keras: bool) -> OnnxDtype:
        """``--dtype``, else fp16 (fp32 for models converted from Keras)."""
        if self.dtype is not None:
            return self.dtype
        return OnnxDtype.FP32 if keras else OnnxDtype.FP16

    def resolved_opset(self, dtype: OnnxDtype) -> int:
        if self.opset is not None:
            return int(self.opset)
        return BF16_OPSET if dtype is OnnxDtype.BF16 else DEFAULT_OPSET


@dataclass
class ExportResult:
    """What ``export_onnx`` wrote and what TensorRT will make of it (JSON-serialisable)."""

    output: Path
    external_data: Path | None
    dtype: str
    opset: int
    ir_version: int
    file_bytes: int
    seconds: float
    fp8_gemms: list[str]  # quantized linears TensorRT can run in FP8
    sixteen_bit: dict[str, str]  # quantized linears it will run in 16-bit, with the reason
    output_name: str
    check: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    ort_levels: dict[str, Any] = field(default_factory=dict)  # LevelCheck.to_dict()
    weight_only: bool = False  # no layer has a static input scale: no FP8 GEMM at all
    trace_seconds: float = 0.0  # of ``seconds``, in torch.onnx.export (torch's exporter)

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": str(self.output), "weight_only": self.weight_only,
            "external_data": str(self.external_data) if self.external_data else None,
            "dtype": self.dtype, "opset": self.opset, "ir_version": self.ir_version,
            "file_bytes": self.file_bytes, "seconds": round(self.seconds, 3),
            "fp8_gemms": list(self.fp8_gemms), "sixteen_bit": dict(self.sixteen_bit),
            "output_name": self.output_name, "check": self.check, "notes": list(self.notes),
            "ort_levels": dict(self.ort_levels), "trace_seconds": round(self.trace_seconds, 3),
        }


# --------------------------------------------------------------------------------------------
# tracing

def build_torch_model(folder, dtype):
    """The transformers model of ``folder`` (an Fp8Folder) holding its dequantized weights."""
    import torch

    from fp8export.models import empty_model, hf_state, missing_tensors
    from fp8export.moe import stores_fused_experts, unfuse_experts

    model = empty_model(folder.config, folder.path, dtype=dtype,
                        shapes=folder.tensors.shapes())
    state = hf_state(model, folder.model_state(dtype), folder.path)
    expected = model.state_dict()
    loadable = {}
    for name, t in state.items():
        if name not in expected:
            continue
        if tuple(expected[name].shape) != tuple(t.shape):
            raise Fp8ExportError(
                f"{folder.path}: tensor {name} has shape {tuple(t.shape)} but the architecture in "
                f"config.json expects {tuple(expected[name].shape)}. Re-run `fp8export convert`.")
        loadable[name] = t
    missing = missing_tensors(model, loadable)
    if missing:
        raise Fp8ExportError(
            f"{folder.path}: {len(missing)} weights the architecture needs are missing, e.g. "
            f"{missing[:3]}. The FP8 folder does not match its config.json.")
    model.load_state_dict(loadable, strict=False)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    # the names on disk: hf_state fuses per-expert tensors into 3-D ones on load
    if not stores_fused_experts(folder.tensors):
        unfuse_experts(model, mode="dense")  # MoE: no data-dependent routing in the graph
    elif hasattr(model, "set_experts_implementation"):
        # 3-D experts stay transformers' (bf16) module; its batched_mm form gathers each
        # token's experts and traces, its default grouped_mm has no ONNX lowering
        model.set_experts_implementation("batched_mm")
    return model.eval().requires_grad_(False).to(torch.device("cpu"))


def graph_layers(folder) -> dict:
    """The folder's quantized layers under the names their modules have in the traced model
    (transformers renames some, e.g. Mixtral's ``block_sparse_moe`` is ``mlp``)."""
    from dataclasses import replace

    from fp8export.keras_model.config import is_keras_config
    from fp8export.models import empty_model, module_names

    if is_keras_config(folder.config):
        return dict(folder.layers)
    names = module_names(empty_model(folder.config, folder.path, meta=True), folder.layers)
    return {names.get(n, n): replace(layer, name=names.get(n, n))
            for n, layer in folder.layers.items()}


def _wrapper(model):
    import torch

    class _Logits(torch.nn.Module):
        """input_ids, attention_mask -> logits (or last hidden state); no KV cache."""

        def __init__(self, inner):
            super().__init__()
            self.model = inner  # name scopes start with "model.": qdq strips it

        def forward(self, input_ids, attention_mask):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            return out.logits if getattr(out, "logits", None) is not None \
                else out.last_hidden_state

    return _Logits(model)


def _hf_traceable(folder, dtype: OnnxDtype):
    """(module, example args, input names, dynamic shapes, output name) of a transformers model."""
    import torch

    model = build_torch_model(folder, dtype.torch_dtype)
    main = getattr(model, "main_input_name", "input_ids")
    if getattr(model.config, "is_encoder_decoder", False) and main != "input_ids":
        raise Fp8ExportError(
            f"{folder.path}: {type(model).__name__} is an encoder-decoder whose encoder reads "
            f"{main} (audio features), and export-onnx traces models that read token ids. "
            "Serve the FP8 folder directly (vLLM / the torch FP8 runner); verify checks it with "
            "audio data.")
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, max(vocab, 2), (2, 8), generator=gen, dtype=torch.int64)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        probe = model(input_ids=ids, attention_mask=mask)
    output_name = "logits" if getattr(probe, "logits", None) is not None else "last_hidden_state"
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    return _wrapper(model), (ids, mask), list(INPUT_NAMES), dynamic, output_name


def probe_feed(input_names: list[str], args) -> dict:
    """The trace's example inputs as an onnxruntime feed (numpy), to check the written graph."""
    return {name: arg.numpy() for name, arg in zip(input_names, args)}


def _keras_traceable(folder, dtype: OnnxDtype):
    """The same for a folder converted from Keras: the model rebuilt from its config, no Keras.

    One input, ``input_ids`` (a Keras model reads token ids only); the output is the Keras
    model's: ``probabilities`` behind a sigmoid/softmax head, else ``logits``.
    """
    import torch

    from fp8export.keras_model.build import keras_model_from_folder

    model = keras_model_from_folder(folder, dtype.torch_dtype)

    class _Ids(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner  # name scopes start with "model.": qdq strips it

        def forward(self, input_ids):
            return self.model(input_ids)

    longest = model.max_positions
    # random tokens, not padding: the same ids feed the check of the written graph (levels.py)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, max(int(model.vocab_size or 2), 2), (2, min(8, longest or 8)),
                        generator=gen, dtype=torch.int64)
    seq = torch.export.Dim("sequence", max=longest) if longest else torch.export.Dim("sequence")
    dynamic = {"input_ids": {0: torch.export.Dim("batch"), 1: seq}}
    output_name = "probabilities" if model.output_activation in ("sigmoid", "softmax") \
        else "logits"
    return _Ids(model), (ids,), ["input_ids"], dynamic, output_name


def trace_model(folder, dtype: OnnxDtype, opset: int):
    """Trace the model of ``folder`` to an ``onnx_ir.Model`` (dequantized weights, no Q/DQ):
    the exporter's own in-memory graph, which the Q/DQ rewrite edits before it is serialized.

    Returns ``(model, output_name, feed)``; ``feed``: the example inputs it traced with
    (numpy). The ``model.`` prefix of the node name scopes is the wrapper's;
    :func:`fp8export.onnx.qdq.module_of` strips it.
    """
    import torch

    from fp8export.keras_model.config import is_keras_config
    from fp8export.models import max_positions

    keras = is_keras_config(folder.config)
    wrapped, args, input_names, dynamic, output_name = (
        _keras_traceable if keras else _hf_traceable)(folder, dtype)
    arch = "Keras " + str(folder.config.get("class_name")) if keras else \
        (folder.config.get("architectures") or [folder.config.get("model_type", "?")])[0]
    sink = io.StringIO()
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "torchvision is not installed" chatter
    try:
        with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                wrapped, args, dynamo=True, opset_version=opset, input_names=input_names,
                output_names=[output_name], dynamic_shapes=dynamic, optimize=True,
                verbose=False, report=False)
    except Exception as exc:  # the exporter raises many types; all mean "cannot trace"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Fp8ExportError(
            f"{folder.path}: torch.onnx (dynamo) could not trace architecture {arch} with dynamic "
            f"batch/sequence: {first}. Use a transformers version that supports torch.export for "
            "this model, or serve the FP8 folder directly (vLLM / the torch FP8 runner).") from exc
    finally:
        quiet.setLevel(level)
    model = program.model
    fixed = fixed_dims(model, dynamic)
    if fixed:
        raise Fp8ExportError(
            f"{folder.path}: torch.onnx (dynamo) traced architecture {arch} with {fixed}: its "
            "forward loops over the tokens in Python (a recurrent layer's scan without its "
            "kernels: Mamba, Gated DeltaNet), so the graph would take inputs of that shape "
            "only. Serve the FP8 folder directly (vLLM / the torch FP8 runner); verify checks it "
            "without ONNX.")
    if model.graph.outputs[0].name != output_name:  # exporter may rename; keep the contract
        model.graph.outputs[0].name = output_name
    longest = wrapped.model.max_positions if keras else max_positions(folder.config)
    if longest:
        model.metadata_props[MAX_POSITIONS_KEY] = str(int(longest))
    return model, output_name, probe_feed(input_names, args)


def fixed_dims(model, dynamic: dict) -> str:
    """The axes ``dynamic`` declared dynamic that the traced ``model`` (an ``onnx_ir.Model``)
    fixed to a size (the exporter specializes an axis a Python loop runs over), as
    ``"input_ids sequence = 8"``; empty when every one stayed symbolic."""
    fixed = []
    for value in model.graph.inputs:
        for axis, dim in (dynamic.get(value.name) or {}).items():
            size = value.shape[axis] if value.shape is not None else None
            if isinstance(size, int):
                fixed.append(f"{value.name} {getattr(dim, '__name__', axis)} = {size}")
    return ", ".join(fixed)


def torch_export(folder, dtype: OnnxDtype, opset: int):
    """:func:`trace_model` as an ``onnx.ModelProto``: the plain graph, without Q/DQ."""
    import onnx_ir as ir

    model, output_name, feed = trace_model(folder, dtype, opset)
    return ir.to_proto(model), output_name, feed


# --------------------------------------------------------------------------------------------
# writing

def _initializer_bytes(proto) -> int:
    total = 0
    for t in proto.graph.initializer:
        total += len(t.raw_data) if t.raw_data else t.ByteSize()
    return total


def strip_metadata(proto) -> None:
    """Drop per-node exporter metadata (stack traces with local paths) for stable bytes."""
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    proto.doc_string = ""


def write_model(proto, output: Path, *, force: bool, check_fn=None) -> tuple[Path, Path | None]:
    """Save ``proto`` to ``output`` atomically (temp folder + rename), external data > 2 GB.

    ``check_fn(path)`` runs on the temporary file before it is renamed into place; if it raises,
    nothing is left behind. The temporary folder has a random name and is created exclusively,
    so nothing planted beside the output is followed. Any OSError (read-only or full location)
    becomes an Fp8ExportError. Returns ``(output, data_path or None)``.
    """
    import onnx

    from fp8export.io.atomic import make_folders, remove_folders
    from fp8export.io.outputs import check_file_target

    output = Path(output)
    data_name = output.name + ".data"
    data_path = output.parent / data_name
    for path in (output, data_path):  # again at write time: either may have appeared meanwhile
        check_file_target(path, force)
    external = _initializer_bytes(proto) > EXTERNAL_DATA_BYTES
    # Named before it is created: an interrupt (SIGINT/SIGTERM) right after the mkdir still
    # finds it in the finally below.
    tmp = output.parent / f".{output.name}.tmp-{secrets.token_hex(8)}"
    moved_data = False
    created: list[Path] = []  # missing parent folders made here: removed again on failure
    written = False
    try:
        created = make_folders(output.parent)
        tmp.mkdir(mode=0o700)  # exclusive: fails if anything is there
        tmp_model = tmp / output.name
        if external:
            onnx.save_model(proto, str(tmp_model), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        else:
            onnx.save_model(proto, str(tmp_model))
        if check_fn is not None:
            check_fn(tmp_model)
        if external:
            os.replace(tmp / data_name, data_path)
            moved_data = True
        elif data_path.exists() and force:
            data_path.unlink()  # a stale external-data file from an earlier, larger export
        os.replace(tmp_model, output)
        written = True
    except OSError as exc:
        if moved_data:
            data_path.unlink(missing_ok=True)
        raise Fp8ExportError(f"{output}: writing the ONNX file failed ({exc.strerror or exc}); "
                             "nothing was written. Check the path, its permissions and the free "
                             "space.") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not written:
            remove_folders(created)
    return output, (data_path if external else None)


def check_levels(proto, feed: dict, dtype: OnnxDtype):
    """Run the finished graph at every onnxruntime level (:mod:`fp8export.onnx.levels`) and
    record the verdict in its ``metadata_props``. Returns the LevelCheck."""
    import onnxruntime as ort

    from fp8export.onnx.levels import METADATA_KEY, LevelCheck, compare_levels

    weights = _initializer_bytes(proto)
    if dtype is OnnxDtype.BF16:
        check = LevelCheck(onnxruntime=ort.__version__, dtype=dtype.value, tolerance=0.0,
                           skipped="bf16 graph: onnxruntime has no bf16 Q/DQ kernels")
    elif weights > LEVEL_CHECK_BYTES:
        check = LevelCheck(onnxruntime=ort.__version__, dtype=dtype.value, tolerance=0.0,
                           skipped=f"{weights / 2**30:.1f} GiB of weights (checked up to "
                                   f"{LEVEL_CHECK_BYTES / 2**30:.0f} GiB)")
    else:
        check = compare_levels(proto.SerializeToString(), feed, dtype=dtype.value)
    kept = [p for p in proto.metadata_props if p.key != METADATA_KEY]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    proto.metadata_props.add(key=METADATA_KEY, value=check.metadata_value())
    return check


# --------------------------------------------------------------------------------------------

def export_onnx(cfg: ExportOnnxConfig) -> ExportResult:
    """FP8 folder → checked ONNX Q/DQ graph. Raises Fp8ExportError; never leaves a partial file."""
    import onnx
    import onnx_ir as ir

    from fp8export.fp8dir.manifest import kv_cache_line
    from fp8export.fp8dir.reader import read_fp8_folder
    from fp8export.io.outputs import claim_output_file
    from fp8export.keras_model.config import is_keras_config
    from fp8export.onnx.check import check_model
    from fp8export.onnx.qdq import rewrite_qdq

    start = time.perf_counter()
    output = cfg.resolved_output
    if output.suffix != ".onnx":
        raise Fp8ExportError(f"-o {output}: the output must be a .onnx file name.")
    for path in (output, output.with_name(output.name + ".data")):  # the graph, its weights
        claim_output_file(path, inputs=[cfg.fp8_dir], force=cfg.force)
    with stage(f"reading the FP8 folder {cfg.fp8_dir}"):
        folder = read_fp8_folder(cfg.fp8_dir)
    if not folder.layers:
        folder.close()
        raise Fp8ExportError(
            f"{cfg.fp8_dir}: no quantized layers, so there is nothing to export in FP8. Re-run "
            "`fp8export convert` (check --exclude/--include).")
    with folder:  # its tensors are read while tracing and rewriting
        keras = is_keras_config(folder.config)
        kv = kv_cache_line(folder.manifest.get("kv_cache"))
        dtype = cfg.resolved_dtype(keras)
        opset = cfg.resolved_opset(dtype)
        arch = (folder.config.get("architectures")
                or [folder.config.get("model_type") or folder.config.get("class_name", "?")])[0]
        traced = time.perf_counter()
        # torch's exporter is most of this command's time (about a minute for the 5.4 M-parameter
        # sample on 2 busy cores, bench/results/onnx_export.md): said before the wait
        with stage(f"tracing {arch} with torch.onnx.export (dynamo, {dtype}, opset {opset}): "
                   "torch's exporter, most of export-onnx's time"):
            model, output_name, feed = trace_model(folder, dtype, opset)
        traced = time.perf_counter() - traced
        with stage("rewriting quantized linears into FP8 Q/DQ"):
            rewrite = rewrite_qdq(model, graph_layers(folder), dtype=dtype.value, opset=opset)
            # here: the FP8 initializers may be views of the folder's memory-mapped tensors
            proto = ir.to_proto(model)
    strip_metadata(proto)
    min_ir = onnx.helper.find_min_ir_version_for(list(proto.opset_import))
    proto.ir_version = max(int(proto.ir_version), int(min_ir))  # opset 23 needs IR >= 11
    proto.doc_string = f"fp8export: FP8 E4M3 Q/DQ graph of {folder.path.name} ({dtype})"
    with stage("running the graph at each onnxruntime optimization level"):
        levels = check_levels(proto, feed, dtype)

    report_box: dict[str, Any] = {}

    def _check(path: Path) -> None:
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            raise Fp8ExportError(
                f"{folder.path}: the exported graph fails onnx.checker ({exc}); this is a bug in "
                f"fp8export — try --opset {DEFAULT_OPSET} --dtype fp16 and report it.") from exc
        report = check_model(path, source=str(output))
        report_box["report"] = report
        if not report.ok:
            raise Fp8ExportError(
                f"{folder.path}: the exported graph breaks TensorRT's FP8 rules, refusing to write "
                f"it:\n{report.to_text(errors_only=True)}")

    with stage(f"checking (onnx.checker, TensorRT FP8 rules) and writing {output}"):
        out, data = write_model(proto, output, force=cfg.force, check_fn=_check)
    report = report_box["report"]
    size = out.stat().st_size + (data.stat().st_size if data else 0)
    fp8 = [g.layer for g in report.gemms if g.fp8 and g.layer]
    sixteen = {g.layer: g.reason for g in report.gemms if not g.fp8 and g.layer}
    weight_only = bool(rewrite.dynamic) and not fp8 and set(sixteen) <= set(rewrite.dynamic)
    if weight_only:  # one sentence instead of the per-layer list
        notes = [n for n in rewrite.notes if kind_of(n) is not NoteKind.DYNAMIC_LAYERS]
        notes.insert(0, WEIGHT_ONLY.format(n=len(sixteen)))
    else:
        notes = list(rewrite.notes)
    if any(".experts." in name for name in folder.layers):
        notes.append("MoE experts exported densely: every expert runs on every token, weighted "
                     "by the router (zero where a token was not routed), so the graph has no "
                     "data-dependent control flow; its expert GEMMs cost E/top-k times routed "
                     "execution. For routed MoE serving use the FP8 folder with vLLM.")
    if keras:
        notes.insert(0, "Keras model rebuilt in torch from config.json (Keras not needed)")
    if kv:
        notes.append(f"KV cache: the folder declares {kv}; this graph has no KV cache (each "
                     "call recomputes attention over the whole sequence), so its KV scales are "
                     f"not in it and attention runs in {dtype}. Serve the folder (vLLM, "
                     "TensorRT-LLM) for an FP8 KV cache.")
    if sixteen and not weight_only:
        notes.append(Note(f"TensorRT will run {len(sixteen)} quantized linear(s) in 16-bit: "
                          + "; ".join(f"{k}: {v}" for k, v in sixteen.items()),
                          NoteKind.SIXTEEN_BIT))
    if levels.note():
        notes.append(levels.note())
    elif levels.skipped and dtype is not OnnxDtype.BF16:
        notes.append(f"onnxruntime's optimization levels were not compared ({levels.skipped}); "
                     "`fp8export verify --ort-opt-level` runs the graph at any level")
    return ExportResult(output=out, external_data=data, dtype=dtype.value, opset=opset,
                        ir_version=int(proto.ir_version), file_bytes=size,
                        seconds=time.perf_counter() - start, fp8_gemms=fp8, sixteen_bit=sixteen,
                        output_name=output_name, check=report.to_dict(), notes=notes,
                        ort_levels=levels.to_dict(), weight_only=weight_only,
                        trace_seconds=traced)
