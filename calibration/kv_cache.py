"""FP8 KV cache: per-attention-layer ranges of the keys and values the attention reads, and the
same attention run with them E4M3-quantized (what a server with an FP8 KV cache computes).

vLLM and TensorRT-LLM quantize the *cached* tensors: keys after the rotary embedding, values as
projected (reference/fp8_checkpoint_formats.md: ``k_scale``/``v_scale`` per attention layer,
per tensor). Hugging Face attention modules write that cache and then call the attention
function named by ``config._attn_implementation`` with exactly those keys and values, so this
module registers one more attention function, ``fp8export_kv``: it hands the keys and values to
the active observer (calibration) or fake-quantizes them with the layer's scales (emulation),
then calls the function the model used before. Models whose attention modules have no
``k_proj``/``v_proj`` (fused ``c_attn``/``qkv``) are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def observe_kv(model, batches, input_device) -> dict[str, tuple[float, float]]:
    """max|K| and max|V| per attention module over the real (unpadded) positions."""
    amax: dict[str, list[float]] = {}
    mask_now: list[torch.Tensor] = []

    def fn(name, key, value):
        real = mask_now[0].to(key.device).bool()  # [batch, T]
        k = key.detach().abs().amax(dim=(1, 3))[real]
        v = value.detach().abs().amax(dim=(1, 3))[real]
        prev = amax.setdefault(name, [0.0, 0.0])
        if k.numel():
            prev[0] = max(prev[0], float(k.max()))
            prev[1] = max(prev[1], float(v.max()))
        return key, value

    with kv_hook(model, fn), torch.inference_mode():
        for batch in batches:
            mask_now[:] = [batch.attention_mask]
            model(input_ids=batch.input_ids.to(input_device),
                  attention_mask=batch.attention_mask.to(input_device))
    return {n: (a[0], a[1]) for n, a in amax.items()}


def kv_cache_ranges(cfg, checkpoint: Path) -> tuple[dict[str, tuple[float, float]],
                                                    dict[str, Any]]:
    """``convert --kv-cache fp8``: (attention module -> (k amax, v amax), facts for the
    manifest), calibrated on ``cfg.calib_data`` with the bf16 model."""
    import time

    from fp8export.calibration.config import DEFAULT_BATCH_SIZE, DEFAULT_CALIB_SAMPLES
    from fp8export.inputs.samples import iter_batches, load_samples
    from fp8export.models import load_model_placed, max_positions, vocab_size
    from fp8export.placement import resolve_device

    if cfg.calib_data is None:
        raise Fp8ExportError("--kv-cache fp8 calibrates the keys and values: give --calib-data "
                             "PATH.")
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    model, config, spread = load_model_placed(checkpoint, device, dtype=torch.bfloat16)
    input_device = torch.device(spread.main_device if spread is not None else device)
    try:
        tok_dir = checkpoint if checkpoint.is_dir() else None
        samples = load_samples(cfg.calib_data, tok_dir,
                               max_samples=cfg.calib_samples or DEFAULT_CALIB_SAMPLES,
                               seq_len=cfg.seq_len, max_positions=max_positions(config),
                               vocab_size=vocab_size(config))
        amax = observe_kv(model, iter_batches(samples, cfg.batch_size or DEFAULT_BATCH_SIZE),
                          input_device)
    finally:
        if spread is not None:
            spread.close()
    bad = [n for n, (k, v) in amax.items() if not (k > 0 and v > 0)]
    if bad or not amax:
        raise Fp8ExportError(f"{cfg.calib_data}: no key/value range observed for "
                             f"{', '.join(bad[:3]) or 'any attention layer'}; check the data.")
    return amax, {"data": Path(cfg.calib_data).name, "samples": len(samples),
                  "tokens": samples.num_tokens, "seconds": round(time.perf_counter() - t0, 2),
                  "observed": "keys after the rotary embedding and values, as cached"}


def emulate_fp8_kv(model: torch.nn.Module, scales: dict[str, tuple[float, float]]) -> None:
    """From now on ``model``'s attention reads keys and values E4M3-quantized with the
    per-layer dequantization ``scales`` (module -> (k_scale, v_scale))."""
    from fp8export.numerics.fp8 import fake_quantize_e4m3

    def fn(name, key, value):
        ks, vs = scales[name]
        return (fake_quantize_e4m3(key, ks).to(key.dtype),
                fake_quantize_e4m3(value, vs).to(value.dtype))

    missing = set(attention_modules(model)) - set(scales)
    if missing:
        raise Fp8ExportError(f"no k_scale/v_scale for {', '.join(sorted(missing)[:3])}; "
                             "re-run `fp8export convert --kv-cache fp8`.")
    install(model, fn)
