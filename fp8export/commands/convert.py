"""``fp8export convert``: checkpoint -> FP8 (E4M3) safetensors folder (scales per tensor,
channel or block)."""

from __future__ import annotations

from pathlib import Path

import click

from fp8export._progress import echo
from fp8export.placement import MAX_MEMORY_HELP, OFFLOAD_HELP, PLAN_HELP


def _choice(*values: str) -> click.Choice:
    return click.Choice(values, case_sensitive=False)


def _list_schemes(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from fp8export.convert.schemes import list_schemes

    for line in list_schemes():
        echo(line)
    ctx.exit(0)


# command-line parameter -> ConvertConfig field, where the names differ
_FIELDS = {"fmt": "format", "no_fuse_scales": "fuse_scales"}
_NOT_OPTIONS = ("checkpoint", "output", "scheme", "recipe", "list_schemes")


def _explicit(ctx: click.Context, params: dict) -> dict:
    """The options given on the command line, as ConvertConfig fields: only these refine a
    --scheme or override a --recipe (an option left at its default does neither)."""
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    out = {}
    for name, value in params.items():
        if name in _NOT_OPTIONS or ctx.get_parameter_source(name) not in given:
            continue
        if name == "no_fuse_scales":
            value = not value
        out[_FIELDS.get(name, name)] = tuple(value) if isinstance(value, tuple) else value
    return out


@click.command("convert", short_help="checkpoint -> FP8 (E4M3) safetensors folder")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Output folder (default: a sibling <CHECKPOINT>-fp8).")
@click.option("--scheme", metavar="NAME",
              help="A named scheme, as llm-compressor and ModelOpt name it: FP8_DYNAMIC "
                   "(per-channel weights, dynamic per-token inputs), FP8 (per-tensor weights, "
                   "static calibrated inputs: give --calib-data), FP8_BLOCK (128x128 blocks, "
                   "dynamic per-group inputs); ModelOpt's fp8 and fp8_pc_pt too. It stands for "
                   "the options --list-schemes shows; options given explicitly refine it (the "
                   "defaults shown below are those without a scheme). Default: none.")
@click.option("--recipe", type=click.Path(path_type=Path), metavar="FILE",
              help="Replay a recorded run: a YAML/JSON file of convert options with the keys "
                   "of fp8export.json's options (scheme, scales, calib_data, ...; paths "
                   "relative to the file). Options given on the command line override it. "
                   "Default: none.")
@click.option("--list-schemes", is_flag=True, is_eager=True, expose_value=False,
              callback=_list_schemes,
              help="Print the named schemes, one line each (the options each stands for), "
                   "and exit.")
@click.option("--scales", type=_choice("auto", "history", "calibrate", "weights"),
              default="auto", show_default=True,
              help="Where activation scales come from. auto: FP8 training history if the "
                   "checkpoint has it, else calibration when --calib-data/--calib-amax is given, "
                   "else weights only (dynamic activations).")
@click.option("--calib-data", type=click.Path(path_type=Path),
              help="Calibration samples: .txt (one per line), .jsonl (text field), or "
                   ".npz/.safetensors with input_ids. Default: none (no calibration).")
@click.option("--calib-amax", type=click.Path(path_type=Path),
              help="amax.json written by `fp8export calibrate` (reuses a calibration run). "
                   "Default: none.")
@click.option("--calib-method", type=_choice("max", "percentile", "mse", "entropy"),
              default="max", show_default=True, help="Calibrator for --calib-data.")
@click.option("--percentile", type=float,
              help="Percentile for --calib-method percentile (default 99.99).")
@click.option("--calib-samples", type=click.IntRange(min=1),
              help="Use at most N calibration samples (default 512).")
@click.option("--batch-size", type=click.IntRange(min=1),
              help="Calibration batch size (default 8).")
@click.option("--seq-len", type=click.IntRange(min=1),
              help="Truncate calibration samples to N tokens (default and upper bound: the "
                   "model's maximum positions).")
@click.option("--amax-algo", type=_choice("max", "most-recent", "stored"), default="max",
              show_default=True,
              help="How a training amax history becomes one amax: its max, its newest entry, "
                   "or the scale the framework stored (what its own FP8 inference uses).")
@click.option("--margin", type=click.IntRange(min=0), default=0, show_default=True,
              help="Extra headroom for history scales: amax * 2**N.")
@click.option("--weight-scales-from-history", is_flag=True,
              help="Weight scales from the FP8 training state's weight amax histories (the "
                   "scales Keras / Transformer Engine computed with) instead of the final "
                   "weights' amax/448 (default): the FP8 model then matches the framework's own "
                   "FP8 inference.")
@click.option("--format", "fmt", type=_choice("compressed-tensors", "vllm", "modelopt"),
              default="compressed-tensors", show_default=True,
              help="quantization_config dialect: compressed-tensors (vLLM and transformers), "
                   "vllm (quant_method fp8; vLLM ONLY: transformers misreads it as block-wise "
                   "FP8), modelopt (hf_quant_config.json; TensorRT-LLM and vLLM ONLY: "
                   "transformers runs it without its scales; static only).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Keep modules matching GLOB (fnmatch on module names, e.g. "
                   "'model.layers.0.*') in high precision. Wins over everything. Repeatable. "
                   "Default: none (embeddings, norms, output heads and MoE routers are kept "
                   "anyway).")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Quantize modules matching GLOB even if excluded by default (e.g. lm_head "
                   "or MoE routers); needs a 2-D float weight. Repeatable.")
@click.option("--no-fuse-scales", is_flag=True,
              help="Give q/k/v and gate/up projections their own scales (default: they share "
                   "the group max, as vLLM and TensorRT-LLM run them).")
@click.option("--weight-granularity", type=_choice("tensor", "channel", "block"),
              default="tensor", show_default=True,
              help="One weight scale per tensor, one per output channel (weight_scale [out, 1]; "
                   "compressed-tensors strategy channel; --format compressed-tensors only), or "
                   "one per block of --block-size (DeepSeek-V3 / Qwen3-FP8 format: "
                   "compressed-tensors strategy block, or --format vllm weight_block_size with "
                   "weight_scale_inv; activations dynamic per token group). Which is more "
                   "accurate depends on the model: measure with verify.")
@click.option("--block-size", metavar="NxK",
              help="Block of --weight-granularity block: N output rows x K input columns, or N "
                   "for NxN. Default: 128x128 (what DeepSeek-V3, Qwen3-FP8 and vLLM use).")
@click.option("--scale-format", type=_choice("float", "ue8m0"), default="float",
              show_default=True,
              help="Block weight scales as float32, or ue8m0: powers of two in one byte "
                   "(F8_E8M0, scale_fmt ue8m0 in config.json; what transformers writes with "
                   "scale_fmt='ue8m0' and recent DeepSeek releases ship; each scale rounded up "
                   "so no weight clips). --format vllm --weight-granularity block only.")
@click.option("--dynamic-activations", type=_choice("tensor", "token", "group"),
              help="Layers without a static input scale quantize their input at run time with "
                   "one scale per token (default: what vLLM runs for dynamic inputs), one per "
                   "tensor, or one per token and group of the block's K columns (block "
                   "granularity, where it is the default and the only choice). Declared in "
                   "config.json and fp8export.json; verify runs what the folder declares.")
@click.option("--weight-rounding", type=_choice("nearest", "gptq", "gptq-sequential"),
              default="nearest", show_default=True,
              help="nearest: each weight to its nearest E4M3 value. gptq: E4M3 codes chosen "
                   "for each layer's output on --calib-data (GPTQ on the E4M3 grid of the same "
                   "scales): the same tensors and config, a more accurate model (measured in "
                   "the README's recipe table); costs a pass over the data and a solve per "
                   "layer. gptq-sequential: each layer's inputs come through the layers before "
                   "it as written (llm-compressor's sequential pipeline); one more pass per "
                   "layer.")
@click.option("--kv-cache", type=_choice("none", "fp8"), default="none", show_default=True,
              help="fp8: calibrate a k_scale/v_scale per attention layer on --calib-data (keys "
                   "after RoPE and values, as cached) and declare an FP8 KV cache where vLLM "
                   "(kv_cache_scheme) and TensorRT-LLM (kv_cache_quant_algo FP8) read it; "
                   "verify then runs the candidate with FP8 keys and values.")
@click.option("--device", type=_choice("auto", "cpu", "cuda"), default="auto",
              show_default=True, help="Device for calibration.")
@click.option("--max-memory", metavar="DEV=SIZE,...", help=MAX_MEMORY_HELP)
@click.option("--offload", type=_choice("auto", "layers", "none"), default="auto",
              show_default=True, help=OFFLOAD_HELP + " For every step that runs the model "
              "(calibration, GPTQ, the KV cache).")
@click.option("--plan", is_flag=True, help=PLAN_HELP)
@click.option("--accuracy-samples", type=click.IntRange(min=1),
              help="Samples of --calib-data (or the built-in set) that --accuracy-budget "
                   "searches on (default 32), taken after the samples calibration reads; the "
                   "next N/2 check the written folder on text neither saw.")
@click.option("--accuracy-budget", type=float, metavar="KL",
              help="Keep the fewest linears in high precision such that the measured KL "
                   "divergence (nats per token, finite, > 0) of the model convert writes to "
                   "the bf16 model is within KL, on calibration samples no calibration step "
                   "read; the written folder is measured again on held-out samples (exit 3 "
                   "when it misses; exit 1, nothing written, when no FP8 layer can meet it), "
                   "and the kept layers, met and the cost go into fp8export.json. Default: off "
                   "(every selected layer in FP8).")
@click.option("--workers", type=click.IntRange(min=1), metavar="N",
              help="Tensors converted at once (threads). Default: every core. The output is "
                   "identical for any N; memory grows by about 1.5x the largest weight per "
                   "worker.")
@click.option("--read-back", type=_choice("sampled", "full"), default=None,
              help="How much of the written shards is read back from disk before the output "
                   "is published: sampled (3 x 4 KiB of every tensor, compared with the source "
                   "quantized again; the default for safetensors input with per-tensor "
                   "scales) or full (every byte, against the sha256 taken while writing; the "
                   "only mode of the other paths).")
@click.option("--force", is_flag=True, help="Replace an earlier output folder of fp8export (or "
                                           "an empty one; built first, swapped in only when "
                                           "complete).")
def command(checkpoint, output, scheme, recipe, **params):
    """Convert CHECKPOINT to an FP8 (E4M3) safetensors folder, weight scales per tensor, channel
    or block.

    CHECKPOINT is a Hugging Face folder, a .safetensors file, a .pt/.pth/.bin state dict
    (Transformer Engine and torchao state included) or a Keras 3 .keras / .weights.h5 file or a
    folder holding one (pip install 'fp8export[keras]'; Keras itself is not needed). Linear
    weights become F8_E4M3 with F32 weight scales (scale = amax / 448; per tensor by default,
    --weight-granularity channel or block for more; block scales F8_E8M0 with --scale-format
    ue8m0) and, with calibration data or an FP8 training history, F32 input scales (else
    inputs are quantized at run time); embeddings, norms,
    output heads and MoE routers stay in their source precision. The folder also holds
    config.json with the quantization_config, the tokenizer files, and fp8export.json (per
    tensor: amax, scale, source, SQNR; excluded tensors with reasons). It is written to a
    temporary sibling, read back and verified, then renamed into place.

    --scheme NAME picks a named scheme (llm-compressor's FP8_DYNAMIC, FP8, FP8_BLOCK; ModelOpt's
    fp8, fp8_pc_pt; --list-schemes shows what each stands for); --recipe FILE replays the
    options a folder's fp8export.json records. Options given explicitly refine a scheme and
    override a recipe.

    Selection precedence: --exclude wins over everything; --include wins over the default
    exclusions.
    """
    from fp8export import api
    from fp8export.convert.recipe import resolve_config
    from fp8export.errors import VerificationFailed

    cfg = resolve_config(checkpoint, output, scheme=scheme, recipe=recipe,
                         **_explicit(click.get_current_context(), params))
    if cfg.plan:
        for line in api.plan_convert(cfg):
            echo(line)
        echo("plan only (--plan): nothing was converted or written")
        return
    try:
        result = api.convert(cfg)
    except VerificationFailed as missed:  # written, but over its --accuracy-budget: exit 3
        render(missed.result)
        raise
    render(result)


def _activation_line(result) -> str:
    from fp8export.notes import NoteKind, kind_of

    if result.activation_scheme == "dynamic":
        said = next((n for n in result.notes if kind_of(n) is NoteKind.ACTIVATIONS),
                    "activations: dynamic")
        if result.dynamic_activations == "group":  # the note names the group
            return said
        return f"{said}; per-{result.dynamic_activations} FP8 scales are computed at run time"
    sources: dict[str, int] = {}
    for row in result.layers:
        if row["input_scale_source"]:
            sources[row["input_scale_source"]] = sources.get(row["input_scale_source"], 0) + 1
    where = ", ".join(f"{n} from {s}" for s, n in sorted(sources.items()))
    line = f"activations: static per-tensor input scales ({where})"
    if result.dynamic_layers:
        line += f"; {len(result.dynamic_layers)} layer(s) without a range run dynamic"
    return line


def render(result) -> None:
    """Print the short summary of a ConvertResult."""
    sqnr = sorted(r["weight_sqnr_db"] for r in result.layers if r["weight_sqnr_db"] is not None)
    stats = (f" (weight SQNR min {sqnr[0]:.1f} dB, median {sqnr[len(sqnr) // 2]:.1f} dB)"
             if sqnr else "")
    from fp8export.fp8dir.engines import Loaders

    # "only" wherever transformers, the most common loader, would not load it right
    label = Loaders(tuple(result.loaded_by), {}).label()
    echo(f"wrote {result.output}  [{result.format}: {label}]")
    if result.scheme:
        from fp8export.convert.schemes import scheme_line

        echo(f"scheme: {scheme_line(result.scheme)}")
    echo(f"quantized: {result.quantized} linear layer(s) to FP8 E4M3{stats}")
    echo(_activation_line(result))
    if result.kv_cache:
        echo(f"kv cache: {result.kv_cache}")
    kept = result.excluded_by_reason()
    echo(f"kept in source precision: {len(result.excluded)} tensor(s)")
    by_reason: dict[str, list[str]] = {}
    for name, reason in result.excluded.items():
        by_reason.setdefault(reason, []).append(name)
    for reason, count in kept.items():
        names = by_reason[reason]
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        echo(f"  {count:4d}  {reason}: {shown}")
    from fp8export.notes import NoteKind, kind_of

    for note in result.notes:
        if kind_of(note) is not NoteKind.ACTIVATIONS:  # said on the activations line
            echo(f"note: {note}")
