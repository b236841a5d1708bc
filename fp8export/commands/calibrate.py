"""``fp8export calibrate``: sample data -> per-layer activation amax (amax.json)."""

from __future__ import annotations

from pathlib import Path

import click

from fp8export._progress import echo
from fp8export.placement import MAX_MEMORY_HELP, OFFLOAD_HELP, PLAN_HELP

_CHOICES = {"case_sensitive": False}


@click.command("calibrate", short_help="sample data -> activation amax (amax.json)")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--calib-data", type=click.Path(path_type=Path), required=True,
              help="Calibration samples: .txt (one per line), .jsonl (text field), or "
                   ".npz/.safetensors with input_ids (and optionally attention_mask). Required.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="amax file to write (default: a sibling <CHECKPOINT>-amax.json).")
@click.option("--calib-method",
              type=click.Choice(["max", "percentile", "mse", "entropy"], **_CHOICES),
              default="max", show_default=True,
              help="max: largest |x|. percentile: clip the top (100-P)%. mse: least FP8 "
                   "round-trip error. entropy: least KL between observed and FP8 histograms.")
@click.option("--percentile", type=float, help="P for --calib-method percentile (default 99.99).")
@click.option("--calib-samples", type=click.IntRange(min=1), default=512, show_default=True,
              help="Use at most N samples (the first N of the file).")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Samples per forward pass.")
@click.option("--seq-len", type=click.IntRange(min=1),
              help="Truncate samples to N tokens (default and upper bound: the model's maximum "
                   "positions).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"], **_CHOICES), default="auto",
              show_default=True, help="auto: cuda when available. Several GPUs: models that do "
                   "not fit one are spread with accelerate (optional package).")
@click.option("--max-memory", metavar="DEV=SIZE,...", help=MAX_MEMORY_HELP)
@click.option("--offload", type=click.Choice(["auto", "layers", "none"], **_CHOICES),
              default="auto", show_default=True, help=OFFLOAD_HELP)
@click.option("--plan", is_flag=True, help=PLAN_HELP)
@click.option("--include", multiple=True, metavar="GLOB",
              help="Also calibrate these modules (default: exactly those convert quantizes).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Do not calibrate these modules (default: none beyond convert's own).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
def command(checkpoint, calib_data, output, calib_method, percentile, calib_samples, batch_size,
            seq_len, device, max_memory, offload, plan, include, exclude, force):
    """Observe the inputs of every linear layer `convert` quantizes, on the bf16 model.

    Writes amax.json (method, sample count, per-layer amax and scale = amax/448, the
    checkpoint's weight-file hashes); reuse it with `fp8export convert CKPT --calib-amax
    amax.json`. Padding is excluded; fused q/k/v and gate/up share one input amax. The same
    data on the same device gives the same file, byte for byte.
    """
    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig

    cfg = CalibrateConfig(checkpoint=checkpoint, calib_data=calib_data, output=output,
                          calib_method=calib_method, percentile=percentile,
                          calib_samples=calib_samples, batch_size=batch_size, seq_len=seq_len,
                          device=device, max_memory=max_memory, offload=offload, plan=plan,
                          include=include, exclude=exclude, force=force)
    cfg = CalibrateConfig(**{**cfg.__dict__, "output": cfg.resolved_output})
    result = api.calibrate(cfg)
    if result.planned:
        for line in result.plan:
            echo(line)
        echo("plan only (--plan): nothing was calibrated or written")
        return
    opts = "".join(f", {k}={v}" for k, v in result.options.items())
    echo(f"calibrated {len(result.amax)} layers with {result.method}{opts} on "
               f"{result.samples} samples ({result.tokens} tokens, {result.device}, "
               f"{result.seconds:.1f}s)")
    if result.missing:
        echo(f"warning: {len(result.missing)} layers received no input and have no amax: "
                   + ", ".join(result.missing[:8]) + (" ..." if len(result.missing) > 8 else ""),
                   err=True)
    for note in result.notes:
        echo(f"note: {note}", err=True)
    if result.ranks > 1:
        echo(f"data parallel: {result.ranks} ranks, each on its share of the batches; rank 0 "
             "wrote the file")
    if result.streaming and result.streaming.get("peak_device_bytes") is not None:
        from fp8export.placement import format_bytes

        peak, planned = (format_bytes(result.streaming[k])
                         for k in ("peak_device_bytes", "device_peak"))
        echo(f"layer streaming: peak GPU memory {peak} (planned at most {planned})")
    echo(f"amax: {cfg.output}")
