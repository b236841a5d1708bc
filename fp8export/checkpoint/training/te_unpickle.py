"""Decoding Transformer Engine ``_extra_state`` values without running checkpoint code.

A TE module's ``_extra_state`` is a pickle written by TE's ``get_extra_state``
(``transformer_engine/pytorch/module/base.py``; ``transformer_engine/pytorch/_extra_state.py``
from v2.18). Its layouts, by TE version (``reference/training_amax_formats.md`` §1.2):

=============  ==========================================================================
v0.1–v0.5      the state dict itself (or None), stored directly in the outer state dict
v0.6–v0.11     uint8 tensor holding ``pickle.dumps(state)``; None pickled when not FP8
v0.12–v1.13    ``io.BytesIO`` holding ``torch.save(state)`` (``torch.save(None)`` when not
               FP8); a uint8 pickle only under ONNX-export mode
v2.0–v2.3      uint8 tensor of ``pickle.dumps(state)``; not FP8: the pickle of None
v2.4+          same; not FP8 (and, from v2.18, stateless recipes): ``torch.empty(0, uint8)``
=============  ==========================================================================

The plain pickles (v0.6–v0.11, v2.x) name TE's recipe classes and torch's tensor rebuilders.
:class:`_ExtraStateUnpickler` resolves exactly those names: TE's classes become the inert
stand-ins below (TE is never imported), ``torch.storage._load_from_bytes`` becomes a
``torch.load(weights_only=True)`` of the legacy storage bytes, ``torch._utils._rebuild_tensor_v2``
a checked call of torch's own rebuilder. Every other global is refused with an
:class:`Fp8ExportError` naming the layer — except that a *custom* ``amax_compute_algo`` /
``scaling_factor_compute_algo`` callable of a recipe (the reference's pitfall) is kept as an
unresolved name, never imported and never callable; anywhere else such a name is refused.
"""

from __future__ import annotations

import collections
import io
import pickle
import warnings
import zipfile
from typing import Any

from fp8export.errors import Fp8ExportError

# The largest extra state we decode. A real one is a few small tensors: a GroupedLinear of
# 256 experts with a 1024-step history is ~3 MB forward + ~2 MB backward. Anything far larger
# is corrupt or hostile, and decoding it would only waste memory.
MAX_EXTRA_STATE_BYTES = 256 * 1024 * 1024

RECIPE_MODULE = "transformer_engine.common.recipe"

# Recipe fields that may legitimately hold a user's callable (TE docs: "Alternatively, one may
# pass a function"; CustomRecipe's quantizer factory). Only there may an unresolved name stay.
CALLABLE_FIELDS = frozenset({"amax_compute_algo", "scaling_factor_compute_algo", "qfactory"})


# --------------------------------------------------------------------------- inert stand-ins

