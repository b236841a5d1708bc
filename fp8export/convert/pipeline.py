"""``convert``: checkpoint → FP8 folder (DESIGN.md "Output formats", docs/fp8-folder.md).

Steps, each a function below: :func:`select_step` picks the linear weights
(``scales/select.py``) and drops the layers an accuracy budget says to keep
(``--accuracy-budget``); :func:`scan_step` reads every selected weight once for its amax (NaN/Inf
offenders collected, all-zero weights kept in high precision, fused groups share the max);
:func:`weight_scale_step` and :func:`activation_step` decide the scales (``scales/``,
``activation.py``); :func:`config_step` builds the dialect's config (``fp8dir/formats.py``);
the shards are planned; :func:`write_step` writes them one tensor at a time into a hidden
temporary sibling with config, tokenizer files and the manifest, reads everything back
(``fp8dir/readback.py``) and only then renames it into place.

Where the work runs (bench/convert.py measures it): the main thread reads each source tensor
(positional reads, no mmap) and quantizes it, computing its SQNR from the FP8 values it
produces; a writer thread hands the bytes to the file and records their sha256; a read-back
thread re-reads each shard once it is fsynced and compares digests (content identity, see
``readback.py``); a hashing thread computes the source files' sha256 for the manifest. So the
source is read twice (amax scan, quantization) plus once by the hasher, the output once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fp8export import __version__
from fp8export._progress import progress
from fp8export._timings import Timings
from fp8export.checkpoint.loader_files import MODULES_JSON, SENTENCE_TRANSFORMERS_NOTE
from fp8export.checkpoint.source import Checkpoint, open_checkpoint
from fp8export.config import OutputFormat, ReadBack
from fp8export.convert.activation import resolve_activation_ranges
from fp8export.convert.checks import (
    check_inputs,
    check_scale_range,
    check_structure,
    check_written,
)
from fp8export.convert.config import (
    ConvertConfig,
    DynamicActivations,
    KvCache,
    ScaleFormat,
    WeightGranularity,
    WeightRounding,
)
from fp8export.convert.result import ConvertResult
from fp8export.convert.schemes import scheme_entry
from fp8export.convert.source_scan import (
    EarlyScan,
    default_workers,
    fast_path_files,
    scan_sources,
    source_sha256,
)
from fp8export.errors import Fp8ExportError, VerificationFailed
from fp8export.fp8dir.formats import (
    activation_scheme,
    as_loaded,
    extra_files,
    format_notes,
    kv_scale_names,
    loaded_scale_dtype,
    quantization_config,
    scale_shape,
    weight_scale_name,
)
from fp8export.fp8dir.manifest import (
    MANIFEST_NAME,
    build_manifest,
    files_entry,
    kv_cache_line,
    layer_entries,
    options_entry,
    portable_notes,
    source_files_entry,
    write_json,
)
from fp8export.fp8dir.parallel_write import write_shards_parallel
from fp8export.fp8dir.readback import (
    check_json_files,
    verify_output,
    verify_parallel_output,
    verify_shard,
)
from fp8export.fp8dir.write import (
    ShardPlan,
    copy_loader_files,
    plan_shards,
    write_configs,
    write_shards,
)
from fp8export.io.atomic import AtomicDir
from fp8export.io.descriptors import reserve
from fp8export.io.hashing import file_sha256
from fp8export.keras_model.config import is_keras_config
from fp8export.notes import Note, NoteKind
from fp8export.numerics.fp8 import amax_to_scale
from fp8export.scales.groups import share_max
from fp8export.scales.history import weight_scales_from_history
from fp8export.scales.ranges import ActivationRange
from fp8export.scales.select import Selection, select_targets
from fp8export.scales.weights import WeightScan, scan_weights, weight_scan

_MAX_LISTED = 12


def _listed(items: list[str]) -> str:
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def _apply_budget(cfg: ConvertConfig, ckpt: Checkpoint, sel: Selection, weight_scales: dict,
                  input_scales: dict, split, kv_entry: dict[str, Any] | None
                  ) -> tuple[Selection, Any, dict[str, Any], list[str]]:
    """Keep in high precision the fewest layers that bring the measured KL within the budget.

    The search (``fp8export.analysis.fallback``) gets every layer as it will be written: the same
    E4M3 bytes, weight scales (group max, per channel or per block), input scales and KV-cache
    scales; it measures on samples of ``split`` that no calibration step read.
    """
    import numpy as np

    # The search runs the model (torch, transformers): imported only when asked.
    from fp8export.analysis.fallback import FallbackLayer, start
    from fp8export.numerics.block import quantize_blocks_sqnr
    from fp8export.numerics.channel import quantize_channels_sqnr
    from fp8export.scales.weights import quantize_weight_sqnr

    block = _block(cfg)
    layers = []
    for t in sel.targets:
        w, scale = ckpt.load(t.weight), weight_scales[t.module]
        if block is not None:
            q, _ = quantize_blocks_sqnr(w, scale, block)
        elif np.ndim(scale):
            q, _ = quantize_channels_sqnr(w, scale, t.layout)
        else:
            q, _ = quantize_weight_sqnr(w, scale)
        del w
        layers.append(FallbackLayer(t.module, q.t().contiguous() if t.layout == "in_out" else q,
                                    scale, input_scales.get(t.module), t.fused_group, block))
    kv_scales = None if kv_entry is None else {
        attn: (e["k_scale"], e["v_scale"]) for attn, e in kv_entry["layers"].items()}
    search = start(cfg, ckpt.path, layers, split=split, kv_scales=kv_scales)
    del layers
    result = search.search(float(cfg.accuracy_budget))
    result["split"] = split.to_dict()
    keep = set(result["keep"])
    # vLLM refuses a partly quantized fused layer: the search keeps fused groups whole.
    for members in sel.groups.values():
        if keep & set(members):
            keep |= set(members)
    notes = [f"--accuracy-budget {cfg.accuracy_budget}: KL {result['kl_all_fp8']:.3e} with every "
             f"layer in FP8; {len(keep)} layer(s) ({100 * result['kept_param_fraction']:.1f}% of "
             f"the linear parameters) kept in high precision give KL "
             f"{result['kl_selected']:.3e} on {result['samples']} samples of {result['data']} "
             f"that no calibration step read"
             + (f": {_listed(sorted(keep))}" if keep else "")]
    return sel.without(keep, f"kept in high precision for --accuracy-budget "
                             f"{cfg.accuracy_budget}"), search, result, notes


def _calibration_wanted(cfg: ConvertConfig) -> int:
    """How many samples of ``--calib-data`` the calibration steps read (at most): what an
    accuracy budget's own samples must come after."""
    from fp8export.calibration.config import DEFAULT_CALIB_SAMPLES
    from fp8export.convert.config import ScalesMode
    from fp8export.convert.rounding import DEFAULT_SAMPLES as ROUNDING_SAMPLES

    if cfg.calib_data is None:
        return 0
    wants = []
    if cfg.weight_rounding is WeightRounding.GPTQ:
        wants.append(ROUNDING_SAMPLES)
    if cfg.kv_cache is KvCache.FP8 or (
            cfg.scales in (ScalesMode.AUTO, ScalesMode.CALIBRATE) and cfg.calib_amax is None
            and _block(cfg) is None):
        wants.append(DEFAULT_CALIB_SAMPLES)
    if not wants:
        return 0
    return cfg.calib_samples or max(wants)


