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
    with kv_hook(model, _observer(amax, mask_now)), torch.inference_mode():
        for batch in batches:
            mask_now[:] = [batch.attention_mask]
            model(input_ids=batch.input_ids.to(input_device),
                  attention_mask=batch.attention_mask.to(input_device))
    return {n: (a[0], a[1]) for n, a in amax.items()}


def _observer(amax: dict[str, list[float]], mask_now: list):
    def fn(name, key, value):
        real = mask_now[0].to(key.device).bool()  # [batch, T]
        k = key.detach().abs().amax(dim=(1, 3))[real]
        v = value.detach().abs().amax(dim=(1, 3))[real]
        prev = amax.setdefault(name, [0.0, 0.0])
        if k.numel():
            prev[0] = max(prev[0], float(k.max()))
            prev[1] = max(prev[1], float(v.max()))
        return key, value
    return fn


def observe_kv_streamed(stream, per_block: int, comm=None) -> dict[str, tuple[float, float]]:
    """:func:`observe_kv` with layer streaming: the hook is installed on the skeleton before
    the capture (the mask the layers get depends on the attention function), so every layer
    built from it reports its keys and values."""
    amax: dict[str, list[float]] = {}
    mask_now: list[torch.Tensor] = []
    from fp8export.streaming.stream import Blocks, each_block

    batches = stream.batches
    with kv_hook(stream.parts.skeleton, _observer(amax, mask_now)):
        stream.capture()
        with Blocks(stream.parts, per_block, stream.device, comm) as blocks:
            for _k, block in each_block(blocks, "KV cache: keys and values, layer by layer"):
                stream.run(block, before=lambda b: mask_now.__setitem__(
                    slice(None), [batches[b].attention_mask]))
    return {n: (a[0], a[1]) for n, a in amax.items()}


def _reduce(amax: dict[str, tuple[float, float]], comm) -> dict[str, tuple[float, float]]:
    """The ranks' maxima combined (every rank sees every attention layer)."""
    if comm is None or not comm.distributed:
        return amax
    names = sorted(amax)
    t = torch.tensor([v for n in names for v in amax[n]], dtype=torch.float64)
    t = comm.max_floats(t, "KV-cache ranges")
    return {n: (float(t[2 * i]), float(t[2 * i + 1])) for i, n in enumerate(names)}


def kv_cache_ranges(cfg: ConvertCalibration, checkpoint: Path
                    ) -> tuple[dict[str, tuple[float, float]], dict[str, Any]]:
    """``convert --kv-cache fp8``: (attention module -> (k amax, v amax), facts for the
    manifest), calibrated on ``cfg.calib_data`` with the bf16 model (whole, or layer by layer
    as the plan decides; under torchrun each rank on its share, maxima combined)."""
    import time

    from fp8export.calibration.config import DEFAULT_BATCH_SIZE, DEFAULT_CALIB_SAMPLES
    from fp8export.checkpoint.source import open_checkpoint
    from fp8export.distributed import join
    from fp8export.inputs.samples import iter_batches, load_samples
    from fp8export.models import checkpoint_bytes, max_positions, vocab_size
    from fp8export.placement import parse_max_memory, resolve_device
    from fp8export.streaming.plan import decide, load_decided

    if cfg.calib_data is None:
        raise Fp8ExportError("--kv-cache fp8 calibrates the keys and values: give --calib-data "
                             "PATH.")
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    comm = join(device)
    with open_checkpoint(checkpoint) as ckpt:
        config = dict(ckpt.config or {})
    tok_dir = checkpoint if checkpoint.is_dir() else None
    samples = load_samples(cfg.calib_data, tok_dir,
                           max_samples=cfg.calib_samples or DEFAULT_CALIB_SAMPLES,
                           seq_len=cfg.seq_len, max_positions=max_positions(config),
                           vocab_size=vocab_size(config))
    batches = list(iter_batches(samples, cfg.batch_size or DEFAULT_BATCH_SIZE))
    mine = [batches[b] for b in comm.share(len(batches))]
    decision = decide(checkpoint_bytes(checkpoint, 2), device, parse_max_memory(cfg.max_memory),
                      cfg.offload, comm)
    if decision.mode == "layers":
        amax = _kv_streamed(cfg, checkpoint, mine, decision, comm)
    else:
        model, config, spread = load_decided(checkpoint, decision, torch.bfloat16)
        input_device = torch.device(spread.main_device if spread is not None else device)
        try:
            amax = observe_kv(model, mine, input_device)
        finally:
            if spread is not None:
                spread.close()
    amax = _reduce(amax, comm)
    bad = [n for n, (k, v) in amax.items() if not (k > 0 and v > 0)]
    if bad or not amax:
        raise Fp8ExportError(f"{cfg.calib_data}: no key/value range observed for "
                             f"{', '.join(bad[:3]) or 'any attention layer'}; check the data.")
    return amax, {"data": Path(cfg.calib_data).name, "samples": len(samples),
                  "tokens": samples.num_tokens, "seconds": round(time.perf_counter() - t0, 2),
                  "observed": "keys after the rotary embedding and values, as cached"}


def _kv_streamed(cfg, checkpoint: Path, batches, decision, comm):
    from fp8export._progress import info
    from fp8export.streaming.parts import CheckpointParts
    from fp8export.streaming.plan import hidden_bytes, layout, spill_parent, widths
    from fp8export.streaming.stream import Stream

    with CheckpointParts(checkpoint, torch.bfloat16, experts="routed") as parts:
        hidden, width = widths(parts.config)
        plan = layout(decision, [parts.layer_bytes(i) for i in range(parts.count)],
                      parts.rest_bytes(), hidden_bytes(batches, hidden, 2),
                      max((b.input_ids.numel() for b in batches), default=0), width, 2,
                      batches=len(batches), ranks=comm.world)
        plan.per_block = comm.agree_min(plan.per_block)
        for line in plan.lines():
            info(line)
        stream = Stream(parts, batches, torch.device(decision.device), tier=plan.tier,
                        spill_dir=spill_parent(cfg.resolved_output), name="kv-cache")
        try:
            return observe_kv_streamed(stream, plan.per_block, comm)
        finally:
            stream.close()