class _ReadOnlyClass(type):
    """Metaclass of the stand-ins: a pickle's BUILD opcode applied to a *class* it got from
    ``find_class`` would otherwise ``setattr`` on it and change it for every later load."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise TypeError(f"{cls.__name__} is a read-only stand-in")

    def __delattr__(cls, name: str) -> None:
        raise TypeError(f"{cls.__name__} is a read-only stand-in")


class RecipeStandIn(metaclass=_ReadOnlyClass):
    """Inert copy of a TE recipe dataclass (DelayedScaling, Float8CurrentScaling, ...).

    TE's recipes are (pydantic) dataclasses, pickled as NEWOBJ(cls) + BUILD(__dict__). We keep
    the state dict as plain data; ``recipe_name`` records which class it was.
    """

    recipe_name = "Recipe"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form of protocol 2+
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise TypeError(f"{self.recipe_name} state is a {type(state).__name__}, not a dict")
        self.fields = {str(k): v for k, v in state.items()}

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, "fields", {}).get(name, default)

    def __repr__(self) -> str:
        return f"{self.recipe_name}({getattr(self, 'fields', {})!r})"


def _recipe_class(name: str) -> type[RecipeStandIn]:
    return _ReadOnlyClass(name, (RecipeStandIn,), {"recipe_name": name, "__module__": __name__})


# Every recipe class TE has shipped (v0.x DelayedScaling … v2.x NVFP4BlockScaling, CustomRecipe,
# MXFP4QAT*; ``transformer_engine/common/recipe/__init__.py``). Only DelayedScaling keeps state.
RECIPE_CLASSES = {name: _recipe_class(name) for name in (
    "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
    "NVFP4BlockScaling", "CustomRecipe", "MXFP4QATMXFP8BlockScaling", "MXFP4QATFloat8BlockScaling",
)}


class FormatHelperStandIn(tuple, metaclass=_ReadOnlyClass):
    """``_FormatHelper(max_fwd, max_bwd)``: a NamedTuple, rebuilt through NEWOBJ(cls, *args)."""

    def __new__(cls, *args: Any):
        if len(args) != 2 or not all(isinstance(a, (int, float)) for a in args):
            raise TypeError(f"_FormatHelper expects two numbers, got {args!r}")
        return super().__new__(cls, args)

    @property
    def max_fwd(self) -> float:
        return float(self[0])

    @property
    def max_bwd(self) -> float:
        return float(self[1])


class NamedTupleStandIn(tuple, metaclass=_ReadOnlyClass):
    """Other TE NamedTuples (``_OverrideLinearPrecision``): a plain tuple of their values."""

    def __new__(cls, *args: Any):
        return super().__new__(cls, args)


class FormatStandIn(metaclass=_ReadOnlyClass):
    """``Format`` (an Enum) pickles as REDUCE(Format, (value,)): we keep the value's maxima."""

    _NAMES = {(448.0, 448.0): "E4M3", (57344.0, 57344.0): "E5M2", (448.0, 57344.0): "HYBRID",
              (6.0, 6.0): "E2M1"}
    BY_NAME = {name: pair for pair, name in _NAMES.items()}

    def __init__(self, value: Any):
        if not isinstance(value, tuple) or len(value) != 2:
            raise TypeError(f"Format expects a (max_fwd, max_bwd) pair, got {value!r}")
        self.max_fwd, self.max_bwd = float(value[0]), float(value[1])
        self.name = self._NAMES.get((self.max_fwd, self.max_bwd), "unknown")

    def __repr__(self) -> str:
        return f"Format.{self.name}"


class FrozenParamsStandIn(metaclass=_ReadOnlyClass):
    """``QParams`` / ``MMParams``: frozen dataclasses; their fields are kept as data."""

    def __setstate__(self, state: Any) -> None:
        self.fields = dict(state) if isinstance(state, dict) else {"state": state}


class UnresolvedGlobal:
    """A global the checkpoint named that we do not resolve. Inert: it can only be looked at.

    Calling it, instantiating it or restoring state into it raises; ``refused`` reports it.
    """

    __slots__ = ("module", "name", "layer")

    def __init__(self, module: str, name: str, layer: str):
        self.module, self.name, self.layer = module, name, layer

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def refusal(self) -> Fp8ExportError:
        return Fp8ExportError(
            f"{self.layer}: the FP8 extra state names the Python global {self.qualname!r}, which "
            "fp8export does not load (only Transformer Engine recipe data and tensors are "
            "allowed); refused, nothing was executed. Re-save the checkpoint from a trusted "
            "environment, or convert with --scales calibrate/weights after removing the "
            "'_extra_state' entries.")

    def __call__(self, *args: Any, **kwargs: Any):
        raise self.refusal()

    def __setstate__(self, state: Any) -> None:
        raise self.refusal()

    def __reduce__(self):  # never re-pickled by us; make that explicit
        raise self.refusal()

    def __repr__(self) -> str:
        return f"<unresolved {self.qualname}>"


# ------------------------------------------------------------------------- torch rebuilders