def _budget_split(cfg: ConvertConfig, ckpt: Checkpoint, notes: list[str]
                  ) -> tuple[ConvertConfig, Any]:
    """An accuracy budget's split of the data and the config the calibration steps read (at
    most the calibration split's samples)."""
    from fp8export.analysis.fallback import plan_split

    wanted = _calibration_wanted(cfg)
    split = plan_split(cfg, ckpt.path, ckpt.config, wanted)
    where = cfg.calib_data.name if cfg.calib_data is not None else "the built-in set"
    notes.append(f"--accuracy-budget: samples {split.calibration}-"
                 f"{split.calibration + split.search - 1} of {where} search and the next "
                 f"{split.check} check the written folder; no calibration step reads them"
                 + (f" (calibration reads the first {split.calibration})"
                    if split.calibration else ""))
    if split.calibration and split.calibration < wanted:
        return replace(cfg, calib_samples=split.calibration), split
    return cfg, split


def _kv_cache_scales(cfg: ConvertConfig, ckpt: Checkpoint
                     ) -> tuple[dict[str, Any], dict[str, list[str]], dict[str, Any] | None]:
    """``--kv-cache fp8``: (scale tensor -> value, source tensor -> the KV scales written right
    after it, the manifest entry), or empty and None when the KV cache stays in 16 bits."""
    if cfg.kv_cache is not KvCache.FP8:
        return {}, {}, None
    from fp8export.calibration.kv_cache import kv_cache_ranges

    amax, facts = kv_cache_ranges(cfg, ckpt.path)
    names = {t.name for t in ckpt.tensors()}
    scales: dict[str, Any] = {}
    after: dict[str, list[str]] = {}
    layers: dict[str, Any] = {}
    for attn, (k_amax, v_amax) in sorted(amax.items()):
        k_name, v_name = kv_scale_names(cfg.format, attn)
        anchor = f"{attn}.v_proj.weight"
        if anchor not in names:
            raise Fp8ExportError(f"{cfg.checkpoint}: --kv-cache fp8 found attention {attn} but "
                                 f"no tensor {anchor} to place its scales beside.")
        scales[k_name] = amax_to_scale(k_amax, f"{attn} keys")
        scales[v_name] = amax_to_scale(v_amax, f"{attn} values")
        after[anchor] = [k_name, v_name]
        layers[attn] = {"k_amax": k_amax, "v_amax": v_amax, "k_scale": float(scales[k_name]),
                        "v_scale": float(scales[v_name]), "k_scale_tensor": k_name,
                        "v_scale_tensor": v_name}
    return scales, after, {"dtype": "float8_e4m3fn", "granularity": "tensor", **facts,
                           "layers": layers}


