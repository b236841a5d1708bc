"""A checked Keras graph plus its weights → one ``torch.nn.Module`` that runs it (no Keras).

Each layer's module sits at the layer's name (``model.transformer_decoder``); :class:`KerasModel`
runs the calls in graph order and carries Keras masks along, as Keras's functional model does:
``mask_zero`` embeddings produce them; Dense, Dropout, LayerNormalization, Activation and the
transformer blocks pass them on; ``Add`` ORs them (none if an input has none);
``GlobalAveragePooling1D`` and the blocks use them. Sizes come from the config and are checked
against each tensor's shape before the tensor is used; the modules hold the tensors themselves,
nothing is allocated from the config.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fp8export.errors import Fp8ExportError
from fp8export.keras_model import layers as L
from fp8export.keras_model.config import KerasGraph, LayerSpec, parse_keras_config
from fp8export.keras_model.weights import Weights, folder_weights, keras_checkpoint_weights

_PASS_MASK = ("Dense", "Dropout", "LayerNormalization", "Activation", "TransformerEncoder",
              "TransformerDecoder")
_EMBEDDINGS = ("Embedding", "ReversibleEmbedding", "TokenAndPositionEmbedding")
# Sublayer names: Keras >= 3.6 files name them by layer name, older ones by attribute.
_ATTENTION = {"TransformerDecoder": ("self_attention", "self_attention_layer"),
              "TransformerEncoder": ("self_attention_layer", "self_attention")}
_PROJECTIONS = (("query", "query_dense"), ("key", "key_dense"), ("value", "value_dense"),
                ("attention_output", "output_dense"))
_IGNORED_KWARGS = ("training", "mask")


class KerasModel(nn.Module):
    """A Keras model rebuilt in torch: ``forward(input_ids) -> the Keras model's output``.

    ``output_activation`` is the final layer's activation ("sigmoid", "softmax", or "linear"),
    so a caller can turn probabilities into class logits.
    """

    def __init__(self, graph: KerasGraph, modules: dict[str, nn.Module], config: dict):
        super().__init__()
        self.graph, self.config = graph, config  # config: the Keras config.json it came from
        for name, module in modules.items():
            if hasattr(nn.Module, name) or hasattr(KerasModel, name) \
                    or name in ("graph", "config", "_specs"):
                raise Fp8ExportError(f"{graph.where}: layer name '{name}' clashes with a torch "
                                     "module attribute; rename the layer.")
            self.add_module(name, module)
        self.output_activation = _output_activation(graph)
        self._specs = {spec.name: spec for spec in graph.layers}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """``attention_mask`` is accepted and ignored: a Keras model sees padding as the tokens
        it is (its own ``mask_zero`` embeddings mask padding id 0, as in Keras)."""
        del attention_mask
        values = {(self.graph.input.layer, self.graph.input.node, 0): (input_ids, None)}
        for call in self.graph.calls:
            spec = self._specs[call.layer]
            args = [values[(r.layer, r.node, r.index)] for r in call.inputs]
            values[(call.layer, call.node, 0)] = self._run(spec, call, args)
        ref = self.graph.output
        return values[(ref.layer, ref.node, ref.index)][0]

    def _run(self, spec: LayerSpec, call, args):
        kind, module = spec.kind, getattr(self, spec.name, None)
        x, mask = args[0]
        if kind == "Add":  # keras/src/layers/merging/base_merge.py: OR, or None if any is
            masks = [m for _, m in args]
            out_mask = None
            if all(m is not None for m in masks):
                out_mask = masks[0]
                for m in masks[1:]:
                    out_mask = out_mask | m
            total = args[0][0]
            for y, _ in args[1:]:
                total = total + y
            return total, out_mask
        if len(args) != 1:
            raise Fp8ExportError(f"{self.graph.where}: layer '{spec.name}' ({spec.kind}) is "
                                 f"called on {len(args)} tensors; it takes one.")
        if kind in _EMBEDDINGS:
            if call.kwarg("reverse", False):
                return module.reverse(x), None
            return module(x), module.mask(x)
        if kind == "PositionEmbedding":
            return module(x), None
        if kind == "Dense":
            return L.activate(spec["activation"], module(x)), mask
        if kind == "Activation":
            return L.activate(spec["activation"], x), mask
        if kind == "LayerNormalization":
            return module(x), mask
        if kind in ("TransformerEncoder", "TransformerDecoder"):
            return module(x, mask, bool(call.kwarg("use_causal_mask", True))), mask
        if kind == "GlobalAveragePooling1D":
            if mask is None:
                out = x.mean(dim=1, keepdim=spec["keepdims"])
            else:
                keep = mask[:, :, None]
                total = torch.where(keep, x, torch.zeros_like(x)).sum(1, keepdim=spec["keepdims"])
                out = total / keep.to(x.dtype).sum(1, keepdim=spec["keepdims"])
            return out, None
        if kind == "GlobalMaxPooling1D":
            return x.amax(dim=1, keepdim=spec["keepdims"]), None
        return x, mask  # Dropout: off at inference


    @property
    def vocab_size(self) -> int | None:
        """Token ids must be below this (the first embedding's vocabulary)."""
        for call in self.graph.calls:
            if call.inputs and call.inputs[0].layer == self.graph.input.layer:
                spec = self._specs[call.layer]
                return spec["vocabulary_size"] if spec.kind == "TokenAndPositionEmbedding" \
                    else spec["input_dim"]
        return None

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the position embeddings cover (None: no limit)."""
        lengths = [spec["sequence_length"] for spec in self.graph.layers
                   if spec.kind in ("TokenAndPositionEmbedding", "PositionEmbedding")]
        return min(lengths) if lengths else None


def _output_activation(graph: KerasGraph) -> str:
    spec = graph.layer(graph.output.layer)
    return spec["activation"] if spec.kind in ("Dense", "Activation") else "linear"


# ---- modules from weights -------------------------------------------------------------------
def _check_kwargs(graph: KerasGraph, spec: LayerSpec) -> None:
    allowed = {"ReversibleEmbedding": ("reverse",), "TransformerDecoder": ("use_causal_mask",),
               "TokenAndPositionEmbedding": ("start_index",),
               "PositionEmbedding": ("start_index",)}.get(spec.kind, ())
    for call in graph.calls:
        if call.layer != spec.name:
            continue
        for key, value in call.kwargs:
            if value is None or key in _IGNORED_KWARGS or (key == "start_index" and value == 0):
                continue
            if key not in allowed or not isinstance(value, bool):
                raise Fp8ExportError(f"{graph.where}: layer '{spec.name}' ({spec.kind}) is "
                                     f"called with {key}={value!r}, which fp8export does not "
                                     "rebuild.")


def _embedding(w: Weights, prefix: str, vocab: int, dim: int, *, mask_zero: bool,
               tie: bool = True, soft_cap: float | None = None) -> L.Embedding:
    table = w.tensor(prefix, ("embeddings", "vars.0"), (vocab, dim), "the embedding table")
    reverse = None if tie else w.tensor(prefix, ("vars.1", "reverse_embeddings"), (dim, vocab),
                                        "the reverse embedding")
    return L.Embedding(table, mask_zero, reverse, soft_cap)


def _dense(w: Weights, prefix: str, n_in: int, n_out: int, use_bias: bool = True) -> nn.Linear:
    kernel = w.kernel(prefix, n_in, n_out, "the kernel")
    bias = w.tensor(prefix, ("bias", "vars.1"), (n_out,), "the bias") if use_bias else None
    return L.linear(kernel, bias)


def _norm(w: Weights, prefix: str, dim: int, eps: float, center=True, scale=True) -> L.LayerNorm:
    gamma = w.tensor(prefix, ("gamma", "vars.0"), (dim,), "the norm's gamma") if scale else None
    beta = w.tensor(prefix, ("beta", f"vars.{int(scale)}"), (dim,), "the norm's beta") \
        if center else None
    return L.LayerNorm(gamma, beta, eps)


def _sub(w: Weights, prefix: str, names: tuple[str, ...]) -> str:
    found = next((n for n in names if w.has_prefix(f"{prefix}.{n}")), None)
    if found is None:
        raise Fp8ExportError(f"{w.where}: no weights under {prefix}.{names[0]} — the weights "
                             "were not saved from the architecture in config.json.")
    return found


def _block(w: Weights, spec: LayerSpec, dim: int) -> L.TransformerBlock:
    p, heads = spec.name, spec["num_heads"]
    head_dim = dim // heads
    if head_dim == 0:
        raise Fp8ExportError(f"{w.where}: layer '{p}' has num_heads={heads} for hidden size "
                             f"{dim}; keras_hub needs num_heads <= hidden size.")
    att = _sub(w, p, _ATTENTION[spec.kind])
    projections = {}
    for names in _PROJECTIONS:
        name = _sub(w, f"{p}.{att}", names)
        n_in, n_out = (heads * head_dim, dim) if names[0] == "attention_output" \
            else (dim, heads * head_dim)
        projections[name] = _dense(w, f"{p}.{att}.{name}", n_in, n_out)
    eps, inner = spec["layer_norm_epsilon"], spec["intermediate_dim"]
    parts = {"attention": (att, L.Attention(projections, heads, head_dim))}
    for role, name, module in (
            ("attention_norm", "self_attention_layer_norm",
             lambda n: _norm(w, f"{p}.{n}", dim, eps)),
            ("ff_in", "feedforward_intermediate_dense",
             lambda n: _dense(w, f"{p}.{n}", dim, inner)),
            ("ff_out", "feedforward_output_dense", lambda n: _dense(w, f"{p}.{n}", inner, dim)),
            ("ff_norm", "feedforward_layer_norm", lambda n: _norm(w, f"{p}.{n}", dim, eps))):
        parts[role] = (name, module(name))
    return L.TransformerBlock(parts, decoder=spec.kind == "TransformerDecoder",
                              activation=spec["activation"],
                              normalize_first=spec["normalize_first"])


def _widths(graph: KerasGraph, w: Weights) -> dict[tuple[str, int, int], int | None]:
    """Feature width of every tensor (None: token ids), propagated along the calls."""
    width: dict[tuple[str, int, int], int | None] = {(graph.input.layer, graph.input.node, 0):
                                                     None}
    for call in graph.calls:
        spec = graph.layer(call.layer)
        ins = [width[(r.layer, r.node, r.index)] for r in call.inputs]
        if spec.kind in ("Embedding", "ReversibleEmbedding"):
            out = spec["input_dim"] if call.kwarg("reverse", False) else spec["output_dim"]
        elif spec.kind == "TokenAndPositionEmbedding":
            out = spec["embedding_dim"]
        elif spec.kind == "Dense":
            out = spec["units"]
        else:
            out = ins[0] if ins else None
        if spec.kind not in _EMBEDDINGS and any(i is None for i in ins):
            raise Fp8ExportError(f"{graph.where}: layer '{spec.name}' ({spec.kind}) reads token "
                                 "ids directly; the model must embed them first.")
        if spec.kind in _EMBEDDINGS and not call.kwarg("reverse", False) and ins[0] is not None:
            raise Fp8ExportError(f"{graph.where}: layer '{spec.name}' ({spec.kind}) is applied "
                                 "to features, not token ids.")
        if spec.kind == "Add" and len(set(ins)) != 1:
            raise Fp8ExportError(f"{graph.where}: layer '{spec.name}' adds tensors of widths "
                                 f"{ins}.")
        width[(call.layer, call.node, 0)] = out
    return width


def build_keras_model(graph: KerasGraph, w: Weights, dtype: torch.dtype,
                      config: dict) -> KerasModel:
    """The torch model of ``graph`` holding the tensors of ``w`` (cast to ``dtype``)."""
    width = _widths(graph, w)
    modules: dict[str, nn.Module] = {}
    for spec in graph.layers:
        _check_kwargs(graph, spec)
        calls = [c for c in graph.calls if c.layer == spec.name]
        if not calls:
            continue
        dims = {width[(r.layer, r.node, r.index)] for c in calls for r in c.inputs}
        dim = next(iter(dims)) if len(dims) == 1 else None
        if len(dims) > 1 and spec.kind not in _EMBEDDINGS:  # sizes of these come from config
            raise Fp8ExportError(f"{graph.where}: layer '{spec.name}' is shared by calls on "
                                 f"inputs of different widths {sorted(map(str, dims))}.")
        module = _module(w, spec, dim)
        if module is not None:
            modules[spec.name] = module
    w.check_all_used()
    return KerasModel(graph, modules, config).to(dtype).eval()


def _module(w: Weights, spec: LayerSpec, dim: int | None) -> nn.Module | None:
    p, kind = spec.name, spec.kind
    if kind in ("Embedding", "ReversibleEmbedding"):
        return _embedding(w, p, spec["input_dim"], spec["output_dim"],
                          mask_zero=spec["mask_zero"], tie=dict(spec.options).get("tie_weights",
                                                                                  True),
                          soft_cap=dict(spec.options).get("logit_soft_cap"))
    if kind == "TokenAndPositionEmbedding":
        vocab, length, emb = spec["vocabulary_size"], spec["sequence_length"], \
            spec["embedding_dim"]
        tokens = _embedding(w, f"{p}.token_embedding", vocab, emb, mask_zero=spec["mask_zero"],
                            tie=spec["tie_weights"])
        positions = w.tensor(f"{p}.position_embedding", ("vars.0", "embeddings"), (length, emb),
                             "the position embedding")
        return L.TokenAndPositionEmbedding(tokens, L.PositionEmbedding(positions))
    if kind == "PositionEmbedding":
        return L.PositionEmbedding(w.tensor(p, ("vars.0", "embeddings"),
                                            (spec["sequence_length"], dim),
                                            "the position embedding"))
    if kind == "Dense":
        return _dense(w, p, dim, spec["units"], spec["use_bias"])
    if kind == "LayerNormalization":
        return _norm(w, p, dim, spec["epsilon"], spec["center"], spec["scale"])
    if kind in ("TransformerEncoder", "TransformerDecoder"):
        return _block(w, spec, dim)
    return None


# ---- entry points ---------------------------------------------------------------------------
def load_keras_model(path: str | Path, dtype: torch.dtype = torch.float32) -> KerasModel:
    """Rebuild the model of a ``.keras`` / ``.weights.h5`` file (float8 layers in full precision:
    Keras keeps their kernels unquantized)."""
    with keras_checkpoint_weights(Path(path)) as (config, w):
        graph = parse_keras_config(config, f"{path}: config.json")
        return build_keras_model(graph, w, dtype, config)


def keras_model_from_folder(folder, dtype: torch.dtype = torch.float32) -> KerasModel:
    """Rebuild the model of an FP8 folder converted from Keras, FP8 weights dequantized.

    ``folder`` is what :func:`fp8export.keras_model.weights.read_folder` returns.
    """
    config, w = folder_weights(folder)
    graph = parse_keras_config(config, f"{folder.path / 'config.json'}")
    return build_keras_model(graph, w, dtype, config)
