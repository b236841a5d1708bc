"""A model as parts built one at a time: its decoder layers, and the rest (embeddings, final
norm, head), each materialized on the device from the checkpoint's tensors only when it runs.

The architecture is transformers' own, built once with its parameters on the meta device and
its buffers real (rotary tables: :func:`fp8export.models.empty_model` with ``empty=True``):
the **skeleton**. A decoder layer is a deep copy of the skeleton's (still meta, so nothing is
allocated), whose tensors are then read — only that layer's, straight from the safetensors
shards through the checkpoint reader, converted as transformers converts them at load time
(:func:`fp8export.models.hf_state`: MoE experts stacked) — and put on the device. The same
module class computes the same thing as in the whole model: every number matches.

Two sources: :class:`CheckpointParts` (the high-precision model: calibration, GPTQ, the verify
reference and its fp32 floor) and :class:`Fp8FolderParts` (an FP8 folder: the verify candidate,
its quantized linears as the FP8 runtime's :class:`~fp8export.runtime.fp8_linear.Fp8Linear`,
fused groups and KV-cache emulation as :func:`~fp8export.runtime.fp8_model.load_fp8_model` sets
them up).
"""

from __future__ import annotations

import abc
import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp8export.errors import Fp8ExportError

FOLDER = "\0folder"  # read_layer's entry holding an FP8 folder's stored tensors of the layer
_READS = threading.local()  # .pin: this thread reads tensors into page-locked memory


@contextlib.contextmanager
def pinned_reads() -> Iterator[None]:
    """While open, this thread's reads of checkpoint tensors land in page-locked memory (torch's
    caching host allocator: the buffers of a layer already copied to the GPU are reused), so
    the copy to the GPU neither waits for the device nor goes through a staging buffer."""
    _READS.pin = True
    try:
        yield
    finally:
        _READS.pin = False


def pin_tensors(obj: Any) -> Any:
    """``obj`` (tensors in dicts) with every host tensor page-locked (copied unless it is)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type != "cpu" or obj.is_pinned() else obj.pin_memory()
    if isinstance(obj, dict):
        return {k: pin_tensors(v) for k, v in obj.items()}
    return obj


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The name and ModuleList of the model's repeated blocks (transformers' no-split modules:
    the decoder layers). Raises Fp8ExportError when there is not exactly one such list."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and all(type(c).__name__ in classes for c in m)]
    if len(found) != 1:
        what = "no list of decoder layers" if not found else \
            f"{len(found)} lists of layers ({', '.join(n for n, _ in found)})"
        raise Fp8ExportError(f"{type(model).__name__}: layer streaming needs one list of "
                             f"decoder layers; this model has {what}. Run it whole "
                             "(--offload none).")
    return found[0]


class Named(nn.Module):
    """``module`` reachable under its full name (``model.layers.3``) from this container, so
    name-keyed tools (observers, FP8 swaps, fused groups) address a layer built on its own
    by the names it has in the whole model."""

    def __init__(self, name: str, module: nn.Module, config=None):
        super().__init__()
        if config is not None:
            self.config = config
        parent: nn.Module = self
        parts = name.split(".")
        for p in parts[:-1]:
            child = nn.Module()
            parent.add_module(p, child)
            parent = child
        parent.add_module(parts[-1], module)


def set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` of ``module`` by ``value`` (a parameter stays a
    parameter, without gradient)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        raise Fp8ExportError(f"internal: {name} is no tensor of {type(module).__name__}.")


def materialize(module: nn.Module, values: dict[str, torch.Tensor], device: torch.device,
                where: str) -> None:
    """Put ``values`` (names relative to ``module``) into ``module`` on ``device``, move its
    other real tensors there, and refuse a tensor left on the meta device."""
    aliases: dict[int, list[str]] = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + \
            list(module.named_buffers(remove_duplicate=False)):
        aliases.setdefault(id(t), []).append(name)
    for names in aliases.values():
        given = next((values[n] for n in names if n in values), None)
        current = _get(module, names[0])
        if given is not None:
            if tuple(given.shape) != tuple(current.shape):
                raise Fp8ExportError(f"{where}: tensor {names[0]} has shape "
                                     f"{tuple(given.shape)} but the architecture expects "
                                     f"{tuple(current.shape)}.")
            # from page-locked memory the copy is queued, not waited for (the caching host
            # allocator keeps the buffer until it is done)
            value = given.to(device, non_blocking=given.device.type == "cpu"
                             and given.is_pinned())
        elif current.device.type == "meta":
            raise Fp8ExportError(f"{where}: weight {names[0]} the architecture needs is "
                                 "missing. The checkpoint does not match its config.json.")
        else:
            value = current.to(device)
        for n in names:
            set_tensor(module, n, value)


def _get(module: nn.Module, name: str) -> torch.Tensor:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    t = owner._parameters.get(leaf)
    return t if t is not None else owner._buffers[leaf]


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """The skeleton's real buffers (rotary tables) onto ``device``; meta parameters stay."""
    for mod in model.modules():
        for k, b in list(mod._buffers.items()):
            if b is not None and b.device.type != "meta":
                mod._buffers[k] = b.to(device)