def _load_storage(data: Any):
    """Replacement for ``torch.storage._load_from_bytes`` (which uses weights_only=False)."""
    import torch

    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"storage payload is a {type(data).__name__}, not bytes")
    # The bytes are a legacy-format torch.save of one storage (CUDA ones in TE 0.x/1.x, hence
    # map_location); torch's weights-only unpickler reads that format too.
    with warnings.catch_warnings():  # torch warns about odd protocols of corrupt input
        warnings.simplefilter("ignore")
        obj = torch.load(io.BytesIO(bytes(data)), weights_only=True, map_location="cpu")
    if not isinstance(obj, torch.TypedStorage):
        raise TypeError(f"storage payload holds a {type(obj).__name__}, not a storage")
    return obj


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any,
                    requires_grad: Any = False, backward_hooks: Any = None, metadata: Any = None):
    """``torch._utils._rebuild_tensor_v2`` with its arguments checked first.

    Only a typed storage is accepted; hooks and metadata (which could carry objects) must be
    empty; and the view must lie inside the storage — torch's rebuilder does not check that
    (found by this module's tests), so a hostile size or stride would read past the buffer.
    """
    import torch

    if not isinstance(storage, torch.TypedStorage):
        raise TypeError(f"tensor rebuilt from a {type(storage).__name__}, not a typed storage")
    size, stride = tuple(size), tuple(stride)
    ints = (storage_offset, *size, *stride)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise TypeError("tensor offset, size and stride must be non-negative integers")
    if len(size) != len(stride):
        raise TypeError("tensor size and stride differ in length")
    if all(s > 0 for s in size):
        last = storage_offset + sum((s - 1) * st for s, st in zip(size, stride))
        if last >= storage._size():  # _size: size() without the TypedStorage deprecation warning
            raise TypeError(f"tensor view (size {size}, stride {stride}, offset "
                            f"{storage_offset}) reaches past its storage of {storage._size()} "
                            "elements")
    for what, value in (("backward hooks", backward_hooks), ("extra metadata", metadata)):
        if value is not None and not (isinstance(value, dict) and not value):
            raise TypeError(f"tensor carries {what}")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, tuple(size), tuple(stride),
                                           bool(requires_grad), collections.OrderedDict())


class _ExtraStateUnpickler(pickle.Unpickler):
    """Unpickler whose ``find_class`` knows only TE recipe data and torch tensor rebuilding."""

    def __init__(self, file: io.BytesIO, layer: str):
        super().__init__(file)
        self.layer = layer
        self.unresolved: list[UnresolvedGlobal] = []

    def find_class(self, module: str, name: str) -> Any:
        if module == RECIPE_MODULE:
            if name in RECIPE_CLASSES:
                return RECIPE_CLASSES[name]
            if name == "Format":
                return FormatStandIn
            if name.startswith("Format.") and name[7:] in FormatStandIn.BY_NAME:
                # an Enum member pickled by qualified name (enum.pickle_by_global_name)
                return FormatStandIn(FormatStandIn.BY_NAME[name[7:]])
            if name == "_FormatHelper":
                return FormatHelperStandIn
            if name == "_OverrideLinearPrecision":
                return NamedTupleStandIn
            if name in ("QParams", "MMParams"):
                return FrozenParamsStandIn
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict  # the (empty) backward-hooks argument of a tensor
        ref = UnresolvedGlobal(str(module), str(name), self.layer)
        self.unresolved.append(ref)
        return ref

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of a TE extra state")