def _per_channel(cfg: ConvertConfig) -> bool:
    return cfg.weight_granularity is WeightGranularity.CHANNEL


def _block(cfg: ConvertConfig) -> tuple[int, int] | None:
    """``(bn, bk)`` of ``--weight-granularity block``, else None."""
    return cfg.block_size if cfg.weight_granularity is WeightGranularity.BLOCK else None


def _block_notes(cfg: ConvertConfig, sel: Selection) -> list[str]:
    """Block granularity: refuse weights stored ``[in, out]``; name the layers with partial
    edge blocks (transformers refuses them) and the fused members vLLM cannot merge (it needs
    every member's rows to be a multiple of the block's)."""
    block = _block(cfg)
    if block is None:
        return []
    in_out = [t.module for t in sel.targets if t.layout == "in_out"]
    if in_out:
        raise Fp8ExportError(
            f"--weight-granularity block scales [out, in] tiles, but {len(in_out)} weight(s) are "
            f"stored [in, out] (GPT-2 Conv1D): {_listed(in_out)}. No engine loads block scales "
            "for that layout; use --weight-granularity channel or tensor, or --exclude them.")
    notes = []
    edges = sorted(t.module for t in sel.targets
                   if t.shape[0] % block[0] or t.shape[1] % block[1])
    if edges:
        notes.append(
            f"{len(edges)} layer(s) have a dimension that is not a multiple of the {block[0]}x"
            f"{block[1]} block: their edge blocks are partial (scale grid ceil(out/bn) x "
            "ceil(in/bk), each block's scale from its own elements, as vLLM and SGLang run "
            "them); transformers refuses such weights (its FineGrainedFP8 CPU path and "
            f"compressed-tensors' group activations need exact multiples): {_listed(edges)}")
    ragged = sorted(t.module for t in sel.targets
                    if t.fused_group and t.shape[0] % block[0])
    if ragged:
        notes.append(
            f"vLLM merges fused projections (q/k/v, gate/up) into one layer and refuses block "
            f"scales whose {block[0]} rows do not divide every member's output rows "
            f"(validate_fp8_block_shape): {_listed(ragged)}; for vLLM pick a --block-size "
            "that divides them")
    return notes


def _history_weight_scales(cfg: ConvertConfig, ckpt: Checkpoint, sel: Selection,
                           weight_scales: dict, weight_source: dict) -> list[str]:
    """Replace weight scales by history-derived ones where a weight history exists (on request).

    Fused groups keep one scale: the max over the group of the scales in use. A history scale
    below the final weights' amax/448 clips them; read-back's SQNR check catches a bad one.
    """
    import numpy as np

    state = ckpt.training_state()
    if state is None or not getattr(state, "histories", None):
        raise Fp8ExportError(f"{cfg.checkpoint}: weight scales from history were requested, but "
                             "the checkpoint holds no FP8 training state.")
    scales = weight_scales_from_history(state, sel.modules, amax_algo=cfg.amax_algo,
                                        margin=cfg.margin)
    for m, value in scales.items():
        if m in weight_scales:
            weight_scales[m] = np.float32(value)
            weight_source[m] = "history"
    weight_scales.update(share_max(weight_scales, sel.groups))
    missing = sorted(set(sel.modules) - set(scales))
    notes = [f"weight scales from FP8 training history for {len(scales)} layer(s)"]
    if missing:
        notes.append(f"{len(missing)} layer(s) have no weight history; their weight scales come "
                     f"from the final weights: {_listed(missing)}")
    return notes


def _finish(ticks) -> None:
    for _ in ticks:  # run the progress generator to its end so the bar closes
        pass


def _hash_sources(ckpt: Checkpoint, stop: threading.Event) -> dict[Path, str]:
    return {p: file_sha256(p, stop=stop) for p in ckpt.source_files}


def convert(cfg: ConvertConfig, *, early: EarlyScan | None = None) -> ConvertResult:
    """Convert ``cfg.checkpoint`` to an FP8 folder at ``cfg.resolved_output``.

    ``early``: the source reading :func:`~fp8export.convert.source_scan.start_early_scan`
    started before this module (and torch) was imported; used where it read the very files
    opened here, closed in any case.
    Raises Fp8ExportError (nothing written, an existing output untouched) on bad input.
    """
    try:
        result = _convert(cfg, early)
    finally:
        if early is not None:
            early.close()
    budget = result.accuracy_budget
    if budget is not None and not budget.get("met", True):
        w = budget["written"]
        raise VerificationFailed(
            f"--accuracy-budget {cfg.accuracy_budget:g} missed: the written folder "
            f"{result.output} measures KL {w['kl']:.3e}{_interval(w)} on {w['samples']} "
            f"{w['data']} samples of {budget['data']} (fp8export.json accuracy_budget.met: "
            "false); raise the budget, or give more --accuracy-samples for a sharper search.",
            result)
    return result


