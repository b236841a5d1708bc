"""The calibrate verbs and their result.

:func:`calibrate` (``fp8export calibrate``; ``fp8export.api.calibrate``) and
:func:`calibrate_ranges` (``convert --scales calibrate`` / ``--calib-amax``): choose the device
and load the model (on one device or spread over several: :mod:`fp8export.placement`), pick
the linears and their fused groups (:mod:`.targets`), run one observation pass
(:mod:`.observe`), turn it into amaxes with the chosen calibrator and write ``amax.json``
(:mod:`.amax_file`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp8export._progress import info, stage
from fp8export._threads import fit_torch
from fp8export.calibration.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_CALIB_SAMPLES,
    CalibrateConfig,
    ConvertCalibration,
)
from fp8export.config import ScaleSource
from fp8export.errors import Fp8ExportError
from fp8export.scales.ranges import ActivationRange


@dataclass
class CalibrationResult:
    """What one calibration run found (JSON-serialisable via :meth:`to_dict`).

    ``amax``: the amax each module's ``input_scale`` should use (fused groups share their
    max). ``observed_amax``: each module's own calibrator result before sharing. ``missing``:
    modules that never received input (absent from ``amax``; the caller falls back).
    """

    checkpoint: str
    data: str
    method: str
    options: dict[str, Any]
    samples: int
    tokens: int
    batches: int
    device: str
    seconds: float
    amax: dict[str, float]
    observed_amax: dict[str, float]
    groups: dict[str, list[str]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    # MoE: experts module -> tokens routed to each expert (every expert observed on all tokens)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)
    dtype: str = "bfloat16"
    source_files: dict[str, str] = field(default_factory=dict)  # weight file -> sha256
    # how the run went, not written to amax.json: the plan's lines, layer streaming's sizes and
    # peak device memory, the number of data-parallel ranks, and whether only the plan was made
    plan: list[str] = field(default_factory=list)
    streaming: dict[str, Any] | None = None
    ranks: int = 1
    planned: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def ranges(self) -> dict[str, ActivationRange]:
        """``ActivationRange`` per calibrated module (source = calibration)."""
        out = {}
        for m, a in self.amax.items():
            d = {"method": self.method, **self.options, "samples": self.samples,
                 "tokens": self.tokens}
            if self.observed_amax.get(m) != a:
                d["observed_amax"] = self.observed_amax.get(m)
                d["shared_with_group"] = True
            expert = expert_of(m, self.expert_tokens)
            if expert is not None:
                d["experts_calibrated"] = "all"
                d["routed_tokens"] = expert
            out[m] = ActivationRange(module=m, amax=float(a), source=ScaleSource.CALIBRATION,
                                     details=d)
        return out


def expert_of(module: str, expert_tokens: dict[str, list[int]]) -> int | None:
    """Tokens routed to the expert ``module`` belongs to (``<experts>.<index>.<leaf>``), or None
    when it is no expert projection."""
    head, _, _leaf = module.rpartition(".")
    experts, _, index = head.rpartition(".")
    counts = expert_tokens.get(experts)
    if counts is None or not index.isdigit() or int(index) >= len(counts):
        return None
    return int(counts[int(index)])


def moe_note(expert_tokens: dict[str, list[int]], tokens: int) -> str:
    """One line on how the experts were calibrated and how many tokens each was routed."""
    counts = [c for layer in expert_tokens.values() for c in layer]
    starved = sum(1 for c in counts if c == 0)
    return (f"MoE: every expert of {len(expert_tokens)} layers was observed on all {tokens} "
            "calibration tokens (calibrate-all-experts; the routed output is unchanged); tokens "
            f"routed to one expert: {min(counts)}..{max(counts)}"
            + (f", {starved} experts routed none" if starved else "")
            + " (per expert in the manifest's input_details.routed_tokens).")


def calibrate(cfg: CalibrateConfig) -> CalibrationResult:
    """Calibrate ``cfg.checkpoint`` on ``cfg.calib_data``; write ``amax.json`` if ``cfg.output``.

    Raises Fp8ExportError for bad input, when no module received any input, or when the
    output exists and ``force`` is not set (checked before any work).
    """
    return _calibrate(cfg, None)


def _calibrate(cfg: CalibrateConfig, known_groups: dict[str, list[str]] | None
               ) -> CalibrationResult:
    from fp8export.checkpoint.source import check_checkpoint_path
    from fp8export.inputs.samples import check_data_file

    # every path before torch loads: a typo costs milliseconds, not a model load
    check_checkpoint_path(cfg.checkpoint)
    check_data_file(cfg.calib_data)
    if cfg.output is not None:
        from fp8export.calibration.amax_file import check_output

        check_output(cfg.output, cfg.force, (cfg.checkpoint, cfg.calib_data))
    fit_torch()  # the CPU threads fitted to this machine, before the model loads

    from fp8export.calibration.calibrators import calibrator_class, get_calibrator
    from fp8export.distributed import join
    from fp8export.placement import resolve_device

    method = str(cfg.calib_method)
    calibrator_class(method)
    get_calibrator(method, **cfg.method_options())  # validate options before loading
    device = resolve_device(cfg.device)
    comm = join(device)
    # Text is tokenised by the checkpoint's tokenizer in a child process: opened before the
    # model loads, so a hostile tokenizer fails in a second and a good one loads meanwhile.
    with _tokenizer_for(cfg) as tokenizer:
        return _calibrate_on(cfg, known_groups, device, method, tokenizer, comm)


def _tokenizer_for(cfg: CalibrateConfig):
    """The checkpoint's open tokenizer when the data is text, else a context of None."""
    import contextlib

    from fp8export.inputs.samples import TEXT_SUFFIXES
    from fp8export.inputs.tokenizer import open_tokenizer

    if not cfg.checkpoint.is_dir() or Path(cfg.calib_data).suffix.lower() not in TEXT_SUFFIXES:
        return contextlib.nullcontext(None)
    return open_tokenizer(cfg.checkpoint, for_file=Path(cfg.calib_data))