def _check_unresolved(obj: Any, layer: str) -> None:
    """Refuse unresolved globals anywhere except in a recipe's callable fields.

    Iterative, and each container is visited once: a hostile pickle can build cyclic or
    exponentially shared structures through its memo.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, str | None]] = [(obj, None)]
    while stack:
        item, field = stack.pop()
        if isinstance(item, UnresolvedGlobal):
            if field in CALLABLE_FIELDS:
                continue
            raise item.refusal()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, RecipeStandIn):
            stack.extend((v, k) for k, v in getattr(item, "fields", {}).items())
        elif isinstance(item, FrozenParamsStandIn):
            stack.append((getattr(item, "fields", {}), None))
        elif isinstance(item, dict):
            stack.extend((k, None) for k in item)
            stack.extend((v, None) for v in item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((v, None) for v in item)


def unpickle_extra_state(data: bytes, layer: str) -> Any:
    """Decode one plain-pickle extra state (TE v0.6–v0.11, v2.x). Raises only Fp8ExportError."""
    if len(data) > MAX_EXTRA_STATE_BYTES:
        raise Fp8ExportError(f"{layer}: FP8 extra state is {len(data)} bytes, far larger than any "
                             "Transformer Engine state; refused as corrupt.")
    unpickler = _ExtraStateUnpickler(io.BytesIO(data), layer)
    try:
        obj = unpickler.load()
    except Fp8ExportError:
        raise
    except RecursionError as exc:
        raise Fp8ExportError(f"{layer}: FP8 extra state is nested too deeply to be a Transformer "
                             "Engine state; refused.") from exc
    except Exception as exc:  # pickle raises many types on corrupt data; all mean "not valid"
        raise Fp8ExportError(
            f"{layer}: FP8 extra state is not a readable Transformer Engine pickle "
            f"({type(exc).__name__}: {_first_line(exc)}). The checkpoint is truncated or "
            "corrupt; re-save it.") from exc
    if unpickler.unresolved:
        _check_unresolved(obj, layer)
    return obj


def _torch_load_inner(data: bytes, layer: str) -> Any:
    """TE 0.12–1.13: the extra state is ``torch.save(state)``; tensors and plain data only."""
    import torch

    try:
        with warnings.catch_warnings():  # torch warns about odd protocols of corrupt input
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise Fp8ExportError(
            f"{layer}: FP8 extra state (a torch.save payload) holds Python objects other than "
            f"tensors and plain data; refused, nothing was executed ({_first_line(exc)}).") from exc
    except Exception as exc:
        raise Fp8ExportError(
            f"{layer}: FP8 extra state is not a readable torch.save payload "
            f"({type(exc).__name__}: {_first_line(exc)}). The checkpoint is truncated or "
            "corrupt; re-save it.") from exc


def _first_line(exc: BaseException) -> str:
    """The informative line of an exception: torch's weights-only errors name the refused
    global on a line of their own, after several lines of generic advice."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln or "global" in ln]
    return (named or lines or ["no detail"])[0][:240]


def decode_extra_state(value: Any, layer: str) -> tuple[Any, str]:
    """Turn one ``_extra_state`` value into TE's state (a dict, or None) and its layout name.

    Layout names: ``te-0.5-dict``, ``te-uint8-pickle`` (v0.6–v0.11 and v2.x),
    ``te-1.x-bytesio``, ``te-uint8-torch-save`` (a zip payload in a uint8 tensor),
    ``empty`` (empty tensor). Raises Fp8ExportError naming ``layer`` for anything else.
    """
    import torch

    if value is None:
        return None, "none"
    if isinstance(value, dict):
        return value, "te-0.5-dict"
    if isinstance(value, io.BytesIO):
        data = value.getvalue()
        if len(data) > MAX_EXTRA_STATE_BYTES:
            raise Fp8ExportError(f"{layer}: FP8 extra state is {len(data)} bytes; refused as "
                                 "corrupt.")
        if not data:
            return None, "empty"
        return _torch_load_inner(data, layer), "te-1.x-bytesio"
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return None, "empty"
        if value.dtype != torch.uint8 or value.dim() != 1:
            raise Fp8ExportError(
                f"{layer}: FP8 extra state is a {value.dtype} tensor of shape "
                f"{tuple(value.shape)}; Transformer Engine stores a 1-D uint8 tensor. The "
                "checkpoint is corrupt or not from Transformer Engine.")
        if value.numel() > MAX_EXTRA_STATE_BYTES:
            raise Fp8ExportError(f"{layer}: FP8 extra state is {value.numel()} bytes; refused "
                                 "as corrupt.")
        data = value.contiguous().numpy().tobytes()
        if data[:4] == b"PK\x03\x04" and zipfile.is_zipfile(io.BytesIO(data)):
            return _torch_load_inner(data, layer), "te-uint8-torch-save"
        return unpickle_extra_state(data, layer), "te-uint8-pickle"
    raise Fp8ExportError(
        f"{layer}: FP8 extra state is a {type(value).__name__}; Transformer Engine stores a "
        "uint8 tensor, an io.BytesIO or a dict. The checkpoint is corrupt or not from Transformer "
        "Engine.")
