"""``convert --plan``: which steps of this conversion run the model, and how the plan places it
(``fp8export.streaming.plan``), before anything is read beyond the headers and one layer."""

from __future__ import annotations

from fp8export.convert.config import ConvertConfig, KvCache, ScalesMode, WeightRounding


def model_steps(cfg: ConvertConfig) -> list[tuple[str, int]]:
    """``(step, passes over the layers)`` of every step that runs the bf16 model."""
    steps = []
    calibrates = cfg.calib_amax is None and cfg.calib_data is not None and \
        cfg.scales in (ScalesMode.AUTO, ScalesMode.CALIBRATE)
    if calibrates:
        steps.append(("calibration (activation ranges)", 1))
    if cfg.weight_rounding is WeightRounding.GPTQ:
        steps.append(("GPTQ input matrices", 1))
    elif cfg.weight_rounding is WeightRounding.GPTQ_SEQUENTIAL:
        steps.append(("sequential GPTQ (each layer run twice)", 2))
    if cfg.kv_cache is KvCache.FP8:
        steps.append(("KV-cache ranges", 1))
    if cfg.accuracy_budget is not None:
        steps.append(("--accuracy-budget search (whole model, host memory)", 0))
    return steps


def plan_convert(cfg: ConvertConfig) -> list[str]:
    """The plan's lines for ``cfg`` (nothing converted or written)."""
    import torch

    from fp8export.checkpoint.source import open_checkpoint
    from fp8export.distributed import join
    from fp8export.inputs.samples import iter_batches, load_samples
    from fp8export.models import checkpoint_bytes, max_positions, vocab_size
    from fp8export.placement import format_bytes, parse_max_memory, resolve_device
    from fp8export.streaming.plan import (
        decide,
        estimate,
        hidden_bytes,
        layout,
        measure,
        whole_lines,
        widths,
    )

    steps = model_steps(cfg)
    size = checkpoint_bytes(cfg.checkpoint, None)
    lines = [f"reads and writes: {format_bytes(size)} of weights (scan, write, read-back)"]
    if not steps:
        return lines + ["no step runs the model (weights only): nothing is placed on a device"]
    device = resolve_device(cfg.device)
    comm = join(device)
    decision = decide(checkpoint_bytes(cfg.checkpoint, 2), device,
                      parse_max_memory(cfg.max_memory), cfg.offload, comm)
    lines.append("steps that run the model: " + ", ".join(name for name, _ in steps))
    if decision.mode != "layers":
        return lines + whole_lines(decision)
    from fp8export.streaming.parts import CheckpointParts

    with open_checkpoint(cfg.checkpoint) as ckpt:
        config = dict(ckpt.config or {})
    tok_dir = cfg.checkpoint if cfg.checkpoint.is_dir() else None
    samples = load_samples(cfg.calib_data, tok_dir, max_samples=cfg.calib_samples or 512,
                           seq_len=cfg.seq_len, max_positions=max_positions(config),
                           vocab_size=vocab_size(config))
    batches = list(iter_batches(samples, cfg.batch_size or 8))
    mine = [batches[b] for b in comm.share(len(batches))]
    passes = len([s for s, p in steps if p])  # one read of the layers per step
    with CheckpointParts(cfg.checkpoint, torch.bfloat16, experts="all") as parts:
        hidden, width = widths(parts.config)
        plan = layout(decision, [parts.layer_bytes(i) for i in range(parts.count)],
                      parts.rest_bytes(), hidden_bytes(mine, hidden, 2),
                      max((b.input_ids.numel() for b in mine), default=0), width, 2,
                      passes=max(passes, 1), batches=len(mine), ranks=comm.world)
        if mine:
            plan.probe = measure(parts, mine, torch.device(device))
            plan.seconds = estimate(plan, plan.probe)
    return lines + plan.lines()
