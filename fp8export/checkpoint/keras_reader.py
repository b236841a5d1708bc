"""Keras 3 checkpoints: ``.keras`` archives and ``.weights.h5`` files, read without Keras.

Keras is never imported and ``keras.models.load_model`` never runs (a config can name code,
e.g. Lambda layers): ``config.json`` is parsed as JSON, the archive through
:mod:`fp8export.io.safezip`, the weights with h5py (hard links only; external storage,
virtual datasets and soft/external links are refused, since they point outside the file).

Weights layout (``keras/src/saving/saving_lib.py``, ``H5IOStore``): each layer's variables are
datasets ``<group>/vars/0..n-1``, in the order of its ``save_own_variables``; groups nest by
attribute path (``layers/transformer_decoder/_self_attention_layer/query_dense``), and since
Keras 3.6 each ``vars`` group has an attribute ``name`` = the layer's name.

Tensor names: the dotted chain of *layer names* down to the layer (containers such as
``layers`` add nothing), then the variable: ``<m>.weight`` / ``<m>.bias`` for Dense and
EinsumDense kernels and biases, ``<m>.embeddings``, ``<m>.gamma``/``<m>.beta`` for known
classes, ``<m>.vars.<i>`` otherwise. E.g. ``dense_1.weight``,
``transformer_decoder.self_attention.query.weight``. Files older than 3.6 (no ``name``
attribute) fall back to the HDF5 path (config order maps top-level groups to layer names).
The six float8 variables are training state, not tensors: see :meth:`training_state`.

Kernels: Dense stores ``[in, out]`` (``TensorInfo.transposed=True``; ``load`` returns that).
EinsumDense kernels are returned reshaped to 2-D, see :func:`einsum_kernel_2d`.
"""

from __future__ import annotations

import io
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from fp8export.checkpoint import keras_probe
from fp8export.checkpoint.keras_files import keras_file
from fp8export.checkpoint.source import Checkpoint, TensorInfo
from fp8export.checkpoint.training.keras import FLOAT8_VARIABLES, Float8Layer, keras_training_state
from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import CONFIG, parse_json, read_input
from fp8export.io.safezip import SafeZip, copy_member

IN_MEMORY_H5_BYTES = 512 * 2**20  # larger weights files go to a bounded temporary copy
MAX_JSON_BYTES = 64 * 2**20
MAX_DEPTH = 64  # layer nesting; deeper files are hostile (and would exhaust the recursion)
H5_BOMB_RATIO = 200  # declared per stored bytes (beyond 1 MiB) refused; Keras does not compress
_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "int32": "I32",
           "int64": "I64", "int8": "I8", "uint8": "U8", "int16": "I16", "bool": "BOOL"}
# Variable names of layers whose save order is fixed (keras/src/layers/...: build order).
_KNOWN_VARS = {"Embedding": ("embeddings",), "Dense": ("weight", "bias"),
               "EinsumDense": ("weight", "bias")}
# MultiHeadAttention's projection attributes (keras/src/layers/attention/multi_head_attention.py)
# and the number of leading kernel axes each contracts: query/key/value kernels are
# [in, heads, head_dim], the output kernel is [heads, head_dim, out].
_MHA_PROJECTIONS = {"query_dense": 1, "key_dense": 1, "value_dense": 1, "output_dense": -1}


def open_keras(path: Path) -> KerasCheckpoint:
    """Open a ``.keras`` / ``.weights.h5`` file, or the one a folder holds (see keras_files)."""
    file, notes = keras_file(Path(path))
    ckpt = KerasCheckpoint.open(file)
    ckpt.notes.extend(notes)
    return ckpt


