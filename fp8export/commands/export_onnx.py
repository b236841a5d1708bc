"""``fp8export export-onnx``: FP8 folder -> standard ONNX Q/DQ graph (checked against TRT rules)."""

from __future__ import annotations

from pathlib import Path

import click

from fp8export._progress import echo


@click.command("export-onnx",
               short_help="FP8 folder -> ONNX Q/DQ graph (checked against TensorRT's FP8 rules)")
@click.argument("fp8_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Output .onnx file (default: sibling FP8DIR.onnx).")
@click.option("--dtype", type=click.Choice(["fp16", "fp32", "bf16"]),
              help="Activation dtype of the graph (default fp16; fp32 for Keras sources). "
                   "onnxruntime runs fp16/fp32 only; bf16 is for TensorRT (opset 23, fp32 "
                   "scales, TensorRT >= 10.13).")
@click.option("--opset", type=int, help="ONNX opset, 21..23 (default 21; 23 for bf16).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(fp8_dir, output, dtype, opset, force, as_json):
    """Export the FP8 folder FP8DIR (from `fp8export convert`) to an ONNX Q/DQ graph.

    Every quantized linear gets a FLOAT8E4M3FN weight -> DequantizeLinear and, when its input
    scale is static, QuantizeLinear -> DequantizeLinear on its input, with nothing between the
    DQs and the MatMul. Before it is written the graph is checked with onnx.checker and with
    fp8export's implementation of TensorRT's documented FP8 rules (no TensorRT runs: a failing
    graph is never written), and run in onnxruntime at each graph optimization level; a level
    that computes it differently is named in a note and in the model's metadata.
    """
    from fp8export import api
    from fp8export.onnx.export import ExportOnnxConfig

    cfg = ExportOnnxConfig(fp8_dir=fp8_dir, output=output, dtype=dtype, opset=opset, force=force)
    result = api.export_onnx(cfg)
    if as_json:
        import json

        echo(json.dumps(result.to_dict(), indent=2))
        return
    size = result.file_bytes / 2**20
    echo(f"wrote {result.output} ({size:.1f} MiB, {result.dtype}, opset {result.opset}, "
         f"IR {result.ir_version}, output '{result.output_name}', {result.seconds:.1f}s, of "
         f"which {result.trace_seconds:.1f}s in torch.onnx.export)")
    if result.external_data:
        echo(f"external data: {result.external_data}")
    total = len(result.fp8_gemms) + len(result.sixteen_bit)
    echo(f"FP8-eligible GEMMs (TensorRT): {len(result.fp8_gemms)} of {total} quantized")
    if result.sixteen_bit and not result.weight_only:  # weight-only: one note says why
        click.secho(f"16-bit GEMMs: {len(result.sixteen_bit)} (TensorRT will run these in 16-bit)",
                    fg="yellow", err=True)
        for layer, reason in result.sixteen_bit.items():
            echo(f"  {layer}: {reason}", err=True)
    from fp8export.notes import NoteKind, kind_of

    for note in result.notes:
        if kind_of(note) is not NoteKind.SIXTEEN_BIT:  # listed above, layer by layer
            echo(f"note: {note}", err=True)