def _interval(measured: dict[str, Any]) -> str:
    iv = measured.get("interval")
    return f" [{iv[0]:.3e}, {iv[1]:.3e}]" if iv else ""


@dataclass
class _Run:
    """How this conversion reads and writes. ``files``: the safetensors files behind the
    checkpoint (the parallel path: the weights read once for their amax, then ``workers``
    writer threads whose reads also give each file's sha256) or None (the general reader
    path, one tensor at a time, sha256 in a background thread)."""

    files: dict | None
    early: EarlyScan | None
    workers: int
    timings: Timings
    # source file -> sha256: a dict, or a Future on the general path; None on the parallel
    # path until the writer has hashed the files from its reads (or a check asks earlier)
    hashes: Any = None
    stage: float = field(default_factory=time.perf_counter)

    def lap(self, name: str, nbytes: int = 0) -> None:
        """The wall time since the last lap; ``nbytes``: what the stage went through (its
        MB/s is reported with it)."""
        now = time.perf_counter()
        self.timings.add(f"wall: {name}", now - self.stage, nbytes)
        self.stage = now

    def source_hashes(self, ckpt: Checkpoint, written: dict | None = None) -> dict:
        """The sha256 of every source file: on the parallel path those the writer took from
        its reads (``written``) and the rest read now (all of them when asked before
        writing); on the general path the background job's."""
        if self.hashes is None:
            self.hashes = source_sha256(self.files.values(), ckpt.source_files,
                                        timings=self.timings, done=written)
        elif hasattr(self.hashes, "result"):
            self.hashes = self.hashes.result()
        return self.hashes


def _convert(cfg: ConvertConfig, early: EarlyScan | None) -> ConvertResult:
    from fp8export.distributed import join, world_from_env

    out = cfg.resolved_output
    check_inputs(cfg)  # fail before any heavy work (api.convert ran it before torch loaded)
    if world_from_env()[1] > 1:  # under torchrun the ranks share the model steps; alone, the
        from fp8export.placement import resolve_device  # default path stays free of torch

        join(resolve_device(cfg.device))
    timings = Timings()
    t0 = time.perf_counter()
    with open_checkpoint(cfg.checkpoint) as ckpt:
        # The parallel writer knows per-tensor weight scales of the source's own weights only:
        # per-channel and block scales, KV cache scales and rounded weights take the general
        # path (one tensor at a time).
        simple = cfg.weight_granularity is WeightGranularity.TENSOR \
            and cfg.kv_cache is not KvCache.FP8 and cfg.weight_rounding is WeightRounding.NEAREST
        run = _Run(fast_path_files(ckpt) if simple else None, early,
                   cfg.workers or default_workers(), timings)
        run.lap("open checkpoint")
        if run.files is not None:
            result = _convert_open(cfg, ckpt, out, run)
        else:
            stop = threading.Event()  # ends the background hashing early when convert fails
            with ThreadPoolExecutor(1) as pool:
                # sha256 runs in C without the GIL: it overlaps with the weight scan.
                run.hashes = pool.submit(_hash_sources, ckpt, stop)
                try:
                    result = _convert_open(cfg, ckpt, out, run)
                finally:
                    stop.set()
    timings.add("wall: total", time.perf_counter() - t0)
    return replace(result, timings=timings.as_dict())


@dataclass
class _Scales:
    """What the scale steps decide for the selected layers, before anything is written."""

    sel: Selection
    scan: WeightScan
    weight: dict[str, Any]  # module -> np.float32 weight scale
    weight_source: dict[str, str]  # module -> "weights" | "history"
    ranges: dict[str, ActivationRange]
    input: dict[str, Any]  # module -> np.float32 input scale (static layers only)
    dynamic: list[str]  # quantized layers without a static input scale
    kv: dict[str, Any] = field(default_factory=dict)  # KV-cache scale tensor -> value
    kv_after: dict[str, list[str]] = field(default_factory=dict)  # anchor -> KV scale names
    kv_entry: dict[str, Any] | None = None  # the manifest's kv_cache entry
    search: Any = None  # the accuracy-budget search, to measure the written folder
    budget: dict[str, Any] | None = None  # its result
    block: tuple[int, int] | None = None  # (bn, bk) when the weight scales are block grids
    rounding: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> GPTQ facts
    rounding_entry: dict[str, Any] | None = None  # the manifest's weight_rounding entry