def _snake(name: str) -> str:
    """keras/src/utils/naming.py ``to_snake_case``: how saving_lib names container entries."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def is_float8_policy(dtype: Any) -> bool:
    """True for both float8 dtype-policy forms in config.json.

    Keras 3.3: ``{"class_name": "QuantizedFloat8DTypePolicy", "config": {"name":
    "float8_from_float32", ...}}`` (or the bare string); later: ``{"class_name":
    "QuantizedFloat8DTypePolicy", "config": {"mode": "float8", "source_name": ...}}``.
    """
    if isinstance(dtype, str):
        return dtype.startswith("float8_from_")
    if not isinstance(dtype, dict):
        return False
    cfg = dtype.get("config") if isinstance(dtype.get("config"), dict) else {}
    return (dtype.get("class_name") == "QuantizedFloat8DTypePolicy"
            or cfg.get("mode") == "float8"
            or str(cfg.get("name", "")).startswith("float8_from_"))


def einsum_kernel_2d(equation: str, shape: tuple[int, ...]) -> tuple[tuple[int, int], bool] | None:
    """2-D view of an EinsumDense kernel: ``((rows, cols), transposed)`` or None if unsupported.

    The kernel's axes are split into *contracted* letters (in input and kernel, not output) and
    *free* letters (in kernel and output). Supported when the kernel lists all contracted axes
    then all free axes (``abc,cde->abde``: [in, heads·dim], ``transposed=True``, i.e. [in, out])
    or all free then all contracted (``ab,dc->ad``: [out, in]), and the contracted axes are the
    input's trailing axes in the same order, so flattening input and kernel agree. Kernel axes
    also present in the output *and* input (batched kernels) are not a linear layer.
    """
    m = re.fullmatch(r"([a-z.]+),([a-z]+)->([a-z.]+)", equation.replace(" ", ""))
    if not m or len(m.group(2)) != len(shape):
        return None
    inp, ker, out = (g.replace("...", "") for g in m.groups())
    contracted = [c for c in ker if c in inp and c not in out]
    free = [c for c in ker if c in out and c not in inp]
    if not contracted or not free or len(contracted) + len(free) != len(ker):
        return None
    if not inp.endswith("".join(contracted)):
        return None
    n_in = int(np.prod([shape[ker.index(c)] for c in contracted]))
    n_out = int(np.prod([shape[ker.index(c)] for c in free]))
    if list(ker) == contracted + free:
        return (n_in, n_out), True
    if list(ker) == free + contracted:
        return (n_out, n_in), False
    return None


@dataclass
class _Layer:
    """One saveable with variables, found in the weights file."""

    h5_path: str
    names: list[str]  # layer-name chain (or path components when no name attribute)
    datasets: list[str]  # HDF5 paths of vars/0..n-1
    shapes: list[tuple[int, ...]]
    config: dict | None = None  # the layer's entry in config.json, when config describes it
    float8: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def class_name(self) -> str | None:
        return self.config.get("class_name") if self.config else None

    @property
    def layer_config(self) -> dict:
        cfg = self.config.get("config") if self.config else None
        return cfg if isinstance(cfg, dict) else {}


@dataclass
class _Tensor:
    info: TensorInfo
    dataset: str
    shape_2d: tuple[int, ...] | None = None  # reshape on load (EinsumDense kernel, bias)


class KerasCheckpoint(Checkpoint):
    """A Keras 3 model's weights (``.keras`` or ``.weights.h5`` + ``config.json``)."""

    def __init__(self, path: Path, h5: h5py.File, config: dict, weights_name: str,
                 version: str | None, closers: list, source_files: list[Path]):
        super().__init__(path=path, kind="keras", config=config, source_files=source_files)
        self._h5, self._closers, self._where = h5, closers, f"{path} ({weights_name})"
        self.version = version
        self.warnings: list[str] = []
        self.notes: list[str] = []  # plain sentences for the user (which file a folder gave)
        with _h5_errors(self._where):
            self.layers = self._discover()
            self._tensors = self._index_tensors()

    # ---- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, path: Path) -> KerasCheckpoint:
        closers: list = []
        try:
            if path.suffix == ".keras":
                archive = SafeZip(path)
                closers.append(archive)
                names = set(archive.names())
                if "model.weights.h5" not in names:
                    other = sorted(n for n in names if n.startswith("model.weights"))
                    raise Fp8ExportError(
                        f"{path}: no model.weights.h5 in the archive (found "
                        f"{', '.join(other) or 'no weights'}). Only the default h5 weights "
                        "format is read; re-save with model.save(path) (not sharded, not npz).")
                config = _parse_json(archive.read_bytes("config.json", MAX_JSON_BYTES),
                                     f"{path}: config.json")
                version = None
                if "metadata.json" in names:
                    meta = _parse_json(archive.read_bytes("metadata.json", MAX_JSON_BYTES),
                                       f"{path}: metadata.json")
                    version = meta.get("keras_version") if isinstance(meta, dict) else None
                _probe(path)
                h5 = _open_member_h5(archive, path, closers)
                sources = [path]
            else:
                cfg_path = _config_beside(path)
                config = _parse_json(_read_limited(cfg_path), str(cfg_path))
                _probe(path)
                h5 = _open_h5(path, str(path))
                version, sources = None, [path, cfg_path]
            closers.insert(0, h5)
            return cls(path, h5, config, "model.weights.h5" if path.suffix == ".keras"
                       else path.name, f"keras-{version}" if version else "keras-3.x",
                       closers, sources)
        except BaseException:
            for c in reversed(closers):
                _quiet_close(c)
            raise

    def close(self) -> None:
        for c in reversed(self._closers):
            _quiet_close(c)
        self._closers = []

    # ---- discovery -----------------------------------------------------------------------
    def _discover(self) -> list[_Layer]:
        if not isinstance(self.config, dict):
            raise Fp8ExportError(f"{self.path}: config.json is not a JSON object.")
        layers: list[_Layer] = []
        for key in self._h5:
            if key in ("vars", "optimizer"):  # root model's own vars, optimizer slots
                continue
            self._walk(self._h5, key, [], layers)
        _attach_config(layers, self.config)
        for layer in layers:
            self._classify(layer)
        return layers

    def _walk(self, parent: h5py.Group, key: str, chain: list[str], out: list[_Layer]) -> None:
        link = parent.get(key, getlink=True)
        path = f"{parent.name.rstrip('/')}/{key}"
        if not isinstance(link, h5py.HardLink):
            raise Fp8ExportError(f"{self._where}: {path} is a {type(link).__name__}; Keras "
                                 "weights files hold only hard links. Refusing to follow it.")
        group = parent[key]
        if not isinstance(group, h5py.Group):
            return
        if path.count("/") > MAX_DEPTH:
            raise Fp8ExportError(f"{self._where}: groups nest deeper than {MAX_DEPTH} levels at "
                                 f"{path[:200]}; not a Keras weights file.")
        names = chain
        vars_link = group.get("vars", getlink=True)
        if vars_link is not None and not isinstance(vars_link, h5py.HardLink):
            raise Fp8ExportError(f"{self._where}: {path}/vars is a {type(vars_link).__name__}; "
                                 "refusing to follow it.")
        if vars_link is not None and isinstance(group["vars"], h5py.Group):
            label = group["vars"].attrs.get("name", key.lstrip("_") or key)
            names = chain + [label.decode() if isinstance(label, bytes) else str(label)]
            datasets, shapes = self._vars(group["vars"], path)
            if datasets:
                out.append(_Layer(path.lstrip("/"), names, datasets, shapes))
        elif key not in ("layers",) and not key.startswith("container"):
            names = chain + [key.lstrip("_")]  # an attribute holding a list of layers
        for child in group:
            if child != "vars":
                self._walk(group, child, names, out)

    def _vars(self, vars_group: h5py.Group, path: str):
        keys = list(vars_group)
        if sorted(keys, key=lambda k: int(k) if k.isdigit() else -1) != [str(i) for i in
                                                                          range(len(keys))]:
            raise Fp8ExportError(f"{self._where}: {path}/vars holds {sorted(keys)}; Keras "
                                 "names variables 0..n-1. The file is corrupt.")
        datasets, shapes = [], []
        for i in range(len(keys)):
            if not isinstance(vars_group.get(str(i), getlink=True), h5py.HardLink):
                raise Fp8ExportError(f"{self._where}: {path}/vars/{i} is a link; refused.")
            ds = vars_group[str(i)]
            if not isinstance(ds, h5py.Dataset):
                raise Fp8ExportError(f"{self._where}: {path}/vars/{i} is not a dataset.")
            _check_dataset(ds, self._where)
            datasets.append(ds.name)
            shapes.append(tuple(int(d) for d in ds.shape))
        return datasets, shapes

    def _classify(self, layer: _Layer) -> None:
        """Decide whether ``layer`` is float8 and check its variables fit that layout."""
        where = f"{self._where}: layer '{'.'.join(layer.names)}' ({layer.h5_path})"
        declared = is_float8_policy(layer.layer_config.get("dtype")) if layer.config else None
        n, shapes = len(layer.shapes), layer.shapes
        looks = (n in (7, 8) and len(shapes[0]) >= 2
                 and all(shapes[i] in ((), (1,)) for i in (n - 6, n - 4, n - 2)))
        if declared is False:
            if layer.class_name in ("Dense", "EinsumDense") and n > 2:
                raise Fp8ExportError(f"{where}: config.json gives it a non-float8 dtype policy "
                                     f"but the weights file holds {n} variables (a "
                                     f"{layer.class_name} holds kernel and bias). The config "
                                     "does not match the weights; save them together "
                                     "(model.save).")
            return
        if not declared and not looks:
            return
        if n not in (7, 8) or len(shapes[0]) < 2:
            raise Fp8ExportError(
                f"{where}: config.json marks it float8 but it holds {n} variables of shapes "
                f"{shapes}; expected kernel, optional bias, then the six float8 variables "
                f"{', '.join(FLOAT8_VARIABLES)}.")
        hist = [shapes[i] for i in (n - 5, n - 3, n - 1)]
        scales = [shapes[i] for i in (n - 6, n - 4, n - 2)]
        policy = layer.layer_config.get("dtype")
        policy_cfg = policy.get("config") if isinstance(policy, dict) else None
        length = (policy_cfg.get("amax_history_length") if isinstance(policy_cfg, dict)
                  else None)
        if any(s not in ((), (1,)) for s in scales) or any(
                len(h) != 1 or h[0] == 0 or h != hist[0] for h in hist) or (
                length is not None and hist[0] != (length,)):
            raise Fp8ExportError(
                f"{where}: float8 variables have shapes scales={scales}, histories={hist}"
                f"{f' (config amax_history_length={length})' if length else ''}; expected "
                "three scalars and three 1-D histories of one length. Corrupt or edited file.")
        layer.float8 = True
        if not declared:
            layer.notes.append("float8 detected from its variable layout (config.json does not "
                               "describe layers nested in custom layers)")

    # ---- tensors -------------------------------------------------------------------------
    def _index_tensors(self) -> dict[str, _Tensor]:
        prefixes = [".".join(layer.names) for layer in self.layers]
        if len(set(prefixes)) != len(prefixes):  # layer names repeat: use the HDF5 paths
            prefixes = [layer.h5_path.replace("/", ".") for layer in self.layers]
            self.warnings.append("layer names are not unique; tensor names use HDF5 paths")
        tensors: dict[str, _Tensor] = {}
        for layer, prefix in zip(self.layers, prefixes, strict=True):
            layer.module = prefix
            for t in self._layer_tensors(layer, prefix):
                tensors[t.info.name] = t
        return tensors

    def _layer_tensors(self, layer: _Layer, prefix: str) -> list[_Tensor]:
        n_plain = len(layer.datasets) - 6 if layer.float8 else len(layer.datasets)
        cls = layer.class_name or _implied_class(layer)
        names = _var_names(cls, layer, n_plain)
        out = []
        kernel_2d = self._kernel_2d(layer, cls) if cls in ("Dense", "EinsumDense") else None
        for i in range(n_plain):
            ds = self._h5[layer.datasets[i]]
            shape, reshape, transposed = layer.shapes[i], None, False
            if names[i] == "weight" and kernel_2d is not None:
                reshape, transposed = kernel_2d
                shape = reshape
            elif names[i] == "weight" and cls in ("Dense", "EinsumDense"):
                names[i] = "kernel"  # orientation unknown: keep N-D under another name
                self.warnings.append(f"{prefix}: EinsumDense kernel {shape} left as "
                                     f"'{prefix}.kernel' (orientation unknown); not quantized")
            elif names[i] == "bias" and len(shape) > 1:
                reshape = shape = (int(np.prod(shape)),)
            info = TensorInfo(name=f"{prefix}.{names[i]}", dtype=_dtype_of(ds, self._where),
                              shape=tuple(shape), file=self.path, transposed=transposed)
            out.append(_Tensor(info, layer.datasets[i], reshape))
        return out

    def _kernel_2d(self, layer: _Layer, cls: str):
        shape = layer.shapes[0]
        if cls == "Dense" and len(shape) == 2:
            return shape, True
        eq = layer.layer_config.get("equation")
        if isinstance(eq, str):
            view = einsum_kernel_2d(eq, shape)
            if view is not None:
                return view
            return None
        bias = layer.shapes[1] if len(layer.datasets) - (6 if layer.float8 else 0) > 1 else None
        split = None
        if bias and 0 < len(bias) < len(shape) and shape[len(shape) - len(bias):] == bias:
            split = len(shape) - len(bias)  # free (output) axes last, as the bias shows
        attr = layer.h5_path.rsplit("/", 1)[-1].lstrip("_")
        if split is None and attr in _MHA_PROJECTIONS:
            split = _MHA_PROJECTIONS[attr] % len(shape)
        if split is None:
            return None
        layer.notes.append(f"EinsumDense kernel {shape} read as [in, out] split after axis "
                           f"{split} (no equation in config.json)")
        return (int(np.prod(shape[:split])), int(np.prod(shape[split:]))), True

    def tensors(self) -> list[TensorInfo]:
        return [t.info for t in self._tensors.values()]

    def datasets(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Tensor name → (HDF5 dataset path, stored shape), for writers of Keras weights."""
        return {name: (t.dataset, tuple(self._h5[t.dataset].shape))
                for name, t in self._tensors.items()}

    def load(self, name: str):
        import torch

        t = self._tensors.get(name)
        if t is None:
            raise Fp8ExportError(f"{self.path}: no tensor named {name!r}.")
        arr = _read(self._h5, t.dataset, self._where)
        if t.shape_2d is not None:
            arr = arr.reshape(t.shape_2d)
        if t.info.dtype == "BF16":
            return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(arr))

    # ---- training state ------------------------------------------------------------------
    def float8_modules(self) -> list[str]:
        return [layer.module for layer in self.layers if layer.float8]

    def training_state(self):
        """Keras float8 state (None when no layer is float8: nothing to reuse)."""
        if not self.float8_modules():
            return None
        f8 = []
        for layer in self.layers:
            if not layer.float8:
                continue
            ds = layer.datasets[-6:]
            f8.append(Float8Layer(
                module=layer.module, where=f"{self._where}: layer '{layer.module}'",
                variables={v: _read(self._h5, d, self._where)
                           for v, d in zip(FLOAT8_VARIABLES, ds, strict=True)}))
        state = keras_training_state(f8, self.version)
        state.warnings.extend(self.warnings)
        state.details["layer_notes"] = {layer.module: layer.notes for layer in self.layers
                                        if layer.notes}
        return state


# ---- helpers -------------------------------------------------------------------------------
def _implied_class(layer: _Layer) -> str | None:
    """Class of a layer config.json does not describe, where its weights make it certain."""
    attr = layer.h5_path.rsplit("/", 1)[-1].lstrip("_")
    if attr in _MHA_PROJECTIONS and len(layer.shapes[0]) >= 2:
        return "EinsumDense"  # MultiHeadAttention's projections
    if layer.float8:  # only Dense and EinsumDense have float8 variables
        return "Dense" if len(layer.shapes[0]) == 2 else "EinsumDense"
    return None


def _var_names(cls: str | None, layer: _Layer, n: int) -> list[str]:
    cfg = layer.layer_config
    if cls in ("Dense", "EinsumDense"):
        names = ["weight", "bias"][:n] if n <= 2 else None
    elif cls == "LayerNormalization":
        names = [v for v, on in (("gamma", cfg.get("scale", True)),
                                 ("beta", cfg.get("center", True))) if on]
    else:
        names = list(_KNOWN_VARS.get(cls, ()))
    if names is None or len(names) != n:
        return [f"vars.{i}" for i in range(n)]
    return names


def _attach_config(layers: list[_Layer], config: dict) -> None:
    """Give each layer its config.json entry, following nested Functional/Sequential models.

    Sublayers of custom layers or of MultiHeadAttention are not in config.json: they keep None.
    """
    root = config.get("config") if isinstance(config.get("config"), dict) else {}
    for layer in layers:
        entries, entry = root.get("layers"), None
        for name in layer.names:
            entry = _by_name(entries).get(name)
            if entry is None:
                break
            inner = entry.get("config") if isinstance(entry.get("config"), dict) else {}
            entries = inner.get("layers")
        layer.config = entry
    _fallback_names(layers, root)


def _by_name(entries: Any) -> dict[str, dict]:
    out = {}
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, dict):
            cfg = e.get("config") if isinstance(e.get("config"), dict) else {}
            name = cfg.get("name", e.get("name"))
            if isinstance(name, str):
                out[name] = e
    return out


def _fallback_names(layers: list[_Layer], root: dict) -> None:
    """Files from Keras < 3.6 have no ``name`` attribute: map ``layers/<snake_class>[_N]``."""
    by_group: dict[str, dict] = {}
    used: dict[str, int] = {}
    for e in root.get("layers") if isinstance(root.get("layers"), list) else []:
        if not isinstance(e, dict):
            continue
        base = _snake(str(e.get("class_name", "")))
        k = used.get(base, 0)
        used[base] = k + 1
        by_group[base if k == 0 else f"{base}_{k}"] = e
    for layer in layers:
        parts = layer.h5_path.split("/")
        entry = by_group.get(parts[1]) if len(parts) > 1 and parts[0] == "layers" else None
        if entry is None or layer.names[:1] != [parts[1].lstrip("_")]:
            continue  # has a name attribute (or is not under a functional model's layers)
        cfg = entry.get("config") if isinstance(entry.get("config"), dict) else {}
        if isinstance(cfg.get("name"), str):
            layer.names = [cfg["name"]] + layer.names[1:]  # nested layers too: mha.query_dense
        if len(parts) == 2 and layer.config is None:
            layer.config = entry


def _config_beside(path: Path) -> Path:
    stem = path.name[: -len(".weights.h5")]
    for cand in (path.with_name(f"{stem}.config.json"), path.with_name("config.json")):
        if cand.is_file():
            return cand
    raise Fp8ExportError(
        f"{path}: a .weights.h5 file needs the model's config.json beside it (named "
        f"config.json or {stem}.config.json; write it with open(..., 'w').write(model.to_json())"
        "), or convert the .keras file saved by model.save(), which holds both.")


def _read_limited(path: Path) -> bytes:
    return read_input(path, CONFIG, root=path.parent)


def _parse_json(raw: bytes, where: str) -> Any:
    return parse_json(raw, where, "Keras config")


def _probe(path: Path) -> None:
    """HDF5 can crash on a hostile file: walk it in a child process first (keras_probe)."""
    if not keras_probe.in_child():
        keras_probe.check(path)


def _open_member_h5(archive: SafeZip, path: Path, closers: list) -> h5py.File:
    where = f"{path} (model.weights.h5)"
    if archive.size("model.weights.h5") <= IN_MEMORY_H5_BYTES:
        buf = io.BytesIO(archive.read_bytes("model.weights.h5", IN_MEMORY_H5_BYTES))
        return _open_h5(buf, where)
    tmp = tempfile.TemporaryDirectory(prefix="fp8export-keras-")
    closers.append(tmp)
    return _open_h5(copy_member(archive, "model.weights.h5", Path(tmp.name)), where)


def _open_h5(src: Any, where: str) -> h5py.File:
    try:
        return h5py.File(src, "r")
    except (OSError, ValueError, RuntimeError, OverflowError) as exc:
        raise Fp8ExportError(f"{where}: not a readable HDF5 file ({exc}); it is truncated or "
                             "not a Keras weights file. Re-save the model.") from None


class _h5_errors:
    """Turn h5py's errors on a damaged file into one Fp8ExportError naming the file."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        # OverflowError: h5py turns a corrupt object count into a too-large Python int.
        if typ is not None and issubclass(typ, (OSError, KeyError, ValueError, RuntimeError,
                                                TypeError, OverflowError)):
            raise Fp8ExportError(f"{self.where}: cannot read the HDF5 weights ({exc}); the "
                                 "file is truncated or corrupt. Re-save the model.") from None
        return False


def _check_dataset(ds: h5py.Dataset, where: str) -> None:
    if ds.external or ds.is_virtual:
        raise Fp8ExportError(f"{where}: {ds.name} stores its data outside the file (external "
                             "or virtual dataset); refused.")
    kind = ds.dtype.kind
    if kind not in "fiub" and ds.attrs.get("dtype") != "bfloat16":
        raise Fp8ExportError(f"{where}: {ds.name} has dtype {ds.dtype}; Keras variables are "
                             "numeric.")
    declared = int(np.prod(ds.shape, dtype=np.float64) * ds.dtype.itemsize)
    stored = ds.id.get_storage_size()
    if declared and not stored:
        # HDF5 allocates a dataset's storage when it is first written; reading one that never
        # was gives its fill value, for any declared size: a small file of such datasets would
        # become gigabytes of output. Keras writes every variable it saves.
        raise Fp8ExportError(f"{where}: {ds.name} declares {declared} bytes but was never "
                             "written (no data stored; reading it would give the fill value). "
                             "The file is corrupt or crafted; re-save the model.")
    if declared > 2**20 and declared > H5_BOMB_RATIO * stored:
        raise Fp8ExportError(f"{where}: {ds.name} declares {declared} bytes but stores "
                             f"{stored}; refusing to expand it.")


def _dtype_of(ds: h5py.Dataset, where: str) -> str:
    if ds.attrs.get("dtype") == "bfloat16":
        return "BF16"
    name = np.dtype(ds.dtype).name
    if name not in _DTYPES:
        raise Fp8ExportError(f"{where}: {ds.name} has unsupported dtype {name}.")
    return _DTYPES[name]


def _read(h5: h5py.File, dataset: str, where: str) -> np.ndarray:
    with _h5_errors(where):
        ds = h5[dataset]
        if ds.attrs.get("dtype") == "bfloat16":
            return np.asarray(ds[()]).view(np.uint16).copy() if ds.dtype.itemsize == 2 \
                else np.asarray(ds[()])
        return np.asarray(ds[()])


def _quiet_close(obj) -> None:
    try:
        (obj.cleanup if isinstance(obj, tempfile.TemporaryDirectory) else obj.close)()
    except Exception:  # closing after an error must not hide that error
        pass
