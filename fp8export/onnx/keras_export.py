"""FP8 folder converted from a Keras checkpoint → ONNX Q/DQ graph (issue 5 item 4).

Keras 3 on the torch backend; a Keras model there is a ``torch.nn.Module``.

1. **Architecture.** It comes from the Keras ``config.json`` (the folder's copy, or the source
   checkpoint's). Nothing in an archive is executed:
   - every dtype policy becomes ``float32``: Keras's float8 layers fake-quantize inside their
     call, and we want plain MatMuls to rewrite;
   - the config is scanned for code-bearing entries (Lambda layers, ``__lambda__`` payloads,
     classes from modules outside the keras packages that nobody registered) and refused;
   - it is deserialized with ``safe_mode=True``. Custom layer classes (the sample's) must be
     registered by the caller (``keras.saving.register_keras_serializable``) or passed as
     ``custom_objects``.
2. **Weights.** All of them come from the FP8 folder. Quantized layers get their
   *dequantized* E4M3 weight. The skeleton file is written by Keras (``save_weights``), named
   by our reader and loaded back by Keras's ``load_weights``, so no name mapping is guessed
   here. The graph holds exactly the deployed weights, which makes binding by content exact.
3. **Export.** ``model.export(format="onnx")`` does *not* work for this model: with a dynamic
   axis Keras picks torch's TorchScript exporter (``keras/src/export/onnx.py``), which fails
   on Keras's LayerNormalization ("Failed to export a node ... onnx::Gather ... because it is
   not constant", from the shape list in ``keras/src/ops/nn.py`` ``layer_normalization``). We
   call the exporter Keras uses for static shapes, ``torch.onnx.export(dynamo=True)``, with
   dynamic batch and sequence axes (opset 21).
4. **Einsum.** Every EinsumDense ``Einsum`` with a constant kernel becomes Reshape → MatMul →
   Reshape, because TensorRT fuses FP8 only into MatMul/Gemm.
5. **Q/DQ.** :func:`fp8export.onnx.qdq.rewrite_qdq` binds each manifest layer to its MatMul
   **by content** (the initializer equals the dequantized weight, up to transpose) and inserts
   the Q/DQ pattern.
6. **Checks.** ``onnx.checker`` (full) and :func:`fp8export.onnx.check.check_model` must pass
   before the file is written (atomically).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fp8export.errors import Fp8ExportError

OPSET = 21
_KERAS_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp")
_POLICY_CLASSES = {"DTypePolicy", "FloatDTypePolicy", "QuantizedDTypePolicy",
                   "QuantizedFloat8DTypePolicy", "GPTQDTypePolicy", "AWQDTypePolicy"}
_FLOAT32 = {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "float32"},
            "registered_name": None}


@dataclass
class KerasOnnxResult:
    output: Path
    opset: int
    fp8_gemms: list[str]
    bound: dict[str, str]  # layer → how it was bound ("content")
    einsums_rewritten: int
    check: dict[str, Any]
    notes: list[str] = field(default_factory=list)


# ---- 1. config ------------------------------------------------------------------------------
def float32_config(config: dict) -> dict:
    """A copy of a Keras model config with every float dtype policy set to float32."""
    def walk(node):
        if isinstance(node, dict):
            if node.get("class_name") in _POLICY_CLASSES and isinstance(node.get("config"), dict):
                return copy.deepcopy(_FLOAT32)
            out = {}
            for k, v in node.items():
                if k == "dtype" and isinstance(v, str) and (v.startswith("float8_from_")
                                                            or v.startswith("mixed_")):
                    out[k] = "float32"
                else:
                    out[k] = walk(v)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(config)


def refuse_code(config: dict, where: str, registered: set[str]) -> None:
    """Raise if the config names code: Lambda layers, serialized functions, foreign modules."""
    def walk(node, path):
        if isinstance(node, dict):
            cls = node.get("class_name")
            if cls in ("Lambda", "__lambda__", "function") or "__lambda__" in str(cls):
                raise Fp8ExportError(f"{where}: config entry {path} is a {cls}, which carries "
                                     "Python code; fp8export never builds such a model.")
            module = node.get("module")
            if isinstance(cls, str) and isinstance(module, str) and module.split(".")[0] not in \
                    _KERAS_PACKAGES and node.get("registered_name") not in registered:
                raise Fp8ExportError(
                    f"{where}: config entry {path} names class {cls} from module {module!r}, "
                    "which is not registered. Import the module that defines it (its "
                    "@keras.saving.register_keras_serializable classes) before exporting.")
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
    walk(config, "config")


def _keras():
    backend = os.environ.setdefault("KERAS_BACKEND", "torch")
    if backend != "torch":
        raise Fp8ExportError(f"KERAS_BACKEND={backend}: the Keras ONNX export runs on the torch "
                             "backend here; set KERAS_BACKEND=torch.")
    try:
        import keras
    except ImportError as exc:
        raise Fp8ExportError("Keras is not installed: pip install 'fp8export[keras]'.") from exc
    if keras.backend.backend() != "torch":
        raise Fp8ExportError(f"Keras was already imported with the {keras.backend.backend()} "
                             "backend; run with KERAS_BACKEND=torch.")
    return keras


# ---- 2. weights -----------------------------------------------------------------------------
def _source_tensor(name: str, folder, available: set[str]) -> str | None:
    """The folder tensor behind a tensor of the rebuilt float32 model.

    Names are the reader's, so they agree, except for Dense/EinsumDense nested in custom
    layers: in the float8 source the reader recognised them by their float8 variables
    (``<m>.weight``/``<m>.bias``); in the float32 skeleton nothing says what they are, so the
    reader calls their variables ``<m>.vars.0``/``<m>.vars.1``.
    """
    if name in available:
        return name
    prefix, _, index = name.rpartition(".vars.")
    alias = {"0": f"{prefix}.weight", "1": f"{prefix}.bias"}.get(index)
    return alias if alias in available else None


def fill_from_folder(model, config: dict, folder, tmp: Path) -> Path:
    """Weights file for the rebuilt float32 ``model``, holding the FP8 folder's tensors.

    Quantized layers get their *dequantized* FP8 weight, the rest the folder's copies. The
    skeleton is written by Keras itself (so Keras's own ``load_weights`` maps it back) and
    named by our reader (so names match the folder's).
    """
    import h5py

    from fp8export.checkpoint.keras_reader import KerasCheckpoint

    skeleton = tmp / "skeleton.weights.h5"
    model.save_weights(skeleton)
    (tmp / "config.json").write_text(json.dumps(config))
    with KerasCheckpoint.open(skeleton) as sk:
        layout = sk.datasets()
    quantized = {f"{m}.weight": q for m, q in folder.layers.items()}
    available = set(folder.tensors) | set(quantized)
    used = set()
    with h5py.File(skeleton, "r+") as f:
        for name, (dataset, shape) in layout.items():
            src = _source_tensor(name, folder, available)
            if src is None:
                raise Fp8ExportError(f"{folder.path}: the rebuilt model's tensor {name} has no "
                                     "counterpart in the FP8 folder; the folder was not converted "
                                     "from this architecture.")
            q = quantized.get(src)
            value = q.dequantized() if q is not None else folder.tensors[src].float()
            if value.numel() != int(np.prod(shape)):
                raise Fp8ExportError(f"{folder.path}: {src} has {value.numel()} values; the "
                                     f"model's {name} needs shape {shape}.")
            f[dataset][...] = value.numpy().reshape(shape)
            used.add(src)
    missing = sorted(set(quantized) - used)
    if missing:
        raise Fp8ExportError(f"{folder.path}: quantized weight(s) {', '.join(missing)} match no "
                             "layer of the rebuilt model.")
    return skeleton


# ---- 3. Einsum → MatMul ---------------------------------------------------------------------
def einsum_to_matmul(proto) -> int:
    """Rewrite ``Einsum(x, W_const)`` of EinsumDense into Reshape → MatMul(W 2-D) → Reshape."""
    from onnx import helper, numpy_helper

    from fp8export.checkpoint.keras_reader import einsum_kernel_2d

    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    new_nodes, new_inits, drop, count = [], [], set(), 0
    for node in graph.node:
        eq = next((a.s.decode() for a in node.attribute if a.name == "equation"), "")
        kernel = inits.get(node.input[1]) if node.op_type == "Einsum" and len(node.input) == 2 \
            else None
        view = einsum_kernel_2d(eq, tuple(kernel.dims)) if kernel is not None else None
        lhs, _, out = eq.replace(" ", "").partition("->")
        inp, _, ker = lhs.partition(",")
        if view is None or not view[1] or "." in eq:
            new_nodes.append(node)
            continue
        n_contract = sum(1 for c in ker if c in inp and c not in out)
        lead = inp[: len(inp) - n_contract]
        free = ker[n_contract:]
        if out != lead + free:
            new_nodes.append(node)
            continue
        (rows, cols), _ = view
        base = node.name or node.output[0]
        w = numpy_helper.to_array(kernel).reshape(rows, cols)
        w_name = f"{node.input[1]}.2d"
        new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w), w_name))
        x = node.input[0]
        if n_contract > 1:
            shape = np.array([0] * len(lead) + [rows], dtype=np.int64)
            new_inits.append(numpy_helper.from_array(shape, f"{base}/in_shape"))
            new_nodes.append(helper.make_node("Reshape", [x, f"{base}/in_shape"],
                                              [f"{base}/x2d"], name=f"{base}/reshape_in"))
            x = f"{base}/x2d"
        free_dims = [int(kernel.dims[ker.index(c)]) for c in free]
        mm_out = node.output[0] if len(free) == 1 else f"{base}/mm"
        new_nodes.append(helper.make_node("MatMul", [x, w_name], [mm_out], name=f"{base}/matmul"))
        if len(free) > 1:
            shape = np.array([0] * len(lead) + free_dims, dtype=np.int64)
            new_inits.append(numpy_helper.from_array(shape, f"{base}/out_shape"))
            new_nodes.append(helper.make_node("Reshape", [mm_out, f"{base}/out_shape"],
                                              [node.output[0]], name=f"{base}/reshape_out"))
        uses[node.input[1]] -= 1
        if uses[node.input[1]] == 0:
            drop.add(node.input[1])
        count += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    kept = [t for t in graph.initializer if t.name not in drop]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    return count


def torch_dynamo_export(model, path: Path, sample_length: int):
    """Export a Keras-on-torch model with dynamic batch and sequence axes.

    ``model.export(format="onnx")`` picks torch's TorchScript exporter whenever an input axis is
    dynamic (keras/src/export/onnx.py), and that exporter fails on Keras's LayerNormalization
    ("Failed to export a node ... onnx::Gather ... because it is not constant", from the shape
    list built in keras/src/ops/nn.py ``layer_normalization``). Keras uses the dynamo exporter
    only for fully static shapes; we call that same exporter with dynamic shapes: on the torch
    backend a Keras model is a ``torch.nn.Module`` whose ``forward(*args)`` takes the inputs.
    """
    import onnx
    import torch

    if len(model.inputs) != 1:
        raise Fp8ExportError(f"the Keras model has {len(model.inputs)} inputs; the Keras ONNX "
                             "path supports one token-id input.")
    spec = model.inputs[0]
    name = getattr(spec, "name", None) or "input_ids"
    dtype = {"int32": torch.int32, "int64": torch.int64}.get(str(spec.dtype))
    if dtype is None:
        raise Fp8ExportError(f"Keras model input {name} has dtype {spec.dtype}; the Keras ONNX "
                             "path exports token-id (int32/int64) inputs.")
    model(np.zeros((2, sample_length), dtype=str(spec.dtype)))  # build every layer
    model.eval()
    batch = torch.export.Dim("batch", min=1, max=4096)
    fixed = spec.shape[1]
    seq = fixed if fixed is not None else torch.export.Dim("seq", min=2, max=65536)
    example = torch.zeros((2, fixed or sample_length), dtype=dtype)
    try:
        program = torch.onnx.export(model, (example,), dynamo=True, opset_version=OPSET,
                                    input_names=[name], dynamic_shapes=(({0: batch, 1: seq},),),
                                    verbose=False)
        program.optimize()
        program.save(str(path))
    except Exception as exc:  # torch.export raises many types; the message is what matters
        raise Fp8ExportError(f"torch.onnx.export (dynamo) could not export the Keras model: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    return onnx.load(str(path))


# ---- 4. the whole path ----------------------------------------------------------------------
def export_keras_onnx(keras_path: str | Path | None, fp8_dir: str | Path,
                      out_path: str | Path, *, custom_objects: dict | None = None,
                      force: bool = False, sample_length: int = 8) -> KerasOnnxResult:
    """FP8 folder converted from a Keras checkpoint → checked ONNX Q/DQ graph.

    The architecture comes from ``keras_path`` (the ``.keras`` / ``.weights.h5`` it was
    converted from) when given, else from the folder's own ``config.json`` (convert copies the
    Keras config there); every weight comes from the folder.
    """
    import onnx

    from fp8export.checkpoint.keras_reader import KerasCheckpoint
    from fp8export.onnx.check import check_model
    from fp8export.onnx.export import write_model
    from fp8export.onnx.fp8dir import read_fp8_folder
    from fp8export.onnx.qdq import rewrite_qdq

    out_path = Path(out_path)
    if out_path.exists() and not force:
        raise Fp8ExportError(f"{out_path} exists; pass force=True to overwrite it.")
    folder = read_fp8_folder(fp8_dir)
    if keras_path is not None:
        with KerasCheckpoint.open(Path(keras_path)) as ckpt:
            source_cfg, where = ckpt.config, str(ckpt.path)
    else:
        source_cfg = {k: v for k, v in folder.config.items() if k != "quantization_config"}
        where = str(folder.path / "config.json")
    if "class_name" not in source_cfg or "config" not in source_cfg:
        raise Fp8ExportError(f"{where}: not a Keras model config (no class_name/config); this "
                             "path exports folders converted from .keras / .weights.h5 files.")
    keras = _keras()
    registered = set(keras.saving.get_custom_objects()) | set(custom_objects or {})
    refuse_code(source_cfg, where, registered)
    cfg = float32_config(source_cfg)
    with tempfile.TemporaryDirectory(prefix="fp8export-keras-onnx-") as tmp:
        try:
            model = keras.saving.deserialize_keras_object(cfg, custom_objects=custom_objects,
                                                          safe_mode=True)
        except (TypeError, ValueError, KeyError) as exc:
            raise Fp8ExportError(f"{where}: Keras cannot rebuild the model from its config "
                                 f"({exc}). Register its custom layers first.") from exc
        model(np.zeros((2, sample_length), dtype=str(model.inputs[0].dtype)))  # build it all
        weights = fill_from_folder(model, cfg, folder, Path(tmp))
        try:
            model.load_weights(weights)
        except ValueError as exc:
            raise Fp8ExportError(f"{where}: the folder's weights do not fit the rebuilt "
                                 f"float32 model ({exc}).") from exc
        proto = torch_dynamo_export(model, Path(tmp) / "keras.onnx", sample_length)
    rewritten = einsum_to_matmul(proto)
    if next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) < OPSET:
        proto = onnx.version_converter.convert_version(proto, OPSET)
    result = rewrite_qdq(proto, folder.layers, dtype="fp32", opset=OPSET)
    proto.doc_string = f"fp8export: FP8 E4M3 Q/DQ graph of {folder.path.name} (Keras export)"
    box: dict[str, Any] = {}

    def _check(path: Path) -> None:
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            raise Fp8ExportError(f"{where}: exported graph fails onnx.checker ({exc}).") from exc
        report = check_model(path, source=str(out_path))
        box["report"] = report
        if not report.ok:
            raise Fp8ExportError(f"{where}: the graph breaks TensorRT's FP8 rules:\n"
                                 f"{report.to_text(errors_only=True)}")

    write_model(proto, out_path, force=force, check_fn=_check)
    report = box["report"]
    return KerasOnnxResult(output=out_path, opset=OPSET,
                           fp8_gemms=[g.layer for g in report.gemms if g.fp8],
                           bound=dict(result.bound), einsums_rewritten=rewritten,
                           check=report.to_dict(), notes=list(result.notes))
