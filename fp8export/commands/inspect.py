"""``fp8export inspect PATH``: explain a checkpoint, an FP8 folder or an ONNX graph."""

from __future__ import annotations

import click

from fp8export._progress import echo


@click.command("inspect", short_help="tables and plots of checkpoints, FP8 folders, ONNX graphs")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--plot", "plot", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write a plot of per-layer weight scale, input scale and SQNR: FILE.svg "
                   "or FILE.png. Default: no plot.")
@click.option("--force", is_flag=True, help="Replace an existing --plot file.")
@click.option("--json", "as_json", is_flag=True,
              help="Print machine-readable JSON instead of the table.")
def command(path: str, plot: str | None, force: bool, as_json: bool) -> None:
    """Table of every tensor of PATH: dtype, shape, amax, scale (amax/448), SQNR.

    PATH is a checkpoint (Hugging Face folder, .safetensors, .pt/.pth/.bin, Keras 3 .keras /
    .weights.h5 with the keras extra), an FP8 folder
    written by convert (scales and SQNR from fp8export.json), or a .onnx graph (structural
    checks). Exits 1 if PATH cannot be read, or if an ONNX graph fails its checks.
    """
    import json

    from fp8export import api
    from fp8export.errors import Fp8ExportError

    result = api.inspect(path, plot=plot, as_json=as_json, force=force)
    if as_json:
        echo(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    else:
        echo(result.to_text())
    if not result.ok:
        raise Fp8ExportError(f"{path}: the ONNX graph fails the checks listed above; re-export "
                             "it with fp8export export-onnx.")
