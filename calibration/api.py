"""Run sample data through the bf16 model and turn observed linear inputs into amaxes.

Public:
    :func:`calibrate` (``fp8export calibrate``; ``fp8export.api.calibrate``),
    :func:`calibrate_ranges` (``convert --scales calibrate`` / ``--calib-amax``),
    :func:`observe` + :func:`amaxes_from_stats` (one pass, any calibrator: benchmarks and the
    calibrator comparison use them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export._progress import STAGE_PREFIX, info, progress_enabled, stage
from fp8export.calibration.config import DEFAULT_BATCH_SIZE, DEFAULT_CALIB_SAMPLES, CalibrateConfig
from fp8export.config import Device, ScaleSource
from fp8export.errors import Fp8ExportError
from fp8export.scales.ranges import ActivationRange

if TYPE_CHECKING:

    from fp8export.calibration.calibrators import AmaxResult
    from fp8export.calibration.observers import FinalStats
    from fp8export.config import ConvertConfig
    from fp8export.inputs.samples import Batch, Samples


# Name patterns of projections that read the same input (used when the checkpoint's family
# table does not say): siblings under one parent share one input scale.
_FUSED_LEAVES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
                 ("query", "key", "value"), ("q", "k", "v"), ("wi_0", "wi_1"))


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
    notes: list[str] = field(default_factory=list)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)
    dtype: str = "bfloat16"
    source_files: dict[str, str] = field(default_factory=dict)  # weight file -> sha256

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
            out[m] = ActivationRange(module=m, amax=float(a), source=ScaleSource.CALIBRATION,
                                     details=d)
        return out


@dataclass
class Observation:
    """Statistics of one pass (:func:`observe`)."""

    stats: dict[str, FinalStats]
    samples: int
    tokens: int
    batches: int
    seconds: float
    missing: list[str]
    notes: list[str]


# --------------------------------------------------------------------------------------------
# devices and models


def resolve_device(device: Device | str) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; ``cuda`` without a GPU is an error."""
    import torch

    d = Device.parse(device, "--device")
    if d is Device.AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d is Device.CUDA and not torch.cuda.is_available():
        raise Fp8ExportError("--device cuda: no CUDA GPU is visible to PyTorch (torch "
                             f"{torch.__version__}). Use --device cpu or auto.")
    return d.value


def _weight_bytes_bf16(path: Path) -> int:
    from fp8export.checkpoint.source import open_checkpoint

    with open_checkpoint(path) as ckpt:
        return sum(t.numel for t in ckpt.tensors()) * 2


def load_calibration_model(path: Path, device: str, max_memory: dict | None = None):
    """The bf16 model on ``device``, or spread over several devices (``fp8export.placement``:
    ``max_memory`` given, or a model larger than one GPU with several visible).

    Returns ``(model, config_dict, input_device, notes, placement)``; ``placement`` is None on
    one device, else the caller closes it when done.
    """
    import torch

    from fp8export import placement
    from fp8export.models import load_model, load_model_spread

    spread = placement.budgets(device, _weight_bytes_bf16(path) if device == "cuda" else 0,
                               max_memory)
    if spread is not None:
        model, config, where = load_model_spread(path, spread, dtype=torch.bfloat16)
        return model, config, torch.device(where.main_device), [where.note()], where
    model, config = load_model(path, dtype=torch.bfloat16, device=device)
    return model, config, torch.device(device), [], None


def max_positions(config: dict[str, Any]) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = config.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return None