class Parts(abc.ABC):
    """A model of one source as its parts (see the module docstring). Subclasses open the
    source and say how a layer is built; :meth:`close` releases the files."""

    path: Path
    config: dict[str, Any]
    skeleton: nn.Module
    dtype: torch.dtype
    loaders: dict[str, Callable[[], torch.Tensor]]  # model state key -> reads it
    nbytes: dict[str, int]  # model state key -> bytes it takes on the device

    def _index(self) -> None:
        from fp8export.cpu_gemm import fp32_linears

        fp32_linears(self.skeleton)  # as the whole model computes (models.load_model)
        self.layers_name, self.layers = decoder_layers(self.skeleton)
        self.count = len(self.layers)
        self.prefix = [f"{self.layers_name}.{i}." for i in range(self.count)]
        self.layer_keys: list[list[str]] = [[] for _ in range(self.count)]
        self.rest_keys: list[str] = []
        for key in self.loaders:
            i = _layer_of(key, self.layers_name)
            if i is not None and i < self.count:
                self.layer_keys[i].append(key)
            else:
                self.rest_keys.append(key)
        self._memo = {id(self.skeleton.config): self.skeleton.config}

    # -- sizes ---------------------------------------------------------------------------------
    def layer_bytes(self, i: int) -> int:
        return sum(self.nbytes.get(k, 0) for k in self.layer_keys[i])

    def rest_bytes(self) -> int:
        return sum(self.nbytes.get(k, 0) for k in self.rest_keys)

    def total_bytes(self) -> int:
        return sum(self.layer_bytes(i) for i in range(self.count)) + self.rest_bytes()

    # -- layers --------------------------------------------------------------------------------
    def read_layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s tensors in host memory (names relative to the layer), cast as the
        model will hold them: what a prefetch thread reads while another layer runs."""
        n = len(self.prefix[i])
        return {k[n:]: self._cast(k, self.loaders[k]()) for k in self.layer_keys[i]}

    def _cast(self, key: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == self.dtype:
            return t
        return t.to(self.dtype, copy=False)

    @abc.abstractmethod
    def build_layer(self, i: int, device: torch.device,
                    values: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """Layer ``i`` ready to run on ``device`` (``values``: from :meth:`read_layer`); each
        kind of parts (a checkpoint's, an FP8 folder's) builds it its own way."""

    def copy_layer(self, i: int) -> nn.Module:
        """A meta copy of the skeleton's layer ``i`` (shares the skeleton's config)."""
        return copy.deepcopy(self.layers[i], dict(self._memo))

    def named(self, i: int, layer: nn.Module) -> Named:
        return Named(f"{self.layers_name}.{i}", layer, self.skeleton.config)

    # -- the rest ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rest_on(self, device: torch.device) -> Iterator[None]:
        """While open, each module outside the layers reads its own tensors onto ``device`` the
        first time it runs (the embedding before the layers, the norm and head after them), and
        gives them back to the meta device on exit."""
        rest = [(n, m) for n, m in self.skeleton.named_modules()
                if not (n == self.layers_name or n.startswith(self.layers_name + "."))
                and any(t.device.type == "meta" for t in m._parameters.values()
                        if t is not None)]
        saved: list[tuple[nn.Module, str, Any]] = []
        keys = set(self.rest_keys)
        aliases = _aliases(self.skeleton)
        for head, embedding in _tied(self.skeleton).items():  # a tied head reads the embedding
            aliases[head] = [*aliases.get(head, [head]), embedding]

        def onload(name: str):
            def hook(mod, args, kwargs):
                for leaf, p in list(mod._parameters.items()):
                    if p is None or p.device.type != "meta":
                        continue
                    full = f"{name}.{leaf}" if name else leaf
                    key = next((a for a in aliases.get(full, [full]) if a in keys), None)
                    if key is None:
                        raise Fp8ExportError(f"{self.path}: weight {full} the architecture "
                                             "needs is missing. The checkpoint does not match "
                                             "its config.json.")
                    saved.append((mod, leaf, p))
                    value = self._cast(key, self.loaders[key]()).to(device)
                    mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
                return None
            return hook

        handles = [m.register_forward_pre_hook(onload(n), with_kwargs=True) for n, m in rest]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for mod, leaf, p in reversed(saved):
                mod._parameters[leaf] = p

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter name -> all names of that parameter (tied embeddings and head)."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return {n: names for names in by_id.values() for n in names}


def _tied(model: nn.Module) -> dict[str, str]:
    """``{head weight: input embedding weight}`` when the config ties them."""
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "tie_word_embeddings", False):
        return {}
    try:
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    if head is None or emb is None or id(head) not in names or id(emb) not in names:
        return {}
    return {f"{names[id(head)]}.weight": f"{names[id(emb)]}.weight"}


def _layer_of(key: str, layers_name: str) -> int | None:
    if not key.startswith(layers_name + "."):
        return None
    head = key[len(layers_name) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


class CheckpointParts(Parts):
    """The high-precision model of a checkpoint, in ``dtype``; ``experts``: how MoE layers run
    (``routed``, or ``all`` for calibration: :func:`fp8export.moe.unfuse_experts`), None to
    keep transformers' fused experts."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                 experts: str | None = None):
        from fp8export.checkpoint.source import open_checkpoint
        from fp8export.models import empty_model, hf_state, refuse_quantized
        from fp8export.placement import need_accelerate

        self.path, self.dtype, self.experts = Path(path), dtype, experts
        need_accelerate(f"{path}: layer streaming")
        self.ckpt = open_checkpoint(path)
        try:
            if not self.ckpt.config:
                raise Fp8ExportError(f"{path}: no config.json beside the weights, so the "
                                     "architecture is unknown. Put the model's config.json in "
                                     "the folder.")
            refuse_quantized(self.ckpt, self.path)
            infos = self.ckpt.tensors()
            self.config = dict(self.ckpt.config)
            self.skeleton = empty_model(self.config, self.path, dtype=dtype,
                                        shapes={i.name: tuple(i.shape) for i in infos},
                                        empty=True)
            expected = set(self.skeleton.state_dict())
            state = hf_state(self.skeleton, {i.name: (lambda n=i.name: self._load(n))
                                             for i in infos}, self.path, lazy=True)
            self.loaders = {k: v for k, v in state.items() if k in expected}
            shapes = _converted_shapes(self.skeleton, infos, self.path)
            self.nbytes = {k: _numel(shapes.get(k)) * dtype.itemsize for k in self.loaders}
            self._index()
            self.leaves = None
            if experts is not None:
                from fp8export.moe import is_fused_experts, model_leaves

                if any(is_fused_experts(m) for m in self.skeleton.modules()):
                    self.leaves = model_leaves(self.skeleton)
        except BaseException:
            self.ckpt.close()
            raise

    def _load(self, name: str) -> torch.Tensor:
        """One stored tensor; under :func:`pinned_reads` read straight into page-locked
        memory where the checkpoint can (safetensors), saving a copy."""
        direct = getattr(self.ckpt, "load_pinned", None)
        if getattr(_READS, "pin", False) and direct is not None:
            return direct(name)
        return self.ckpt.load(name)

    def build_layer(self, i, device, values=None):
        from fp8export.moe import unfuse_experts

        values = self.read_layer(i) if values is None else values
        layer = self.copy_layer(i)
        materialize(layer, values, torch.device(device), f"{self.path} (layer {i})")
        if self.leaves is not None:
            unfuse_experts(layer, mode=self.experts, leaves=self.leaves)
        return layer.eval()

    def close(self):
        self.ckpt.close()