def _convert_open(cfg: ConvertConfig, ckpt: Checkpoint, out: Path, run: _Run) -> ConvertResult:
    notes: list[str] = list(getattr(ckpt, "notes", []))
    sel = select_step(cfg, ckpt, notes)
    run.lap("select")
    sel, scan = scan_step(cfg, ckpt, sel, notes, run)
    run.lap("scan (amax)", sum(p.stat().st_size for p in ckpt.source_files))
    weight_scales, weight_source = weight_scale_step(cfg, ckpt, sel, scan, notes)
    check_scale_range("weight", weight_scales)
    if cfg.calib_amax is not None:  # ranges measured on other weights would mis-scale these
        from fp8export.calibration.amax_file import check_amax_checkpoint

        check_amax_checkpoint(cfg.calib_amax, _relative_hashes(ckpt, run.source_hashes(ckpt)),
                              sel.modules)
    split, calib_cfg = None, cfg
    if cfg.accuracy_budget is not None:  # its samples come after what calibration reads
        calib_cfg, split = _budget_split(cfg, ckpt, notes)
    ranges, input_scales = activation_step(calib_cfg, ckpt, sel, notes)
    check_scale_range("input", input_scales)
    # the scales every engine holds (transformers' compressed-tensors loader: the model dtype),
    # before anything is quantized with them
    held = loaded_scale_dtype(cfg.format, ckpt.config, keras=is_keras_config(ckpt.config))
    weight_scales, input_scales = as_loaded(weight_scales, held), as_loaded(input_scales, held)
    if cfg.scale_format is ScaleFormat.UE8M0:  # powers of two, rounded up
        weight_scales = as_loaded(weight_scales, "F8_E8M0")
    rounding, rounding_entry = {}, None
    if cfg.weight_rounding is not WeightRounding.NEAREST:
        from fp8export.convert.rounding import rounding_step

        # from here on the checkpoint serves the rounded weights: the budget search, the
        # writer and the read-back all see the codes that are written
        ckpt, rounding, rounding_entry = rounding_step(calib_cfg, ckpt, sel, weight_scales,
                                                       notes, input_scales)
        run.lap("weight rounding")
    # before the budget: the search measures the model with its FP8 KV cache
    kv, kv_after, kv_entry = _kv_cache_scales(calib_cfg, ckpt)
    check_scale_range("KV cache", kv)
    search = budget = None
    if cfg.accuracy_budget is not None:
        sel, search, budget, more = _apply_budget(cfg, ckpt, sel, weight_scales, input_scales,
                                                  split, kv_entry)
        notes.extend(more)
        if rounding:  # layers kept in high precision are written from the source
            ckpt = ckpt.only({t.weight for t in sel.targets})
        weight_scales = {m: weight_scales[m] for m in sel.modules}
        input_scales = {m: s for m, s in input_scales.items() if m in weight_scales}
        ranges = {m: r for m, r in ranges.items() if m in weight_scales}
    dynamic = sorted(set(sel.modules) - set(input_scales))
    scales = _Scales(sel, scan, weight_scales, weight_source, ranges, input_scales, dynamic,
                     kv, kv_after, kv_entry, search, budget, _block(cfg),
                     {m: f for m, f in rounding.items() if m in weight_scales}, rounding_entry)
    qconfig = config_step(cfg, ckpt, scales, notes)
    from fp8export.distributed import rank0_writes

    # data parallel: the ranks shared the model steps; rank 0 writes, the others wait for it
    with rank0_writes(f"writing {out}") as writes:
        if writes:
            plans = plan_shards(ckpt, {t.weight: t for t in sel.targets}, weight_scales,
                                input_scales, scale_shape(cfg.format), kv_after=kv_after,
                                weight_scale_name=weight_scale_name(cfg.format,
                                                                    _block(cfg) is not None),
                                weight_scale_dtype="F8_E8M0"
                                if cfg.scale_format is ScaleFormat.UE8M0 else "F32")
            run.lap("scales + plan")
            return write_step(cfg, ckpt, out, run, scales, qconfig, plans, notes)
    return ConvertResult(output=str(out), format=str(cfg.format),
                         activation_scheme=activation_scheme(sorted(input_scales), dynamic),
                         quantized=len(sel.modules), excluded=dict(sorted(sel.excluded.items())),
                         dynamic_layers=dynamic, layers=[], notes=notes)


def select_step(cfg: ConvertConfig, ckpt: Checkpoint, notes: list[str]) -> Selection:
    """The linear weights that become FP8 (an accuracy budget may keep some back later)."""
    check_structure(ckpt)
    sel = select_targets(ckpt.tensors(), ckpt.config, include=cfg.include, exclude=cfg.exclude,
                         fuse_scales=cfg.fuse_scales)
    notes.extend(sel.notes)
    notes.extend(_block_notes(cfg, sel))
    if not sel.targets:
        raise Fp8ExportError(
            f"{cfg.checkpoint}: no linear weights to quantize (family "
            f"{sel.family or 'unknown'}; {len(sel.excluded)} tensors all excluded). Check "
            "--exclude, or name the layers with --include GLOB.")
    return sel


