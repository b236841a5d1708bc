"""``fp8export verify REFERENCE CANDIDATE``: imports only click; the work is in fp8export.verify."""

from __future__ import annotations

import click

from fp8export._progress import echo
from fp8export.placement import MAX_MEMORY_HELP, OFFLOAD_HELP, PLAN_HELP

THRESHOLD_HELP = ("Preset (strict, default, loose) or a .yaml/.json file of metric: bound "
                  "(e.g. {preset: default, kl_mean: 0.01}).")


@click.command("verify", short_help="FP8 outputs vs bf16 reference -> report (exit 3 on fail)")
@click.argument("reference", type=click.Path(path_type=str))
@click.argument("candidate", type=click.Path(path_type=str))
@click.option("--data", type=click.Path(path_type=str), default=None,
              help="Eval data: .txt, .jsonl (text), .npz/.safetensors (input_ids). Default: a "
                   "small built-in sample set (said in the report).")
@click.option("--thresholds", default="default", show_default=True, help=THRESHOLD_HELP)
@click.option("--report-dir", type=click.Path(path_type=str), default="fp8export-report",
              show_default=True, help="Where report.json/.md/.html and junit.xml go.")
@click.option("--backend", type=click.Choice(["auto", "torch", "onnxruntime", "tensorrt"]),
              default="auto", show_default=True,
              help="Candidate runtime; auto picks from the path (FP8 folder → torch FP8, "
                   ".onnx → onnxruntime, .engine/.plan → TensorRT).")
@click.option("--reference-dtype", type=click.Choice(["bf16", "fp32"]), default="bf16",
              show_default=True, help="Precision the reference runs in (and a non-FP8-folder "
                                      "candidate's torch runtime).")
@click.option("--samples", type=int, default=None,
              help="Use at most N samples (default: all of --data).")
@click.option("--batch-size", type=int, default=4, show_default=True,
              help="Samples per forward pass.")
@click.option("--seq-len", type=int, default=128, show_default=True,
              help="Truncate samples to N tokens.")
@click.option("--per-layer", is_flag=True, help="Rank quantized layers by the error each adds "
                                                "(SQNR of its output; FP8 folder candidates).")
