"""The attention hook that sees the keys and values the attention reads: calibration observes
them through it (``fp8export.calibration.kv_cache``). Running with them in E4M3 (the FP8 KV
cache, FP8 attention) is ``attention.py``.

vLLM and TensorRT-LLM quantize the *cached* tensors: keys after the rotary embedding, values as
projected (reference/fp8_checkpoint_formats.md: ``k_scale``/``v_scale`` per attention layer,
per tensor). Hugging Face attention modules write that cache and then call the attention
function named by ``config._attn_implementation`` with exactly those keys and values, so this
module registers one more attention function, ``fp8export_kv``: it hands the keys and values to
the active observer (calibration), then calls the function the model used before. Models
whose attention modules have no ``k_proj``/``v_proj`` (fused ``c_attn``/``qkv``) are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from fp8export.errors import Fp8ExportError

NAME = "fp8export_kv"


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Attention modules (they own ``k_proj`` and ``v_proj``) by name, in model order."""
    found = {n: m for n, m in model.named_modules()
             if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "layer_idx")}
    if not found:
        raise Fp8ExportError(
            "--kv-cache fp8 needs attention modules with separate k_proj and v_proj (Llama, "
            "Mistral, Qwen and similar); this model has none. Leave --kv-cache off.")
    return found


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if NAME in ALL_ATTENTION_FUNCTIONS:
        return

    def attention(module, query, key, value, attention_mask, **kwargs):
        name, base, fn = module.__dict__["_fp8export_kv"]
        key, value = fn(name, key, value)
        return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask,
                                             **kwargs)

    AttentionInterface.register(NAME, attention)


def install(model: torch.nn.Module, fn: Callable) -> str:
    """Make every attention call of ``model`` pass its keys and values through
    ``fn(module_name, key, value) -> (key, value)`` (``[batch, kv_heads, T, dim]``); returns
    the attention implementation it had."""
    _register()
    mods = attention_modules(model)
    base = model.config._attn_implementation
    if base == NAME:
        raise Fp8ExportError("the model already runs through the FP8 KV-cache hook")
    for name, m in mods.items():
        m.__dict__["_fp8export_kv"] = (name, base, fn)
    model.config._attn_implementation = NAME
    return base


@contextlib.contextmanager
def kv_hook(model: torch.nn.Module, fn: Callable) -> Iterator[None]:
    """:func:`install` for the duration of the block."""
    base = install(model, fn)
    try:
        yield
    finally:
        model.config._attn_implementation = base
        for m in attention_modules(model).values():
            m.__dict__.pop("_fp8export_kv", None)
