"""A Keras ``config.json`` as a checked graph of the layers fp8export can rebuild.

The config is untrusted JSON: class names are compared as strings against the supported set and
nothing it names is ever imported or run. Every value a layer needs is read here, type- and
range-checked, so the builder never sizes anything from a number that was not checked (and
then checks it again against the weights' shapes before it uses a tensor).

Supported (``SUPPORTED``): Keras core ``InputLayer``, ``Embedding``, ``ReversibleEmbedding``,
``Dense``, ``Dropout``, ``LayerNormalization``, ``Activation``, ``Add`` (layer or ``+``),
``GlobalAveragePooling1D``, ``GlobalMaxPooling1D``; keras_hub ``TokenAndPositionEmbedding``,
``PositionEmbedding``, ``ReversibleEmbedding``, ``TransformerEncoder``, ``TransformerDecoder``
(self-attention only); and the look-alikes of the two keras_hub layers that the Keras float8
sample registers (package ``fp8export_keras_float8``), which compute the same functions.
Models are ``Functional`` or ``Sequential`` with one integer (token id) input and one output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fp8export.checkpoint.model_config import is_keras_config  # noqa: F401  (re-exported)
from fp8export.errors import Fp8ExportError

MAX_LAYERS = 4096
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 20
MAX_WIDTH = 1 << 16  # hidden and embedding sizes
MAX_INTERMEDIATE = 1 << 18
MAX_HEADS = 1024
MAX_NAME = 256

CORE = ("Activation", "Add", "Dense", "Dropout", "Embedding", "GlobalAveragePooling1D",
        "GlobalMaxPooling1D", "InputLayer", "LayerNormalization", "ReversibleEmbedding")
HUB = ("PositionEmbedding", "ReversibleEmbedding", "TokenAndPositionEmbedding",
       "TransformerDecoder", "TransformerEncoder")
SAMPLE_PACKAGE = "fp8export_keras_float8"  # samples/keras-float8/model.py
SAMPLE = ("TokenAndPositionEmbedding", "TransformerDecoder")
SUPPORTED = (*(f"keras.layers.{c}" for c in CORE), *(f"keras_hub.layers.{c}" for c in HUB))
ACTIVATIONS = ("linear", "relu", "gelu", "gelu_approximate", "silu", "tanh", "sigmoid",
               "softmax")
_ACTIVATION_ALIASES = {None: "linear", "swish": "silu", "keras_hub>gelu_approximate":
                       "gelu_approximate"}
_TOKEN_DTYPES = ("int32", "int64", "uint8", "int16", "uint16", "uint32")


@dataclass(frozen=True)
class Ref:
    """One tensor of the graph: output ``index`` of call ``node`` of layer ``layer``."""

    layer: str
    node: int = 0
    index: int = 0


@dataclass(frozen=True)
class Call:
    """One call of a layer: its input tensors and its (plain-valued) keyword arguments."""

    layer: str
    node: int
    inputs: tuple[Ref, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()

    def kwarg(self, key: str, default: Any = None) -> Any:
        return dict(self.kwargs).get(key, default)


@dataclass(frozen=True)
class LayerSpec:
    """A supported layer: ``kind`` is its class (``Dense``, ``TransformerDecoder``, ...)."""

    name: str
    kind: str
    identity: str  # as the file names it, e.g. "keras_hub>TransformerDecoder"
    options: tuple[tuple[str, Any], ...]

    def __getitem__(self, key: str) -> Any:
        return dict(self.options)[key]


@dataclass(frozen=True)
class KerasGraph:
    """The model: layers, their calls in execution order, the input and the output."""

    name: str
    layers: tuple[LayerSpec, ...]
    calls: tuple[Call, ...]
    input: Ref
    input_dtype: str
    output: Ref
    where: str

    def layer(self, name: str) -> LayerSpec:
        return next(spec for spec in self.layers if spec.name == name)




def supported_list() -> str:
    return ", ".join(SUPPORTED)


# ---- values ---------------------------------------------------------------------------------
class _Reader:
    """Checked access to one layer's config values; errors name the file, layer and key."""

    def __init__(self, cfg: dict, where: str, layer: str, identity: str):
        self.cfg, self.where, self.layer, self.identity = cfg, where, layer, identity

    def fail(self, key: str, value: Any, want: str) -> Fp8ExportError:
        return Fp8ExportError(f"{self.where}: layer '{self.layer}' ({self.identity}) has "
                              f"{key}={_short(value)}; expected {want}. The config is corrupt "
                              "or was edited.")

    def int(self, key: str, lo: int, hi: int, default: Any = ...) -> int:
        value = self.cfg.get(key, default)
        if value is ...:
            raise self.fail(key, "<missing>", f"an integer in [{lo}, {hi}]")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self.fail(key, value, f"an integer in [{lo}, {hi}]")
        return value

    def float(self, key: str, lo: float, hi: float, default: Any = ...) -> float:
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or not lo <= value <= hi:
            raise self.fail(key, value, f"a number in [{lo}, {hi}]")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, value, "true or false")
        return value

    def absent(self, key: str, why: str) -> None:
        if self.cfg.get(key) not in (None, 0, False, [], {}):
            raise Fp8ExportError(f"{self.where}: layer '{self.layer}' ({self.identity}) sets "
                                 f"{key}={_short(self.cfg.get(key))}: {why}, which fp8export "
                                 "does not rebuild.")

    def activation(self, key: str = "activation", default: Any = "linear") -> str:
        value = self.cfg.get(key, default)
        if isinstance(value, dict):  # a registered function: {"config": "keras_hub>gelu_..."}
            value = value.get("config") if value.get("class_name") == "function" else value
        value = _ACTIVATION_ALIASES.get(value, value) if not isinstance(value, dict) else value
        if value not in ACTIVATIONS:
            raise self.fail(key, value, f"one of {', '.join(ACTIVATIONS)}")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- layers ---------------------------------------------------------------------------------
