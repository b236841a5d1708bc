"""FP8 KV cache and FP8 attention inside transformers models: one registered attention function.

Hugging Face attention modules project, rotate and (with a cache) store the keys and values,
then call the attention function named by ``config._attn_implementation`` with exactly the
keys and values the attention reads (keys after the rotary embedding: what vLLM and TensorRT-LLM
cache). :func:`install` registers ``fp8export_attention`` (and a mask function of the same
name) and points the model at it. Each attention module gets its layer's ``k_scale`` and
``v_scale`` (one per KV head; a per-tensor scale repeated) as non-persistent buffers, and the
function runs in one of two modes, switchable at any time (:func:`set_mode`):

* ``kv``: the FP8 KV cache with 16-bit attention, as a server with ``kv_cache_dtype="fp8"`` and
  a non-FP8 attention backend runs it: keys and values E4M3 with the layer's scales, dequantized,
  then the model's own attention implementation (sdpa or eager);
* ``fp8``: FP8 attention on that cache (``fp8_attention``: the Triton kernel on a GPU with FP8
  tensor cores, the same arithmetic in torch elsewhere).

With :class:`~fp8export.runtime.fp8_kv_cache.Fp8StaticCache` the keys and values arrive already
in E4M3 (the cache stores them so: half the memory of a 16-bit cache); without a cache (or with
a 16-bit one) they are quantized here, the same way. Mode ``off`` (:func:`set_mode`) restores the
model's own attention, for comparing against the FP8-linears-only model.

The mask function hands the attention a :class:`MaskInfo` instead of a materialized mask: the
queries' offset in the key buffer, the sliding window (transformers' ``local_size``) and the
2-D padding mask; masks transformers builds from other pieces (packed sequences, bidirectional
blocks) come as a dense mask, which the torch path takes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics.fp8 import E4M3_DTYPE
from fp8export.runtime.attention_math import (
    MaskInfo,
    allowed,
    dequantized_attention_inputs,
    head_scales,
    quantize_heads,
)
from fp8export.runtime.fp8_attention import fp8_attention

NAME = "fp8export_attention"
MODES = ("off", "kv", "fp8")
_STATE = "_fp8export_attention"


class AttentionState:
    """What one model's attention runs: ``mode`` ("kv" or "fp8"), ``p_fp8`` (P in E4M3 in the
    P·V product, else bf16), ``base``: the model's own implementation (sdpa or eager)."""

    def __init__(self, base: str, mode: str, p_fp8: bool):
        self.base, self.mode, self.p_fp8 = base, mode, p_fp8


def attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Attention modules (they own ``k_proj`` and ``v_proj`` and a ``layer_idx``) by name: the
    ones the KV cache's calibration hooks (one rule for both)."""
    from fp8export.runtime.kv_cache import attention_modules

    return attention_modules(model)


def kv_heads(module: torch.nn.Module) -> int:
    """Number of KV heads of an attention module (from its config, else its k_proj)."""
    cfg = getattr(module, "config", None)
    n = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)
    if n:
        return int(n)
    head_dim = int(getattr(module, "head_dim"))
    return module.k_proj.out_features // head_dim


_HF: dict = {}  # transformers' functions the attention and mask functions call (module globals:
# torch.compile traces those functions, and imports inside them would break its graph)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        causal_mask_function,
        sdpa_mask,
    )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _HF.update(causal=causal_mask_function, sdpa_mask=sdpa_mask,
               functions=ALL_ATTENTION_FUNCTIONS)
    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _mask)


def install(model: torch.nn.Module, scales: Mapping[str, tuple], *, mode: str = "kv",
            p_fp8: bool = False) -> AttentionState:
    """Run ``model``'s attention through the FP8 KV cache (``mode="kv"``) or FP8 attention
    (``mode="fp8"``) with ``scales``: attention module name -> ``(k_scale, v_scale)``, each a
    per-tensor value or one per KV head (dequantization factors, ``amax / 448``)."""
    if mode not in ("kv", "fp8"):
        raise ValueError(f"mode must be 'kv' or 'fp8', got {mode!r}")
    layers = attention_layers(model)
    missing = sorted(set(layers) - set(scales))
    if missing:
        raise Fp8ExportError(f"no k_scale/v_scale for {', '.join(missing[:3])}; re-run "
                             "`fp8export convert --kv-cache fp8`.")
    state = getattr(model, _STATE, None)
    base = state.base if state is not None else model.config._attn_implementation
    if base not in ("sdpa", "eager"):
        raise Fp8ExportError(f"the FP8 KV cache runs on the sdpa or eager attention of "
                             f"transformers; this model uses {base!r}. Load it with "
                             "attn_implementation='sdpa'.")
    _register()
    state = AttentionState(base, mode, p_fp8)
    for name, module in layers.items():
        ks, vs = scales[name]
        heads = kv_heads(module)
        device = module.k_proj.weight.device if hasattr(module.k_proj, "weight") else None
        if device is not None and device.type == "meta":
            device = None  # a streamed skeleton: the scales stay real, each layer moves them
        module.register_buffer("fp8_k_scale", head_scales(ks, heads, device), persistent=False)
        module.register_buffer("fp8_v_scale", head_scales(vs, heads, device), persistent=False)
        module.__dict__[_STATE] = state
    model.__dict__[_STATE] = state
    model.config._attn_implementation = NAME
    return state