def scan_step(cfg: ConvertConfig, ckpt: Checkpoint, sel: Selection, notes: list[str],
              run: _Run) -> tuple[Selection, WeightScan]:
    """Every selected weight read once for its amax; NaN/Inf refused, all-zero ones kept."""
    if run.files is not None:
        ticks = iter(progress(range(len(run.files)), total=len(run.files),
                              desc="scanning weights", unit="file"))
        source = scan_sources(run.files, [t.weight for t in sel.targets],
                              workers=run.workers, timings=run.timings, early=run.early,
                              on_file=lambda: next(ticks, None))
        scan = weight_scan(sel.targets, source.amax, sel.groups)
    else:
        ticks = iter(progress(range(len(sel.targets)), total=len(sel.targets),
                              desc="scanning weights", unit="tensor"))
        # scan_weights drops each weight before loading the next: a reused buffer is safe.
        scan = scan_weights(sel.targets, getattr(ckpt, "load_scratch", ckpt.load), sel.groups,
                            on_step=lambda: next(ticks, None), per_channel=_per_channel(cfg),
                            block=_block(cfg))
    _finish(ticks)
    if scan.nonfinite:
        raise Fp8ExportError(
            f"{len(scan.nonfinite)} weight(s) hold NaN or Inf, which FP8 cannot represent: "
            f"{_listed(scan.nonfinite)}. Fix the checkpoint (a diverged run?) or keep those "
            "modules in high precision with --exclude GLOB.")
    if scan.all_zero:
        sel = sel.without(scan.all_zero, "all-zero weight (amax 0)")
        notes.append(f"{len(scan.all_zero)} all-zero weight(s) kept in high precision: "
                     f"{_listed(sorted(scan.all_zero))}")
    return sel, scan