def _calibrate_on(cfg: CalibrateConfig, known_groups, device: str, method: str, tokenizer,
                  comm) -> CalibrationResult:
    """Samples, then the run the plan picks: the whole model (one device or spread) or layer
    streaming; each rank observes its share of the batches, the statistics are combined."""
    import torch

    from fp8export.calibration.observe import observe, reduce_observation
    from fp8export.checkpoint.source import open_checkpoint
    from fp8export.inputs.samples import iter_batches, load_samples
    from fp8export.models import (
        checkpoint_bytes,
        max_positions,
        module_names,
        refuse_quantized,
        vocab_size,
    )
    from fp8export.moe import stores_fused_experts
    from fp8export.placement import parse_max_memory
    from fp8export.streaming.plan import decide

    with open_checkpoint(cfg.checkpoint) as ckpt:
        refuse_quantized(ckpt, cfg.checkpoint)  # an FP8 folder is no model to observe
        config = dict(ckpt.config or {})
        fused = stores_fused_experts([t.name for t in ckpt.tensors()])
    modules, groups = _selection(cfg, known_groups, config)
    tok_dir = cfg.checkpoint if cfg.checkpoint.is_dir() else None
    samples = load_samples(cfg.calib_data, tok_dir, max_samples=cfg.calib_samples,
                           seq_len=cfg.seq_len, max_positions=max_positions(config),
                           vocab_size=vocab_size(config), tokenizer=tokenizer)
    notes: list[str] = []
    if samples.media is not None:
        notes.append(f"calibration inputs: {samples.media['images']} image, "
                     f"{samples.media['audio']} audio, {samples.media['text_only']} text-only "
                     f"sample(s) through the model's {samples.media['processor']}")
    if cfg.calib_samples and len(samples) < cfg.calib_samples:
        notes.append(f"used all {len(samples)} samples of {cfg.calib_data} (fewer than "
                     f"--calib-samples {cfg.calib_samples})")
    batches = list(iter_batches(samples, cfg.batch_size or DEFAULT_BATCH_SIZE))
    mine = [batches[b] for b in comm.share(len(batches))]
    decision = decide(checkpoint_bytes(cfg.checkpoint, 2), device,
                      parse_max_memory(cfg.max_memory), cfg.offload, comm)
    if decision.mode == "layers":
        return _calibrate_streamed(cfg, modules, groups, samples, batches, mine, decision,
                                   method, notes, comm)
    if cfg.plan:
        from fp8export.streaming.plan import whole_lines

        return _planned(cfg, method, whole_lines(decision), device)
    from fp8export.moe import unfuse_experts
    from fp8export.streaming.plan import load_decided

    with stage(f"loading the bf16 model {cfg.checkpoint} ({device})"):
        model, config, spread = load_decided(cfg.checkpoint, decision, torch.bfloat16)
        if not fused:  # MoE: every expert sees every token
            unfuse_experts(model, mode="all")
    input_device = torch.device(spread.main_device if spread is not None else device)
    if spread is not None:
        notes.append(spread.note())
        device = ",".join(spread.devices)
    try:
        names = module_names(model, modules)
        ob = observe(model, samples, [names[m] for m in modules], method=method,
                     groups={g: [names.get(m, m) for m in ms] for g, ms in groups.items()},
                     batch_size=cfg.batch_size or DEFAULT_BATCH_SIZE,
                     input_device=input_device, batches=mine)
    finally:
        if spread is not None:
            spread.close()
    ob = reduce_observation(ob, [names[m] for m in modules], comm)
    return _finish(cfg, method, modules, groups, names, ob, samples, notes, device, comm)


