"""Keras checkpoint + FP8 folder → ONNX Q/DQ graph, through Keras 3's own ONNX export (issue 5.4).

Steps (Keras 3 on the torch backend, where ``model.export(path, format="onnx")`` works):

1. The architecture comes from the checkpoint's ``config.json``, never from executing the
   archive: every dtype policy is replaced by ``float32`` (Keras's float8 layers fake-quantize
   inside their call; we want plain MatMuls to rewrite), the config is scanned for code-bearing
   entries (Lambda layers, ``__lambda__``/function payloads, modules outside the keras
   packages) and refused if it has any, and it is deserialized with ``safe_mode=True``.
   Custom layer classes (the sample's) must be registered by the caller
   (``keras.saving.register_keras_serializable``) or passed as ``custom_objects``.
2. Weights: a temporary copy of the weights file without the float8 variables, where each
   quantized layer's kernel is the FP8 folder's *dequantized* weight, is loaded with Keras's
   own ``load_weights`` (which maps HDF5 groups to layers itself). The graph therefore holds
   exactly the deployed weights, and binding by content is exact.
3. ``model.export(..., format="onnx")`` (dynamic batch and sequence axes), then every
   EinsumDense ``Einsum`` with a constant kernel becomes Reshape → MatMul → Reshape (TensorRT
   fuses FP8 only into MatMul/Gemm), then the opset is raised to 21.
4. :func:`fp8export.onnx.qdq.rewrite_qdq` binds each manifest layer to its MatMul **by
   content** (the initializer equals the dequantized weight, up to transpose) and inserts the
   Q/DQ pattern; ``onnx.checker`` and :func:`fp8export.onnx.check.check_model` must pass before
   the file is written (atomically).
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
def write_deployed_weights(ckpt, folder, dest: Path) -> list[str]:
    """Copy ``ckpt``'s weights to ``dest`` without float8 variables, kernels = FP8 dequantized."""
    import h5py

    by_kernel = {layer.datasets[0]: layer for layer in ckpt.layers}
    drop = {d for layer in ckpt.layers if layer.float8 for d in layer.datasets[-6:]}
    replaced = []
    src = ckpt._h5
    with h5py.File(dest, "w") as out:
        def copy_group(g_src, g_dst):
            for k, v in g_src.attrs.items():
                g_dst.attrs[k] = v
            for key in g_src:
                item = g_src[key]
                if item.name.startswith("/optimizer"):
                    continue
                if isinstance(item, h5py.Group):
                    copy_group(item, g_dst.create_group(key))
                elif item.name not in drop:
                    data = item[()]
                    layer = by_kernel.get(item.name)
                    q = folder.layers.get(layer.module) if layer is not None else None
                    if q is not None:
                        deq = q.dequantized().numpy()  # stored layout = the reader's 2-D view
                        data = deq.reshape(item.shape).astype(item.dtype)
                        replaced.append(layer.module)
                    ds = g_dst.create_dataset(key, data=data)
                    for k, v in item.attrs.items():
                        ds.attrs[k] = v
        copy_group(src, out)
    missing = sorted(set(folder.layers) - set(replaced))
    if missing:
        raise Fp8ExportError(f"{folder.path}: quantized layer(s) {', '.join(missing)} have no "
                             f"kernel in {ckpt.path}; was the folder converted from it?")
    return replaced


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
def export_keras_onnx(keras_path: str | Path, fp8_dir: str | Path, out_path: str | Path, *,
                      custom_objects: dict | None = None, force: bool = False,
                      sample_length: int = 8) -> KerasOnnxResult:
    """Export the Keras model of ``keras_path`` with the FP8 folder's weights and scales."""
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
    keras = _keras()
    registered = set(keras.saving.get_custom_objects()) | set(custom_objects or {})
    with KerasCheckpoint.open(Path(keras_path)) as ckpt, \
            tempfile.TemporaryDirectory(prefix="fp8export-keras-onnx-") as tmp:
        refuse_code(ckpt.config, str(ckpt.path), registered)
        cfg = float32_config(ckpt.config)
        try:
            model = keras.saving.deserialize_keras_object(cfg, custom_objects=custom_objects,
                                                          safe_mode=True)
        except (TypeError, ValueError, KeyError) as exc:
            raise Fp8ExportError(f"{ckpt.path}: Keras cannot rebuild the model from config.json "
                                 f"({exc}). Register its custom layers first.") from exc
        weights = Path(tmp) / "deployed.weights.h5"
        write_deployed_weights(ckpt, folder, weights)
        try:
            model.load_weights(weights)
        except ValueError as exc:
            raise Fp8ExportError(f"{ckpt.path}: the weights do not fit the rebuilt float32 model "
                                 f"({exc}).") from exc
        proto = torch_dynamo_export(model, Path(tmp) / "keras.onnx", sample_length)
    rewritten = einsum_to_matmul(proto)
    if next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) < OPSET:
        proto = onnx.version_converter.convert_version(proto, OPSET)
    result = rewrite_qdq(proto, folder.layers, dtype="fp32", opset=OPSET)
    proto.doc_string = f"fp8export: FP8 E4M3 Q/DQ graph of {Path(keras_path).name} (Keras export)"
    box: dict[str, Any] = {}

    def _check(path: Path) -> None:
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            raise Fp8ExportError(f"{keras_path}: exported graph fails onnx.checker ({exc}).") \
                from exc
        report = check_model(path, source=str(out_path))
        box["report"] = report
        if not report.ok:
            raise Fp8ExportError(f"{keras_path}: the graph breaks TensorRT's FP8 rules:\n"
                                 f"{report.to_text(errors_only=True)}")

    write_model(proto, out_path, force=force, check_fn=_check)
    report = box["report"]
    return KerasOnnxResult(output=out_path, opset=OPSET,
                           fp8_gemms=[g.layer for g in report.gemms if g.fp8],
                           bound=dict(result.bound), einsums_rewritten=rewritten,
                           check=report.to_dict(), notes=list(result.notes))


def read_manifest_source(fp8_dir: Path) -> dict:
    return json.loads((Path(fp8_dir) / "fp8export.json").read_text()).get("source", {})