def set_mode(model: torch.nn.Module, mode: str) -> None:
    """Switch an installed model between "off" (its own attention, 16-bit keys and values),
    "kv" and "fp8"."""
    state = state_of(model)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "off":
        model.config._attn_implementation = state.base
        return
    state.mode = mode
    model.config._attn_implementation = NAME


def state_of(model: torch.nn.Module) -> AttentionState:
    state = model.__dict__.get(_STATE)
    if state is None:
        raise Fp8ExportError("the model runs no FP8 KV cache (install() was not called)")
    return state


def layer_scales(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(k_scale, v_scale)`` per attention layer, in ``layer_idx`` order."""
    state_of(model)
    layers = sorted(attention_layers(model).values(), key=lambda m: m.layer_idx)
    return [(m.fp8_k_scale, m.fp8_v_scale) for m in layers]


# ------------------------------------------------------------------ transformers' interfaces
def _mask(batch_size: int, q_length: int, kv_length: int, q_offset=None, kv_offset=0,
          mask_function=None, attention_mask: torch.Tensor | None = None,
          local_size: int | None = None, use_vmap: bool = False, cache_position=None,
          **kwargs) -> MaskInfo:
    """The mask function transformers calls once per forward (per layer type)."""
    if q_offset is None:  # older transformers: the cache positions say where the queries sit
        q_offset = cache_position[0] if cache_position is not None else kv_length - q_length
    if isinstance(q_offset, torch.Tensor):
        q_offset = q_offset.clone()  # a static cache advances its counter in place later
    q_start = q_offset - kv_offset if kv_offset else q_offset
    known = not use_vmap and (mask_function is _HF["causal"] or local_size)
    if not known:
        dense = _HF["sdpa_mask"](batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                          q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                          attention_mask=attention_mask, local_size=local_size,
                          allow_is_causal_skip=False, use_vmap=use_vmap, **kwargs)
        return MaskInfo(q_start, False, 0, None, dense)
    key_mask = None
    if attention_mask is not None:
        key_mask = attention_mask.to(torch.bool)
        if key_mask.shape[1] > kv_length:
            key_mask = key_mask[:, -kv_length:]
        elif key_mask.shape[1] < kv_length:  # a static cache's slots past the written ones
            key_mask = torch.nn.functional.pad(key_mask, (0, kv_length - key_mask.shape[1]))
    return MaskInfo(q_start, True, int(local_size or 0), key_mask, None)


def _as_info(attention_mask, q: torch.Tensor, k: torch.Tensor, module) -> MaskInfo:
    """A mask the model passed unchanged (a 4-D one, or none) as :class:`MaskInfo`."""
    if isinstance(attention_mask, MaskInfo):
        return attention_mask
    if attention_mask is None:  # queries at the end of the keys, as a dynamic cache has them
        return MaskInfo(k.shape[2] - q.shape[2], bool(getattr(module, "is_causal", True)))
    m = attention_mask
    dense = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    return MaskInfo(0, False, 0, None, dense)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               **kwargs):
    state: AttentionState = module.__dict__[_STATE]
    info = _as_info(attention_mask, query, key, module)
    ks, vs = module.fp8_k_scale, module.fp8_v_scale
    sm_scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if state.mode == "fp8":
        out = fp8_attention(query, key, value, ks, vs, sm_scale=sm_scale, info=info,
                            p_fp8=state.p_fp8)
        return out, None
    k8 = key if key.dtype == E4M3_DTYPE else quantize_heads(key, ks)
    v8 = value if value.dtype == E4M3_DTYPE else quantize_heads(value, vs)
    k16, v16 = dequantized_attention_inputs(k8, v8, ks, vs, query.dtype)
    mask = _base_mask(state.base, info, query, k16)
    kwargs.pop("sliding_window", None)  # in the mask already
    return _HF["functions"][state.base](module, query, k16, v16, mask, scaling=scaling,
                                               dropout=dropout, **kwargs)


def _base_mask(base: str, info: MaskInfo, q: torch.Tensor, k: torch.Tensor):
    """The mask the model's own attention (sdpa: bool, eager: additive) takes for ``info``;
    None where sdpa's ``is_causal`` says the same."""
    tq, tk = q.shape[2], k.shape[2]
    if (base == "sdpa" and info.dense is None and info.causal and not info.window
            and info.key_mask is None and isinstance(info.q_start, int) and info.q_start == 0
            and tq == tk):
        return None
    ok = allowed(info, q.shape[0], tq, tk, q.device)
    if base == "sdpa":
        return ok
    return torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~ok, torch.finfo(q.dtype).min)