def _selection(cfg: CalibrateConfig, known_groups, config: dict
               ) -> tuple[list[str], dict[str, list[str]]]:
    """The modules to observe (checkpoint names) and their fused groups."""
    from fp8export.calibration.targets import default_modules
    from fp8export.scales.groups import fused_groups

    if cfg.modules:
        modules = list(cfg.modules)
        if not cfg.fuse_scales:
            groups = {}
        elif known_groups is not None:  # convert's selection already knows them
            groups = {g: [m for m in ms if m in set(modules)] for g, ms in known_groups.items()}
        else:
            groups = fused_groups(modules, config)
    else:
        modules, groups = default_modules(cfg.checkpoint, include=cfg.include,
                                          exclude=cfg.exclude, fuse_scales=cfg.fuse_scales)
    if not modules:
        raise Fp8ExportError(f"{cfg.checkpoint}: no linear layers to calibrate (the selection "
                             "is empty); check --include/--exclude.")
    return modules, groups


def _planned(cfg: CalibrateConfig, method: str, lines: list[str], device: str
             ) -> CalibrationResult:
    """``--plan``: the plan, nothing calibrated or written."""
    return CalibrationResult(checkpoint=str(cfg.checkpoint), data=str(cfg.calib_data),
                             method=method, options={}, samples=0, tokens=0, batches=0,
                             device=device, seconds=0.0, amax={}, observed_amax={},
                             plan=lines, planned=True)


def _calibrate_streamed(cfg: CalibrateConfig, modules, groups, samples, batches, mine,
                        decision, method: str, notes: list[str], comm) -> CalibrationResult:
    """The observation with layer streaming (:mod:`fp8export.streaming`)."""
    import torch

    from fp8export.calibration.observe import reduce_observation
    from fp8export.calibration.streamed import observe_layers
    from fp8export.models import module_names
    from fp8export.streaming.parts import CheckpointParts
    from fp8export.streaming.plan import (
        estimate,
        hidden_bytes,
        layout,
        measure,
        spill_parent,
        widths,
    )
    from fp8export.streaming.stream import Stream

    device = decision.device
    with stage(f"reading the structure of {cfg.checkpoint} (layer streaming)"):
        parts = CheckpointParts(cfg.checkpoint, torch.bfloat16, experts="all")
    with parts:
        hidden, width = widths(parts.config)
        plan = layout(decision, [parts.layer_bytes(i) for i in range(parts.count)],
                      parts.rest_bytes(), hidden_bytes(mine, hidden, 2),
                      max((b.input_ids.numel() for b in mine), default=0), width, 2,
                      batches=len(mine), ranks=comm.world)
        plan.per_block = comm.agree_min(plan.per_block)  # every rank checks in per block
        if cfg.plan:
            if mine:
                plan.probe = measure(parts, mine, torch.device(device))
                plan.seconds = estimate(plan, plan.probe)
            return _planned(cfg, method, plan.lines(), device)
        for line in plan.lines():
            info(line)
        names = module_names(parts.skeleton, modules)
        stream = Stream(parts, mine, torch.device(device), tier=plan.tier,
                        spill_dir=spill_parent(cfg.output or cfg.spill_dir),
                        name="calibration")
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            with stage(f"embedding {len(mine)} batch(es)"):
                stream.capture()
            ob = observe_layers(stream, [names[m] for m in modules], method=method,
                                groups={g: [names.get(m, m) for m in ms]
                                        for g, ms in groups.items()},
                                per_block=plan.per_block, comm=comm)
        finally:
            stream.close()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    ob = reduce_observation(ob, [names[m] for m in modules], comm)
    result = _finish(cfg, method, modules, groups, names, ob, samples, notes, device, comm)
    result.plan = plan.lines()
    result.streaming = {**plan.to_dict(), "peak_device_bytes": peak}
    return result


