"""FP8 KV cache calibration: per-attention-layer ranges of the keys and values the attention
reads, observed through the runtime's attention hook (``fp8export.runtime.kv_cache``: keys after
the rotary embedding, values as projected, as vLLM and TensorRT-LLM cache them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fp8export.calibration.config import ConvertCalibration
from fp8export.errors import Fp8ExportError
from fp8export.runtime.kv_cache import kv_hook


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


def kv_cache_ranges(cfg: ConvertCalibration, checkpoint: Path
                    ) -> tuple[dict[str, tuple[float, float]], dict[str, Any]]:
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