def vocab_size(config: dict[str, Any]) -> int | None:
    """The embedding rows of the model (token ids must stay below), None if not said."""
    for cfg in (config, config.get("text_config") or {}):
        v = cfg.get("vocab_size") if isinstance(cfg, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def forward_fn(model, modules: Sequence[str]) -> Callable[[Batch, Any], Any]:
    """The cheapest forward that still reaches every observed module.

    Calibrated linears live in the transformer body; when none is in a head, only the body
    (``model.base_model``) runs, skipping e.g. the vocab-sized ``lm_head`` GEMM.
    """
    import torch

    prefix = getattr(model, "base_model_prefix", "")
    body = getattr(model, "base_model", model)
    run = model
    if prefix and body is not model and all(m.startswith(prefix + ".") for m in modules):
        run = body
    cfg = getattr(model, "config", None)
    kwargs = {"use_cache": False} if getattr(cfg, "use_cache", None) is not None else {}
    if getattr(cfg, "is_encoder_decoder", False):
        raise Fp8ExportError("encoder-decoder models are not calibrated yet (the decoder needs "
                             "its own inputs); use --calib-amax or weights-only scales.")

    def call(batch: Batch, device):
        ids = batch.input_ids.to(device, non_blocking=True)
        mask = batch.attention_mask.to(device, non_blocking=True)
        with torch.inference_mode():
            return run(input_ids=ids, attention_mask=mask, **kwargs)

    return call


# --------------------------------------------------------------------------------------------
# selection and groups


def default_modules(checkpoint: Path, config: dict | None, *, include=(), exclude=(),
                    fuse_scales: bool = True) -> tuple[list[str], dict[str, list[str]]]:
    """What ``convert`` quantizes (its selection) and its fused groups."""
    from fp8export.checkpoint.source import open_checkpoint
    from fp8export.scales.select import select_targets

    with open_checkpoint(checkpoint) as ckpt:
        sel = select_targets(ckpt.tensors(), ckpt.config, include=include, exclude=exclude,
                             fuse_scales=fuse_scales)
    return sel.modules, {k: list(v) for k, v in sel.groups.items()}


def groups_by_name(modules: Sequence[str], config: dict | None = None) -> dict[str, list[str]]:
    """Fused groups among ``modules`` by the family table, else by sibling leaf names."""
    family = None
    try:
        from fp8export.scales.families import family_of, fused_group_of

        family = family_of(config)
    except ImportError:  # pragma: no cover - the selection module ships with fp8export
        fused_group_of = None
    present = set(modules)
    groups: dict[str, list[str]] = {}
    for m in modules:
        fg = fused_group_of(m, family) if (fused_group_of and family) else None
        if fg is None:
            parent, _, leaf = m.rpartition(".")
            for leaves in _FUSED_LEAVES:
                if leaf in leaves:
                    pre = f"{parent}." if parent else ""
                    fg = (f"{pre}{'_'.join(leaves)}", tuple(pre + x for x in leaves))
                    break
        if fg is None:
            continue
        name, members = fg
        groups.setdefault(name, [x for x in members if x in present])
    return {g: ms for g, ms in groups.items() if len(ms) >= 2}


def share_groups(amax: dict[str, float], groups: dict[str, list[str]]) -> dict[str, float]:
    """Members of a fused group get the group's max (they feed one fused GEMM, DESIGN.md)."""
    out = dict(amax)
    for members in groups.values():
        seen = [amax[m] for m in members if m in amax]
        if seen:
            top = max(seen)
            for m in members:
                if m in amax:
                    out[m] = top
    return out


# --------------------------------------------------------------------------------------------
# the pass


def observe(model, samples: Samples, modules: Sequence[str], *, method: str = "max",
            groups: dict[str, list[str]] | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
            input_device=None, forward: Callable | None = None,
            batches: Iterable[Batch] | None = None, show_progress: bool = True,
            hist_rows: int | None = -1) -> Observation:
    """One pass over ``samples`` with observers on ``modules``; statistics per module.

    ``method`` decides which statistics are kept (a histogram for everything but ``max``).
    The only host syncs are at the end (:meth:`ActivationObserver.finalize`).
    ``hist_rows``: histogram row cap per call (-1: the default, None: every row).
    """
    import torch

    from fp8export.calibration.calibrators import calibrator_class, get_calibrator
    from fp8export.calibration.observers import DEFAULT_HIST_ROWS, ActivationObserver
    from fp8export.inputs.samples import iter_batches

    calibrator_class(method)  # unknown names fail before any work
    if input_device is None:
        input_device = next(model.parameters()).device
    forward = forward or forward_fn(model, modules)
    obs = ActivationObserver(model, modules, lambda: get_calibrator(method),
                             groups=list((groups or {}).values()),
                             hist_rows=DEFAULT_HIST_ROWS if hist_rows == -1 else hist_rows)
    bar = None
    if show_progress and progress_enabled():
        from tqdm import tqdm

        bar = tqdm(total=len(samples), desc=f"calibrate ({method})", unit="sample",
                   leave=False, dynamic_ncols=True)
    elif show_progress:
        info(f"{STAGE_PREFIX}calibrate ({method}): {len(samples)} sample(s)")
    n_samples = n_tokens = n_done = 0
    start = time.perf_counter()
    try:
        with obs:
            for batch in (batches if batches is not None else iter_batches(samples, batch_size)):
                obs.begin_batch(batch.attention_mask)
                forward(batch, input_device)
                obs.end_batch()
                n_samples += len(batch)
                n_tokens += batch.num_tokens
                n_done += 1
                if bar is not None:
                    bar.update(len(batch))
        stats = obs.finalize()  # the one sync
        if input_device is not None and torch.device(input_device).type == "cuda":
            torch.cuda.synchronize()
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    missing = [m for m in modules if m not in stats]
    notes = []
    unmasked = sorted(m for m, c in obs.unmasked_calls.items() if c)
    if unmasked:
        notes.append(f"{len(unmasked)} modules received inputs whose shape does not match the "
                     f"attention mask, so padding could not be excluded there: {unmasked[:5]}")
    return Observation(stats=stats, samples=n_samples, tokens=n_tokens, batches=n_done,
                       seconds=seconds, missing=missing, notes=notes)


def amaxes_from_stats(stats: dict[str, FinalStats], method: str,
                      **options: Any) -> dict[str, AmaxResult]:
    """Run one calibrator's ``amax_from`` on each module's statistics (sorted by name)."""
    from fp8export.calibration.calibrators import get_calibrator

    cal = get_calibrator(method, **options)
    out = {}
    done: dict[int, AmaxResult] = {}  # fused members observed once share one stats object
    for m in sorted(stats):
        key = id(stats[m])
        if key not in done:
            try:
                done[key] = cal.amax_from(stats[m])
            except Fp8ExportError as exc:
                raise Fp8ExportError(f"{m}: {exc}") from exc
        out[m] = done[key]
    return out


# --------------------------------------------------------------------------------------------
# verbs


def calibrate(cfg: CalibrateConfig) -> CalibrationResult:
    """Calibrate ``cfg.checkpoint`` on ``cfg.calib_data``; write ``amax.json`` if ``cfg.output``.

    Raises Fp8ExportError for bad input, when no module received any input, or when the
    output exists and ``force`` is not set (checked before any work).
    """
    return _calibrate(cfg, None)


def _calibrate(cfg: CalibrateConfig, known_groups: dict[str, list[str]] | None
               ) -> CalibrationResult:
    from fp8export.calibration.amax_file import check_output
    from fp8export.calibration.calibrators import calibrator_class, get_calibrator
    from fp8export.placement import parse_max_memory

    if cfg.output is not None:
        check_output(cfg.output, cfg.force, cfg.checkpoint)
    method = str(cfg.calib_method)
    calibrator_class(method)
    get_calibrator(method, **cfg.method_options())  # validate options before loading
    device = resolve_device(cfg.device)
    with stage(f"loading the bf16 model {cfg.checkpoint} ({device})"):
        model, config, input_device, notes, spread = load_calibration_model(
            cfg.checkpoint, device, parse_max_memory(cfg.max_memory))
    if spread is not None:
        device = ",".join(spread.devices)
    try:
        return _calibrate_loaded(cfg, known_groups, model, config, input_device, notes, device,
                                 method)
    finally:
        if spread is not None:
            spread.close()


def _calibrate_loaded(cfg: CalibrateConfig, known_groups, model, config, input_device, notes,
                      device: str, method: str) -> CalibrationResult:
    from fp8export.calibration.amax_file import source_hashes, write_amax_file
    from fp8export.calibration.calibrators import get_calibrator
    from fp8export.inputs.samples import load_samples
    from fp8export.numerics.fp8 import amax_to_scale

    if cfg.modules:
        modules = list(cfg.modules)
        if not cfg.fuse_scales:
            groups = {}
        elif known_groups is not None:  # convert's selection already knows them
            groups = {g: [m for m in ms if m in set(modules)] for g, ms in known_groups.items()}
        else:
            groups = groups_by_name(modules, config)
    else:
        modules, groups = default_modules(cfg.checkpoint, config, include=cfg.include,
                                          exclude=cfg.exclude, fuse_scales=cfg.fuse_scales)
    if not modules:
        raise Fp8ExportError(f"{cfg.checkpoint}: no linear layers to calibrate (the selection "
                             "is empty); check --include/--exclude.")
    tok_dir = cfg.checkpoint if cfg.checkpoint.is_dir() else None
    samples = load_samples(cfg.calib_data, tok_dir, max_samples=cfg.calib_samples,
                           seq_len=cfg.seq_len, max_positions=max_positions(config),
                           vocab_size=vocab_size(config))
    if cfg.calib_samples and len(samples) < cfg.calib_samples:
        notes.append(f"used all {len(samples)} samples of {cfg.calib_data} (fewer than "
                     f"--calib-samples {cfg.calib_samples})")
    ob = observe(model, samples, modules, method=method, groups=groups,
                 batch_size=cfg.batch_size or DEFAULT_BATCH_SIZE, input_device=input_device)
    t0 = time.perf_counter()
    results = amaxes_from_stats(ob.stats, method, **cfg.method_options())
    compute_s = time.perf_counter() - t0
    if not results:
        raise Fp8ExportError(
            f"{cfg.checkpoint}: none of the {len(modules)} layers received input from "
            f"{cfg.calib_data}; check that the data matches the model.")
    observed = {m: r.amax for m, r in results.items()}
    amax = share_groups(observed, groups)
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
        groups=groups, missing=ob.missing, notes=notes,
        details={m: r.details for m, r in results.items()},
        source_files=source_hashes(cfg.checkpoint))
    if samples.truncated:
        result.notes.append(f"{samples.truncated} samples truncated to {samples.max_len} tokens")
    if cfg.output is not None:
        write_amax_file(result, cfg.output, force=cfg.force)
    return result


def calibrate_ranges(cfg: ConvertConfig, modules: list[str],
                     groups: dict[str, list[str]] | None = None
                     ) -> tuple[dict[str, ActivationRange], dict[str, Any]]:
    """Activation ranges for ``convert``: from ``cfg.calib_amax`` if given, else calibrate.

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
        modules=tuple(modules), fuse_scales=cfg.fuse_scales)
    res = _calibrate(ccfg, groups)
    return res.ranges(), {"source": str(cfg.calib_data), "method": res.method,
                          "options": res.options, "samples": res.samples, "tokens": res.tokens,
                          "missing": res.missing, "notes": res.notes, "device": res.device,
                          "seconds": res.seconds}