def _finish(cfg: CalibrateConfig, method: str, modules, groups, names, ob, samples,
            notes: list[str], device: str, comm) -> CalibrationResult:
    """Amaxes from the (combined) statistics, the result, and ``amax.json`` (rank 0)."""
    from fp8export.calibration.amax_file import source_hashes, write_amax_file
    from fp8export.calibration.calibrators import get_calibrator
    from fp8export.calibration.observe import amaxes_from_stats
    from fp8export.numerics.fp8 import amax_to_scale
    from fp8export.scales.groups import share_max

    # observed under the model's module names (transformers renames some, e.g. Mixtral's
    # block_sparse_moe is mlp), reported under the checkpoint's
    back = {v: k for k, v in names.items()}
    ob.stats = {back.get(m, m): s for m, s in ob.stats.items()}
    ob.missing = [back.get(m, m) for m in ob.missing]
    expert_tokens = {_checkpoint_prefix(k, names): v for k, v in ob.expert_tokens.items()}
    if expert_tokens:
        notes.append(moe_note(expert_tokens, ob.tokens))
    t0 = time.perf_counter()
    results = amaxes_from_stats(ob.stats, method, **cfg.method_options())
    compute_s = time.perf_counter() - t0
    if not results:
        raise Fp8ExportError(
            f"{cfg.checkpoint}: none of the {len(modules)} layers received input from "
            f"{cfg.calib_data}; check that the data matches the model.")
    observed = {m: r.amax for m, r in results.items()}
    amax = share_max(observed, groups)
    for m, a in amax.items():
        amax_to_scale(a, f"{m} (input, {method} calibration)")  # never an invalid scale
    if ob.missing:
        info(f"Note: {len(ob.missing)} layers received no input during calibration and get no "
             f"calibrated scale (the caller falls back): {', '.join(ob.missing[:8])}"
             + (" ..." if len(ob.missing) > 8 else ""))
    notes.extend(ob.notes)
    result = CalibrationResult(
        checkpoint=str(cfg.checkpoint), data=str(cfg.calib_data), method=method,
        options=get_calibrator(method, **cfg.method_options()).options(),
        samples=ob.samples, tokens=ob.tokens, batches=ob.batches, device=device,
        seconds=round(ob.seconds + compute_s, 3), amax=amax, observed_amax=observed,
        groups=groups, missing=ob.missing, notes=notes, expert_tokens=expert_tokens,
        details={m: r.details for m, r in results.items()},
        source_files=source_hashes(cfg.checkpoint) if comm.rank == 0 else {},
        ranks=comm.world)
    if samples.truncated:
        result.notes.append(f"{samples.truncated} samples truncated to {samples.max_len} tokens")
    from fp8export.distributed import rank0_writes

    if cfg.output is not None:
        with rank0_writes(f"writing {cfg.output}") as writes:
            if writes:
                write_amax_file(result, cfg.output, force=cfg.force)
    return result


def _checkpoint_prefix(experts: str, names: dict[str, str]) -> str:
    """The checkpoint's name of the model's experts module ``experts`` (via its members)."""
    for ckpt_name, model_name in names.items():
        if model_name.startswith(experts + "."):
            rest = model_name[len(experts):]
            if ckpt_name.endswith(rest):
                return ckpt_name[:-len(rest)]
    return experts


def calibrate_ranges(cfg: ConvertCalibration, modules: list[str],
                     groups: dict[str, list[str]] | None = None
                     ) -> tuple[dict[str, ActivationRange], dict[str, Any]]:
    """Activation ranges for ``convert``: from ``cfg.calib_amax`` if given, else calibrate.
    ``cfg``: convert's options (its ``ConvertConfig``), as far as calibration reads them.

    Returns ``(ranges, info)``: ranges for the modules that got one (others are listed in
    ``info["missing"]``; convert falls back for them), and JSON facts for the manifest
    (method, samples, tokens, data file, missing, notes).
    """
    if cfg.calib_amax is not None:
        from fp8export.calibration.amax_file import read_amax_file

        ranges = read_amax_file(cfg.calib_amax)
        got = {m: r for m, r in ranges.items() if m in set(modules)}
        missing = [m for m in modules if m not in got]
        first = next(iter(got.values()), None)
        d = first.details if first is not None else {}
        return got, {"source": str(cfg.calib_amax), "method": d.get("method"),
                     "samples": d.get("samples"), "tokens": d.get("tokens"),
                     "missing": missing}
    if cfg.calib_data is None:
        raise Fp8ExportError("calibration needs --calib-data PATH or --calib-amax amax.json.")
    ccfg = CalibrateConfig(
        checkpoint=cfg.checkpoint, calib_data=cfg.calib_data, output=None,
        calib_method=cfg.calib_method, percentile=cfg.percentile,
        calib_samples=cfg.calib_samples or DEFAULT_CALIB_SAMPLES,
        batch_size=cfg.batch_size or DEFAULT_BATCH_SIZE, seq_len=cfg.seq_len, device=cfg.device,
        modules=tuple(modules), fuse_scales=cfg.fuse_scales, max_memory=cfg.max_memory,
        offload=cfg.offload, spill_dir=cfg.resolved_output.parent)
    res = _calibrate(ccfg, groups)
    return res.ranges(), {"source": str(cfg.calib_data), "method": res.method,
                          "options": res.options, "samples": res.samples, "tokens": res.tokens,
                          "missing": res.missing, "notes": res.notes, "device": res.device,
                          "seconds": res.seconds}