def weight_scale_step(cfg: ConvertConfig, ckpt: Checkpoint, sel: Selection, scan: WeightScan,
                      notes: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Weight scales from the scan, or from the training history on request."""
    weight_scales = {m: scan.scale[m] for m in sel.modules}
    weight_source = dict.fromkeys(sel.modules, "weights")
    if cfg.weight_scales_from_history:
        notes.extend(_history_weight_scales(cfg, ckpt, sel, weight_scales, weight_source))
    return weight_scales, weight_source


def activation_step(cfg: ConvertConfig, ckpt: Checkpoint, sel: Selection, notes: list[str]
                    ) -> tuple[dict[str, ActivationRange], dict[str, Any]]:
    """Static input ranges (history, calibration or none) and the input scales they give."""
    if _block(cfg) is not None:
        if cfg.calib_data is not None and cfg.kv_cache is not KvCache.FP8:
            notes.append("--calib-data is not used: block-scaled layers quantize their inputs "
                         "dynamically per token group")
        notes.append(Note(f"activations: dynamic per token group of {cfg.block_size[1]} (what "
                          "vLLM, SGLang and transformers run for block-scaled FP8)",
                          NoteKind.ACTIVATIONS))
        return {}, {}
    ranges, more = resolve_activation_ranges(cfg, ckpt, sel.modules,
                                             groups=sel.groups if cfg.fuse_scales else None)
    notes.extend(more)
    return ranges, {m: amax_to_scale(r.amax, f"{m} (input)") for m, r in ranges.items()}


def _static_scales_advice(cfg: ConvertConfig) -> str:
    """How to get static input scales (what TensorRT needs), given what this run was given: a
    block folder cannot hold them, and data already given only needs --scales calibrate."""
    if _block(cfg) is not None:
        return ("block-scaled layers always quantize their inputs dynamically, so for TensorRT "
                "convert with --weight-granularity tensor --scales calibrate --calib-data FILE")
    if cfg.calib_data is not None:
        return ("for TensorRT convert with --scales calibrate, which makes static input scales "
                f"from the --calib-data given here ({cfg.calib_data.name})")
    return "for TensorRT convert with --calib-data FILE"


def config_step(cfg: ConvertConfig, ckpt: Checkpoint, scales: _Scales, notes: list[str]
                ) -> dict[str, Any]:
    """The output dialect's ``quantization_config`` and the notes on who can load the folder."""
    static, dynamic = sorted(scales.input), scales.dynamic
    if activation_scheme(static, dynamic) == "mixed":
        notes.append(f"{len(dynamic)} layer(s) have no activation range and run with dynamic "
                     f"activations (second config group): {_listed(dynamic)}")
    # beside each checkpoint name, the one transformers' loader matches where it renames
    also = _loader_names(ckpt, [*static, *dynamic, *scales.sel.ignore])
    qconfig = quantization_config(cfg.format, static=_with(static, also),
                                  dynamic=_with(dynamic, also),
                                  ignore=_with(scales.sel.ignore, also), tool_version=__version__,
                                  per_channel=_per_channel(cfg),
                                  kv_cache=scales.kv_entry is not None, block=_block(cfg),
                                  dynamic_strategy=str(cfg.dynamic_activations),
                                  scale_fmt=str(cfg.scale_format))
    if dynamic:
        which = "this folder has no static input scales" if not static else \
            f"{len(dynamic)} layer(s) have no static input scale"
        notes.append(f"{which}: vLLM quantizes activations at run time, but TensorRT needs static "
                     "input scales for FP8 GEMMs, so export-onnx gives those GEMMs 16-bit "
                     f"(weight-only FP8); {_static_scales_advice(cfg)}")
    if dynamic and cfg.dynamic_activations is DynamicActivations.TENSOR \
            and cfg.format is not OutputFormat.MODELOPT:
        notes.append("dynamic activations are declared and verified per tensor, but vLLM "
                     "quantizes dynamic inputs per token (compressed-tensors always, its fp8 "
                     "dialect on GPUs with CUTLASS FP8); the default --dynamic-activations "
                     "token verifies what it runs")
    # first: it decides who can load the folder
    notes[:0] = format_notes(cfg.format, block=_block(cfg) is not None,
                             keras=is_keras_config(ckpt.config))
    if any(p.name == MODULES_JSON and p.parent == ckpt.path for p in ckpt.aux_files):
        notes.append(SENTENCE_TRANSFORMERS_NOTE)
    if ckpt.config and "quantization_config" in ckpt.config:
        notes.append("the source config.json had a quantization_config; it was replaced")
    return qconfig


def _loader_names(ckpt: Checkpoint, modules: list[str]) -> dict[str, str]:
    if not ckpt.config or not ckpt.path.is_dir():
        return {}
    if not any(k in ckpt.config for k in ("text_config", "vision_config", "audio_config")):
        return {}  # only composite models are renamed; the default path stays free of torch
    from fp8export.models import loader_linear_names

    return loader_linear_names(ckpt.config, ckpt.path, modules)


def _with(names: list[str], also: dict[str, str]) -> list[str]:
    return list(dict.fromkeys([*names, *(also[n] for n in names if n in also)]))


def write_step(cfg: ConvertConfig, ckpt: Checkpoint, out: Path, run: _Run, scales: _Scales,
               qconfig: dict[str, Any], plans: list[ShardPlan], notes: list[str]
               ) -> ConvertResult:
    """Shards, configs, loader files and manifest into a temporary sibling, read back, then
    renamed into place; an OSError leaves nothing behind."""
    n_out = sum(len(p.entries) for p in plans)
    # the source files stay open, and each output shard is written through two descriptors
    reserve(len(ckpt.source_files) + 2 * len(plans),
            f"{cfg.checkpoint}: writing {len(plans)} output shards from {len(ckpt.source_files)} "
            "weight files")
    ticks = iter(progress(range(n_out), total=n_out, desc="writing", unit="tensor"))
    atomic = AtomicDir(out, cfg.force, marker=MANIFEST_NAME)
    try:
        with atomic as tmp:
            if run.files is not None:
                where = {i.name: st for st in run.files.values() for i in st.tensors}
                # hashes a check took before writing (--calib-amax) are not taken again
                record = write_shards_parallel(tmp, plans, where, scales.weight, scales.input,
                                               workers=run.workers, timings=run.timings,
                                               on_tensor=lambda: next(ticks, None),
                                               hash_sources=run.hashes is None)
            else:
                record, early = _write_shards(tmp, plans, ckpt, scales, ticks)
            _finish(ticks)
            shard_bytes = sum((tmp / p.file_name).stat().st_size for p in plans)
            run.lap("write shards", shard_bytes)
            if ckpt.config is None:
                notes.append("the source has no config.json; the quantization config is "
                             "recorded in fp8export.json only")
            written, ours = write_configs(
                tmp, plans, ckpt.config, qconfig,
                extra_files(cfg.format, ignore=scales.sel.ignore, tool_version=__version__,
                            kv_cache=scales.kv_entry is not None))
            engines = _loaders(ckpt, qconfig, plans)
            copy_loader_files(tmp, ckpt, written)
            run.lap("config, index, loader files")
            # Read-back first: the manifest records the SQNR of the weights as they are on disk
            # (computed while quantizing; read-back proves the bytes on disk are those bytes).
            if run.files is not None:
                sqnr = verify_parallel_output(tmp, plans, where, scales.weight, scales.input,
                                              record, workers=run.workers,
                                              policy=cfg.read_back or ReadBack.SAMPLED)
            else:
                sqnr = verify_output(tmp, plans, ckpt, scales.weight, scales.input,
                                     record=record, early=early, kv_scales=scales.kv,
                                     block=scales.block)
            run.lap("read-back", shard_bytes)
            layers = layer_entries(scales.sel.targets, scales.scan.amax, scales.weight,
                                   scales.weight_source, scales.ranges, scales.input, sqnr,
                                   plans, scales.rounding)
            hashes = run.source_hashes(ckpt, record.sources if run.files is not None else None)
            manifest = _manifest(cfg, ckpt, out, hashes, scales, qconfig, engines, layers, notes)
            manifest["files"] = files_entry(tmp, run.workers, record.files)
            write_json(tmp / MANIFEST_NAME, manifest)
            budget = scales.budget
            if scales.search is not None:  # the written folder, measured through the FP8 runtime
                measured = scales.search.check_written(tmp, budget.get("kl_selected"),
                                                       budget=float(cfg.accuracy_budget))
                budget = {**budget, "data": Path(str(budget["data"])).name,
                          "met": measured["met"], "written": measured,
                          "seconds": scales.search.cost()}
                manifest["accuracy_budget"] = budget
                write_json(tmp / MANIFEST_NAME, manifest)
                gap = (f" ({100 * measured['gap']:+.0f}% against the search's "
                       f"{budget['kl_selected']:.3e})" if "gap" in measured else "")
                notes.append(f"--accuracy-budget: the written folder measures KL "
                             f"{measured['kl']:.3e}{_interval(measured)}{gap}, top-1 "
                             f"{measured['top1_agreement']:.4f} on {measured['samples']} "
                             f"{measured['data']} samples: budget "
                             f"{'met' if measured['met'] else 'NOT met'}; search cost "
                             f"{budget['seconds']['total']:.0f} s")
            check_json_files(tmp, ours)
            check_written(tmp, out)  # what its readers would refuse is never published
            files = sorted(p.name for p in tmp.iterdir())
            bytes_out = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
            atomic.publish()  # nothing above touched `out`; this is the only step that does
            run.lap("manifest + publish")
    except OSError as exc:  # ENOSPC, EDQUOT, EIO...: the temporary folder is already gone
        where = f" ({Path(exc.filename).name})" if exc.filename else ""
        raise Fp8ExportError(
            f"{out}: writing the output failed: {exc.strerror or exc}{where}. Nothing was "
            "written and the previous state is unchanged; free disk space or choose another "
            "-o/--output.") from exc
    sel = scales.sel
    return ConvertResult(
        output=str(out), format=str(cfg.format),
        activation_scheme=activation_scheme(sorted(scales.input), scales.dynamic),
        quantized=len(layers), excluded=dict(sorted(sel.excluded.items())),
        dynamic_layers=scales.dynamic, layers=layers, notes=notes, files=files,
        bytes_out=bytes_out, loaded_by=list(engines.ok),
        accuracy_budget=budget, kv_cache=kv_cache_line(scales.kv_entry),
        dynamic_activations=str(cfg.dynamic_activations), scheme=scheme_entry(cfg))


def _write_shards(tmp: Path, plans: list[ShardPlan], ckpt: Checkpoint, scales: _Scales, ticks
                  ) -> tuple[Any, dict[str, Any]]:
    # Each shard is read back in a thread as soon as it is fsynced, while the next one is
    # written; verify_output collects the results.
    early: dict[str, Any] = {}
    with ThreadPoolExecutor(1, "fp8export-verify") as verify_pool:
        record = write_shards(
            tmp, plans, ckpt, scales.weight, scales.input, kv_scales=scales.kv,
            on_tensor=lambda: next(ticks, None), block=scales.block,
            on_file=lambda plan, rec: early.__setitem__(plan.file_name, verify_pool.submit(
                verify_shard, tmp, plan, ckpt, scales.weight, scales.input, record=rec,
                kv_scales=scales.kv, block=scales.block)))
        for fut in early.values():
            fut.exception()  # wait, inside the pool's lifetime
    return record, early


def _relative_hashes(ckpt: Checkpoint, hashes) -> dict[str, str]:
    """``{name relative to the checkpoint: sha256}`` of its weight files (as amax.json keys)."""
    return {e["name"]: e["sha256"] for e in source_files_entry(ckpt.path, ckpt.source_files,
                                                               hashes)}


def _loaders(ckpt: Checkpoint, qconfig: dict[str, Any], plans: list[ShardPlan]):
    """Which engines load the folder being written (fp8dir.engines: the folder as they read
    it, so partial blocks, lm_head or expert input scales are said, not promised away)."""
    from fp8export.fp8dir.engines import planned_loaders

    tensors = {e.tensor.name: (e.tensor.dtype, tuple(e.tensor.shape))
               for p in plans for e in p.entries}
    layouts = {e.tensor.name.removesuffix(".weight"): e.layout
               for p in plans for e in p.entries if e.kind == "weight"}
    return planned_loaders(ckpt.config, qconfig, tensors, layouts,
                           keras=is_keras_config(ckpt.config))


def _manifest(cfg: ConvertConfig, ckpt: Checkpoint, out: Path, hashes, scales: _Scales,
              qconfig: dict[str, Any], engines, layers: list[dict[str, Any]], notes: list[str]
              ) -> dict[str, Any]:
    sel = scales.sel
    return build_manifest(
        source={"name": cfg.checkpoint.name, "kind": ckpt.kind, "family": sel.family,
                "files": source_files_entry(ckpt.path, ckpt.source_files, hashes)},
        options=options_entry(cfg.to_dict()), output_format=str(cfg.format),
        loaded_by=list(engines.ok),
        activation_scheme=activation_scheme(sorted(scales.input), scales.dynamic),
        weight_granularity=str(cfg.weight_granularity),
        dynamic_activations=str(cfg.dynamic_activations), block_size=_block(cfg),
        dynamic_layers=scales.dynamic, quantization_config=qconfig, layers=layers,
        excluded=sel.excluded,
        notes=portable_notes(notes, [p for p in (cfg.checkpoint, cfg.calib_data,
                                                 cfg.calib_amax, out) if p is not None]),
        scheme=scheme_entry(cfg), kv_cache=scales.kv_entry,
        weight_rounding=scales.rounding_entry)