def _identity(entry: dict) -> tuple[str | None, str]:
    """``(kind or None, display name)`` of a layer entry, from its strings alone."""
    cls, module, registered = entry.get("class_name"), entry.get("module"), \
        entry.get("registered_name")
    shown = registered if isinstance(registered, str) and ">" in registered \
        else f"{module}.{cls}" if isinstance(module, str) else str(cls)
    if not isinstance(cls, str):
        return None, shown
    if isinstance(registered, str) and ">" in registered:
        package, _, name = registered.partition(">")
        ok = (package == "keras_hub" and name in HUB) or (package == SAMPLE_PACKAGE
                                                          and name in SAMPLE)
        return (name if ok and name == cls else None), shown
    if isinstance(module, str) and (module == "keras" or module.startswith("keras.")) \
            and registered in (None, cls) and cls in CORE:
        return cls, shown
    return None, shown


def _options(kind: str, r: _Reader) -> dict[str, Any]:
    """The values ``kind`` computes with, checked; initializers and regularizers are ignored."""
    if kind == "InputLayer":
        shape = r.cfg.get("batch_shape", r.cfg.get("batch_input_shape"))
        if not isinstance(shape, list) or len(shape) != 2:
            raise r.fail("batch_shape", shape, "[batch, sequence] (one token-id axis)")
        if shape[1] is not None and (not isinstance(shape[1], int) or isinstance(shape[1], bool)
                                     or not 0 < shape[1] <= MAX_POSITIONS):
            raise r.fail("batch_shape", shape, f"a sequence length in [1, {MAX_POSITIONS}]")
        dtype = r.cfg.get("dtype")
        if dtype not in _TOKEN_DTYPES:
            raise Fp8ExportError(f"{r.where}: model input '{r.layer}' has dtype {_short(dtype)}; "
                                 "fp8export rebuilds models whose input is integer token ids.")
        for key in ("sparse", "ragged"):
            r.absent(key, "a sparse or ragged input")
        return {"dtype": dtype}
    if kind == "Dense":
        r.absent("lora_rank", "a LoRA adapter")
        return {"units": r.int("units", 1, MAX_VOCAB), "activation": r.activation(),
                "use_bias": r.bool("use_bias", True)}
    if kind in ("Embedding", "ReversibleEmbedding"):
        r.absent("lora_rank", "a LoRA adapter")
        out = {"input_dim": r.int("input_dim", 1, MAX_VOCAB),
               "output_dim": r.int("output_dim", 1, MAX_WIDTH),
               "mask_zero": r.bool("mask_zero", False)}
        if kind == "ReversibleEmbedding":
            cap = r.cfg.get("logit_soft_cap")
            out.update(tie_weights=r.bool("tie_weights", True),
                       logit_soft_cap=None if cap is None else r.float("logit_soft_cap", 1e-6,
                                                                        1e6))
        return out
    if kind == "TokenAndPositionEmbedding":
        return {"vocabulary_size": r.int("vocabulary_size", 1, MAX_VOCAB),
                "sequence_length": r.int("sequence_length", 1, MAX_POSITIONS),
                "embedding_dim": r.int("embedding_dim", 1, MAX_WIDTH),
                "tie_weights": r.bool("tie_weights", True),
                "mask_zero": r.bool("mask_zero", False)}
    if kind == "PositionEmbedding":
        return {"sequence_length": r.int("sequence_length", 1, MAX_POSITIONS)}
    if kind in ("TransformerEncoder", "TransformerDecoder"):
        if kind == "TransformerDecoder" and r.cfg.get("encoder_sequence_shape") is not None:
            raise Fp8ExportError(f"{r.where}: layer '{r.layer}' ({r.identity}) has "
                                 "cross-attention (encoder_sequence_shape is set); fp8export "
                                 "rebuilds decoder blocks with self-attention only.")
        return {"intermediate_dim": r.int("intermediate_dim", 1, MAX_INTERMEDIATE),
                "num_heads": r.int("num_heads", 1, MAX_HEADS),
                "activation": r.activation(default="relu"),
                "layer_norm_epsilon": r.float("layer_norm_epsilon", 1e-12, 1.0, 1e-5),
                "normalize_first": r.bool("normalize_first", False),
                "dropout": r.float("dropout", 0.0, 1.0, 0.0)}
    if kind == "LayerNormalization":
        axis = r.cfg.get("axis", -1)
        if axis not in (-1, [-1], 2, [2]):
            raise r.fail("axis", axis, "-1 (the feature axis of [batch, sequence, features])")
        r.absent("rms_scaling", "rms_scaling (deprecated in Keras)")
        return {"epsilon": r.float("epsilon", 1e-12, 1.0, 1e-3),
                "center": r.bool("center", True), "scale": r.bool("scale", True)}
    if kind in ("GlobalAveragePooling1D", "GlobalMaxPooling1D"):
        if r.cfg.get("data_format", "channels_last") != "channels_last":
            raise r.fail("data_format", r.cfg.get("data_format"), "'channels_last'")
        return {"keepdims": r.bool("keepdims", False)}
    if kind == "Dropout":
        r.float("rate", 0.0, 1.0)
        return {}
    if kind == "Activation":
        return {"activation": r.activation(default=...)}
    return {}  # Add