@click.option("--no-noise-floor", is_flag=True,
              help="Skip the noise floor. By default the reference also runs in fp32 on the "
                   "same inputs and the bf16 reference's own loss is reported next to FP8's "
                   "(one more forward, an fp32 copy of the reference in memory).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="Device of the torch runtimes; auto: cuda when available.")
@click.option("--max-memory", metavar="DEV=SIZE,...",
              help=MAX_MEMORY_HELP + " Shared by the reference and a torch candidate.")
@click.option("--offload", type=click.Choice(["auto", "layers", "none"]), default="auto",
              show_default=True, help=OFFLOAD_HELP + " Streams the reference, an FP8-folder "
              "candidate and the fp32 noise floor alike.")
@click.option("--plan", is_flag=True, help=PLAN_HELP)
@click.option("--timeout", type=click.FloatRange(min=0), default=None,
              help="Wall-clock limit of the whole run in seconds, every stage included "
                   "(loading, comparing, hashing); reached, verify exits 1 saying how far it "
                   "got. Default: no limit (0: none).")
@click.option("--force", is_flag=True,
              help="Replace the report files an existing --report-dir already holds.")
@click.option("--fp8-mode", type=click.Choice(["auto", "emulate", "scaled_mm"]), default="auto",
              show_default=True, help="Torch FP8 path: torch._scaled_mm on compute capability "
                                      ">= 8.9 (auto), or exact emulation.")
@click.option("--ort-opt-level", type=click.Choice(["disable", "basic", "extended", "all"]),
              default=None, help="onnxruntime graph optimization level for an .onnx candidate "
                                 "(ORT_DISABLE_ALL .. ORT_ENABLE_ALL). Default: onnxruntime's "
                                 "own default (ORT_ENABLE_ALL), as InferenceSession(path) runs "
                                 "it; the report says which level ran.")
@click.option("--kv-cache", "kv_cache", type=click.Choice(["auto", "fp8", "none"]),
              default="auto", show_default=True,
              help="FP8-folder candidates: fp8 judges the folder with its FP8 KV cache (E4M3 "
                   "keys and values with its k_scale/v_scale) and reports the FP8-linears-only "
                   "result next to it; none: 16-bit keys and values; auto: the cache the "
                   "folder declares.")
@click.option("--attention", type=click.Choice(["bf16", "fp8"]), default="bf16",
              show_default=True,
              help="fp8: judge the FP8-folder candidate with FP8 attention on its FP8 KV cache "
                   "and report the FP8-linears-only and KV-cache-only results next to it.")
def command(reference, candidate, data, thresholds, report_dir, backend, reference_dtype,
            samples, batch_size, seq_len, per_layer, no_noise_floor, device, max_memory,
            offload, plan, timeout, force, fp8_mode, ort_opt_level, kv_cache, attention):
    """Compare CANDIDATE (FP8 folder, .onnx, .engine) with the bf16 REFERENCE's logits.

    REFERENCE is the model the candidate was converted from: a Hugging Face folder, or a Keras
    3 .keras / .weights.h5 file (pip install 'fp8export[keras]'; run without Keras). For
    classifiers with labels in --data the task accuracy of both is reported.

    Exit 0: passed; 1: bad input or environment; 2: usage error; 3: ran, and thresholds
    failed; 130: interrupted.
    """
    from fp8export import api
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig

    cfg = VerifyConfig(reference=reference, candidate=candidate, data=data,
                       thresholds=thresholds, report_dir=report_dir, backend=backend,
                       reference_dtype=reference_dtype, samples=samples, batch_size=batch_size,
                       seq_len=seq_len, per_layer=per_layer, noise_floor=not no_noise_floor,
                       device=device, max_memory=max_memory, offload=offload, plan=plan,
                       fp8_mode=fp8_mode,
                       ort_opt_level=ort_opt_level, timeout=timeout, force=force,
                       kv_cache=kv_cache, attention=attention,
                       command_line=_command_line(click.get_current_context()))
    if plan:
        for line in api.plan_verify(cfg):
            echo(line)
        echo("plan only (--plan): nothing was compared or written")
        return
    try:
        result = api.verify(cfg)
    except VerificationFailed as exc:
        _summary(exc.result)
        raise
    _summary(result)


def _command_line(ctx: click.Context) -> str:
    """The command as typed (the options given, in declaration order), shell-quoted."""
    import shlex

    from click.core import ParameterSource

    words = ["fp8export", ctx.info_name or "verify"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if isinstance(param, click.Argument):
            words.append(str(value))
        elif ctx.get_parameter_source(param.name) not in (ParameterSource.DEFAULT, None):
            if getattr(param, "is_flag", False):
                if value:
                    words.append(param.opts[0])
            else:
                words += [param.opts[0], str(value)]
    return shlex.join(words)


def _summary(result) -> None:
    if result is None:
        return
    m = result.metrics
    parts = [f"{k}={m[k]:.4g}" for k in ("cosine_min", "top1_agreement", "neighbor_agreement",
                                          "kl_mean", "ppl_ratio") if k in m]
    level = (result.candidate or {}).get("graph_optimization_level")
    runs_at = f" at {level} ({result.candidate.get('level_source')})" if level else ""
    if "accuracy_candidate" in m:  # a classifier scored against the data's labels
        parts.append(f"accuracy={m['accuracy_candidate']:.4g} (reference "
                     f"{m['accuracy_reference']:.4g})")
    echo(f"{'PASSED' if result.passed else 'FAILED'}: {result.samples} samples, "
               f"backend {result.backend}{runs_at}, judged by {result.family}; "
               + ", ".join(parts))
    for row in (result.attention_cost or {}).get("rows") or []:
        kl, top1 = row.get("kl_mean"), row.get("top1_agreement")
        span = row.get("kl_mean_interval") or [float("nan")] * 2
        echo(f"  {row['configuration']}: kl_mean {kl:.3g} [{span[0]:.3g}, {span[1]:.3g}], "
             f"top1 {top1:.4f}")
    floor = result.noise_floor
    if floor:
        f = floor["metrics"]
        shown = [f"{k}={f[k]:.4g}" for k in ("cosine_min", "top1_agreement",
                                              "neighbor_agreement", "kl_mean", "ppl_ratio")
                 if k in f]
        echo(f"  noise floor ({floor['reference_dtype']} reference vs "
                   f"{floor['against']}): " + ", ".join(shown))
    for f in result.failures:
        echo(f"  failed: {f['message']}")
    conf = result.confidence or {}
    if conf:
        echo(f"  verdict {conf['verdict']} ({conf['level']:.0%} bootstrap intervals over "
             f"{conf['samples']} samples, {conf['tokens']:,} tokens)"
             + ("" if conf["warnings"] else ": every check is decided"))
        for w in conf["warnings"]:
            echo(f"  warning: {w}")
    if result.per_layer and result.per_layer[0]["sqnr_db"] is not None:
        worst = result.per_layer[0]
        echo(f"  worst layer: {worst['module']} ({worst['sqnr_db']:.1f} dB)")
    elif result.layer_check and result.layer_check["worst"] and result.passed \
            and result.layer_check["threshold"] is not None:
        lc, worst = result.layer_check, result.layer_check["worst"][0]
        echo(f"  layer check: worst of {lc['measured']} quantized layers "
             f"{worst['module']} ({worst['sqnr_db']:.1f} dB; needs >= {lc['threshold']:g} dB)")
    if result.reports:
        echo(f"  report: {result.reports.get('report.md')}")