def _numel(shape) -> int:
    n = 1
    for d in shape or ():
        n *= int(d)
    return n


def _converted_shapes(model, infos, where: Path) -> dict[str, tuple[int, ...]]:
    from fp8export.models import converted_shapes

    return converted_shapes(model, {i.name: tuple(i.shape) for i in infos}, where)


class Fp8FolderParts(Parts):
    """An FP8 folder as the FP8 runtime runs it (``mode``: its GEMM path, resolved for the
    device), high-precision tensors in ``dtype``."""

    def __init__(self, path: str | Path, dtype: torch.dtype, mode: str):
        from fp8export.fp8dir.reader import read_fp8_folder
        from fp8export.keras_model.config import is_keras_config
        from fp8export.models import empty_model, model_key, weight_conversions
        from fp8export.moe import unfuse_experts
        from fp8export.placement import need_accelerate
        from fp8export.runtime.fp8_model import dynamic_of, fused_groups

        self.path, self.dtype, self.mode = Path(path), dtype, mode
        need_accelerate(f"{path}: layer streaming")
        self.folder = read_fp8_folder(self.path)
        try:
            self.manifest, self.config = self.folder.manifest, self.folder.config
            self.format = self.folder.format
            if is_keras_config(self.config):
                raise Fp8ExportError(f"{path}: a Keras FP8 folder runs whole; layer streaming "
                                     "is for transformers models (--offload none).")
            tensors = self.folder.tensors
            shapes = tensors.shapes()
            self.skeleton = empty_model(self.config, self.path, dtype=dtype, shapes=shapes,
                                        empty=True)
            renamings = weight_conversions(self.skeleton)[0]
            self.stored_fused = [n for n in shapes if model_key(
                self.skeleton, n, renamings).endswith((".experts.gate_up_proj",
                                                       ".experts.down_proj"))]
            if not self.stored_fused:
                unfuse_experts(self.skeleton)
            self.quantized = self.manifest.get("quantized") or {}
            self.names = {m: model_key(self.skeleton, f"{m}.weight", renamings)
                          .removesuffix(".weight") for m in self.quantized}
            self.dynamic = dynamic_of(self.manifest, self.path, self.config)
            self.groups = fused_groups(self.quantized, self.config, self.names)
            state = self.skeleton.state_dict()
            swapped = set(self.names.values())
            self.loaders, self.nbytes = {}, {}
            self.owned: dict[str, list[str]] = {}
            for name, shape in shapes.items():
                owner = name.rpartition(".")[0]
                self.owned.setdefault(owner, []).append(name)
                key = model_key(self.skeleton, name, renamings)
                if owner in self.quantized:  # weight and scales go into the Fp8Linear
                    key = f"{self.names[owner]}.{name.rpartition('.')[2]}"
                    # E4M3 weight (1 byte), float32 scales
                    self.nbytes[key] = _numel(shape) * (1 if name.endswith(".weight") else 4)
                    continue
                if key in state:
                    self.loaders[key] = lambda n=name: tensors[n]
                    self.nbytes[key] = _numel(shape) * dtype.itemsize
            missing = [k for k in state if k not in self.loaders
                       and k.rpartition(".")[0] not in swapped
                       and not k.endswith(("inv_freq", "position_ids", "original_inv_freq"))
                       and not (getattr(self.skeleton.config, "tie_word_embeddings", False)
                                and k.endswith(("lm_head.weight", "decoder.weight")))]
            if missing:
                raise Fp8ExportError(f"{path}: {len(missing)} tensors the architecture needs "
                                     f"are missing, e.g. {missing[:3]}. Re-run `fp8export "
                                     "convert`.")
            self._index()
            for key in list(self.nbytes):  # FP8 weights and scales count with their layer
                i = _layer_of(key, self.layers_name)
                if i is not None and key not in self.loaders:
                    self.layer_keys[i].append(key)
            self.kv = self._kv_cache()
            # what building and running the layers shows, for the runner's description
            self.fallbacks: dict[str, str] = {}
            self.unfused: dict[str, str] = {}
            self.expert_gemms: dict[str, int] = {}
        except BaseException:
            self.folder.close()
            raise

    def _kv_cache(self) -> str | None:
        from fp8export.runtime.fp8_model import emulate_kv_cache

        # installed on the skeleton: its layers' copies carry the attention hook
        return emulate_kv_cache(self.skeleton, self.manifest, self.folder.tensors, self.path)

    def _quantized_in(self, i: int) -> dict[str, Any]:
        return {m: e for m, e in self.quantized.items() if self.names[m].startswith(self.prefix[i])}

    def read_layer(self, i):
        """As :class:`Parts`, plus the folder's tensors of the layer's quantized linears under
        their folder names (key ``FOLDER``)."""
        n = len(self.prefix[i])
        out: dict[str, Any] = {k[n:]: self._cast(k, self.loaders[k]())
                               for k in self.layer_keys[i] if k in self.loaders}
        tensors = self.folder.tensors
        names = set()
        for m, entry in self._quantized_in(i).items():
            names.update(self.owned.get(m, ()))
            names.update(v for k in ("weight", "weight_scale_tensor", "input_scale_tensor")
                         if isinstance(v := entry.get(k), str) and v in tensors)
        out[FOLDER] = {t: tensors[t] for t in sorted(names)}
        return out

    def build_layer(self, i, device, values=None):
        from fp8export.runtime.fp8_fused import fuse_projections
        from fp8export.runtime.fp8_model import swap_fp8_linears

        values = dict(self.read_layer(i) if values is None else values)
        stored = values.pop(FOLDER)
        prefix = self.prefix[i]
        layer = self.copy_layer(i)
        view = self.named(i, layer)
        mine = self._quantized_in(i)
        fallbacks = swap_fp8_linears(view, mine, stored, mode=self.mode, dtype=self.dtype,
                                     where=self.path, dynamic=self.dynamic,
                                     names={m: self.names[m] for m in mine})
        self.fallbacks.update(fallbacks)
        materialize(layer, values, torch.device(device), f"{self.path} (layer {i})")
        layer.to(device)
        groups = {g: ms for g, ms in self.groups.items() if g.startswith(prefix)}
        self.unfused.update(fuse_projections(view, groups))
        return layer.eval()

    @contextlib.contextmanager
    def rest_on(self, device):
        """As :class:`Parts`, with quantized modules outside the layers (a quantized head) as
        Fp8Linear for the duration."""
        from fp8export.runtime.fp8_model import swap_fp8_linears

        outside = {m: e for m, e in self.quantized.items()
                   if not self.names[m].startswith(self.layers_name + ".")}
        originals = {m: self.skeleton.get_submodule(self.names[m]) for m in outside}
        if outside:
            swap_fp8_linears(self.skeleton, outside, self.folder.tensors, mode=self.mode,
                             dtype=self.dtype, where=self.path, dynamic=self.dynamic,
                             names={m: self.names[m] for m in outside})
            for m in outside:
                self.skeleton.get_submodule(self.names[m]).to(device)
        try:
            with super().rest_on(device):
                yield
        finally:
            for m, old in originals.items():
                parent, _, child = self.names[m].rpartition(".")
                setattr(self.skeleton.get_submodule(parent) if parent else self.skeleton,
                        child, old)

    def close(self):
        self.folder.close()