# ---- graph ----------------------------------------------------------------------------------
def parse_keras_config(config: Any, where: str) -> KerasGraph:
    """Check a Keras model config and return its graph. Raises Fp8ExportError naming the layer."""
    if not is_keras_config(config) or not isinstance(config["config"], dict):
        raise Fp8ExportError(f"{where}: not a Keras model config (no class_name/config).")
    model_cls, body = config["class_name"], config["config"]
    if model_cls not in ("Functional", "Sequential", "Model"):
        raise Fp8ExportError(f"{where}: the model is a {_short(model_cls)}; fp8export rebuilds "
                             "Functional and Sequential Keras models.")
    entries = body.get("layers")
    if not isinstance(entries, list) or not entries:
        raise Fp8ExportError(f"{where}: the model config lists no layers.")
    if len(entries) > MAX_LAYERS:
        raise Fp8ExportError(f"{where}: {len(entries)} layers (more than {MAX_LAYERS}); not a "
                             "model fp8export rebuilds.")
    layers, raw_nodes = [], {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
            raise Fp8ExportError(f"{where}: layers[{i}] is not a layer entry.")
        name = entry["config"].get("name", entry.get("name"))
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or "." in name \
                or "/" in name:
            raise Fp8ExportError(f"{where}: layers[{i}] has name {_short(name)}; layer names "
                                 f"must be 1..{MAX_NAME} characters without '.' or '/'.")
        if any(spec.name == name for spec in layers):
            raise Fp8ExportError(f"{where}: two layers are named '{name}'.")
        kind, shown = _identity(entry)
        if kind is None:
            raise Fp8ExportError(
                f"{where}: layer '{name}' is {shown}, which fp8export cannot rebuild (it never "
                f"imports or runs code a config names). Supported layers: {supported_list()}.")
        options = _options(kind, _Reader(entry["config"], where, name, shown))
        layers.append(LayerSpec(name, kind, shown, tuple(sorted(options.items()))))
        raw_nodes[name] = entry.get("inbound_nodes")
    if model_cls == "Sequential":
        calls, inp, out = _sequential(layers, where)
    else:
        calls, inp, out = _functional(layers, raw_nodes, body, where)
    input_spec = next((s for s in layers if s.name == inp.layer), None)
    if input_spec is None or input_spec.kind != "InputLayer":
        raise Fp8ExportError(f"{where}: the model input '{inp.layer}' is not an InputLayer.")
    return KerasGraph(name=str(body.get("name", "model")), layers=tuple(layers),
                      calls=tuple(calls), input=inp, input_dtype=input_spec["dtype"],
                      output=out, where=where)


def _sequential(layers: list[LayerSpec], where: str):
    if layers[0].kind != "InputLayer":
        raise Fp8ExportError(f"{where}: the Sequential model has no InputLayer, so its input "
                             "is unknown. Build it with keras.Input(shape=(None,), "
                             "dtype='int32') first.")
    calls, prev = [], Ref(layers[0].name)
    for spec in layers[1:]:
        if spec.kind == "InputLayer":
            raise Fp8ExportError(f"{where}: a Sequential model with two InputLayers.")
        calls.append(Call(spec.name, 0, (prev,)))
        prev = Ref(spec.name)
    return calls, Ref(layers[0].name), prev


def _one_ref(value: Any, where: str, what: str) -> Ref:
    """``[layer, node, index]`` (or a list holding exactly one) as a Ref."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if isinstance(value, dict) and set(value) == {"args"}:  # never written by Keras 3
        value = value["args"]
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_LAYERS
                    for v in value[1:])):
        raise Fp8ExportError(f"{where}: the model's {what} is {_short(value)}; fp8export "
                             "rebuilds models with exactly one input and one output.")
    return Ref(*value)


def _tensor_refs(value: Any, where: str, layer: str) -> list[Ref]:
    """The keras tensors among a call's positional arguments (nested lists allowed once)."""
    items = value if isinstance(value, list) else [value]
    refs = []
    for item in items:
        if isinstance(item, list):
            refs.extend(_tensor_refs(item, where, layer))
            continue
        if isinstance(item, dict) and item.get("class_name") == "__keras_tensor__":
            hist = (item.get("config") or {}).get("keras_history")
            refs.append(_one_ref(hist, where, f"call of layer '{layer}' input"))
            continue
        raise Fp8ExportError(f"{where}: layer '{layer}' is called with {_short(item)}; "
                             "fp8export rebuilds calls whose positional arguments are tensors.")
    return refs


def _functional(layers: list[LayerSpec], raw_nodes: dict, body: dict, where: str):
    names = {spec.name for spec in layers}
    calls: list[Call] = []
    for spec in layers:
        nodes = raw_nodes.get(spec.name) or []
        if not isinstance(nodes, list):
            raise Fp8ExportError(f"{where}: layer '{spec.name}' has malformed inbound_nodes.")
        if spec.kind == "InputLayer":
            continue
        for index, node in enumerate(nodes):
            if not isinstance(node, dict) or not isinstance(node.get("kwargs", {}), dict):
                raise Fp8ExportError(f"{where}: layer '{spec.name}' has a malformed call.")
            inputs = tuple(_tensor_refs(node.get("args", []), where, spec.name))
            kwargs = []
            for key, value in sorted(node.get("kwargs", {}).items()):
                if isinstance(value, (dict, list)):
                    raise Fp8ExportError(
                        f"{where}: layer '{spec.name}' is called with {key}={_short(value)}; "
                        "fp8export rebuilds calls whose keyword arguments are plain values "
                        "(no mask or cache tensors).")
                kwargs.append((key, value))
            for ref in inputs:
                if ref.layer not in names:
                    raise Fp8ExportError(f"{where}: layer '{spec.name}' reads the output of "
                                         f"'{ref.layer}', which the config does not define.")
            calls.append(Call(spec.name, index, inputs, tuple(kwargs)))
    inp = _one_ref(body.get("input_layers"), where, "input list")
    out = _one_ref(body.get("output_layers"), where, "output list")
    return _ordered(calls, inp, out, where), inp, out


def _ordered(calls: list[Call], inp: Ref, out: Ref, where: str) -> list[Call]:
    """The calls ``out`` needs, each after the calls it reads (a cycle is an error)."""
    by_key = {(c.layer, c.node): c for c in calls}
    order, done, active = [], {(inp.layer, inp.node)}, set()
    stack = [((out.layer, out.node), False)]
    while stack:
        key, expanded = stack.pop()
        if key in done:
            continue
        call = by_key.get(key)
        if call is None:
            raise Fp8ExportError(f"{where}: the model reads call {key[1]} of layer '{key[0]}', "
                                 "which the config does not define (or a second model input).")
        if expanded:
            active.discard(key)
            done.add(key)
            order.append(call)
            continue
        if key in active:
            raise Fp8ExportError(f"{where}: the layer graph has a cycle through '{key[0]}'.")
        active.add(key)
        stack.append((key, True))
        for ref in reversed(call.inputs):
            if (ref.layer, ref.node) not in done:
                if (ref.layer, ref.node) in active:
                    raise Fp8ExportError(f"{where}: the layer graph has a cycle through "
                                         f"'{ref.layer}'.")
                stack.append(((ref.layer, ref.node), False))
    return order
