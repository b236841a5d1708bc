"""``fp8export build-engine``: ONNX Q/DQ graph -> TensorRT FP8 engine (needs TensorRT + GPU).

Written to TensorRT 10.x/11.x's Python API and trtexec; not yet run against TensorRT."""

from __future__ import annotations

from pathlib import Path

import click

from fp8export._progress import echo


@click.command("build-engine",
               short_help="ONNX -> TensorRT FP8 engine (written to TensorRT 10/11; not run here)")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Engine path (default: MODEL with .engine).")
@click.option("--shapes", multiple=True, metavar="NAME:MIN,OPT,MAX",
              help="Optimization profile of one input, shapes as AxB: input_ids:1x1,1x128,8x512. "
                   "Default per dynamic input: batch 1,1,8 and sequence 1,128,512.")
@click.option("--workspace", "workspace_gib", type=float,
              help="Workspace memory limit in GiB (default: TensorRT's, the GPU's memory).")
@click.option("--opt-level", "optimization_level", type=click.IntRange(0, 5), default=3,
              show_default=True,
              help="Builder optimization level (higher: slower build, maybe faster engine).")
@click.option("--timing-cache", type=click.Path(path_type=Path),
              help="Load and save the timing cache here (default: none, every build times "
                   "tactics afresh).")
@click.option("--trtexec", "trtexec", type=click.Path(path_type=Path),
              help="Build with this trtexec binary (default: the tensorrt Python package, else "
                   "trtexec on PATH).")
@click.option("--print-command", is_flag=True,
              help="Print the trtexec command that builds this engine, and build nothing.")
@click.option("--force", is_flag=True, help="Replace an existing engine.")
def command(model, output, shapes, workspace_gib, optimization_level, timing_cache, trtexec,
            print_command, force):
    """Build a strongly typed TensorRT FP8 engine from MODEL (an export-onnx graph).

    Writes the engine and MODEL.engine.build.json (TensorRT version, GPU, build time, per-layer
    precision, and which quantized GEMMs really run in FP8). Fallbacks are reported loudly:
    TensorRT itself does not. Needs TensorRT 10.x/11.x (the Python package, or trtexec) and a
    GPU of compute capability >= 8.9. Written to TensorRT's Python API and trtexec's options
    but not yet run against TensorRT (it is not installable on fp8export's machines); the
    trtexec path is the tested one, with a stand-in trtexec (docs/tensorrt.md).
    """
    import shlex

    from fp8export import api
    from fp8export.engine.build import BuildEngineConfig, trtexec_command_for
    from fp8export.engine.shapes import parse_shape_spec

    cfg = BuildEngineConfig(
        onnx=model, output=output, shapes=tuple(parse_shape_spec(s) for s in shapes),
        workspace_gib=workspace_gib, optimization_level=optimization_level,
        timing_cache=timing_cache, force=force, trtexec=trtexec,
    )
    if print_command:
        echo(shlex.join(trtexec_command_for(cfg)))
        return
    result = api.build_engine(cfg)
    via = " via trtexec" if result.builder == "trtexec" else ""
    echo(f"engine: {result.engine}  (TensorRT {result.tensorrt_version}{via}, {result.gpu}, "
               f"CC {result.compute_capability}, {result.build_seconds:.1f}s)")
    echo(f"FP8 GEMMs: {result.fp8_gemms}")
    if result.fallback_gemms:
        click.secho(f"WARNING: {len(result.fallback_gemms)} quantized GEMM(s) did NOT run in FP8: "
                    + ", ".join(result.fallback_gemms), fg="yellow", err=True)
    for note in result.notes:
        echo(f"note: {note}", err=True)
    echo(f"report: {result.report}")
