"""One observation pass: sample batches through the bf16 model, statistics per linear input.

:func:`observe` hooks the observed modules (:mod:`.observers`), runs the cheapest forward that
reaches them (:func:`forward_fn`) and returns their statistics; :func:`amaxes_from_stats` turns
those into one calibrator's amaxes. One pass serves any calibrator.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fp8export._progress import STAGE_PREFIX, info, progress_enabled
from fp8export.calibration.config import DEFAULT_BATCH_SIZE
from fp8export.errors import Fp8ExportError

if TYPE_CHECKING:
    from fp8export.calibration.calibrators import AmaxResult
    from fp8export.calibration.observers import FinalStats
    from fp8export.inputs.samples import Batch, Samples


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
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # MoE: routed per expert
    unmasked: dict[str, int] = field(default_factory=dict)  # calls the mask did not fit


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
    encoder_decoder = bool(getattr(cfg, "is_encoder_decoder", False))
    from fp8export.models import model_inputs

    def call(batch: Batch, device):
        ids = batch.input_ids.to(device, non_blocking=True)
        mask = batch.attention_mask.to(device, non_blocking=True)
        inputs = model_inputs(model, ids, mask, batch.extras, device)
        with torch.inference_mode():
            return run(**inputs, **kwargs) if not encoder_decoder else model(**inputs, **kwargs)

    return call


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
    from fp8export.moe import moe_modules

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
    experts = moe_modules(model)
    for m in experts.values():
        m.token_counts = torch.zeros(m.num_experts, dtype=torch.int64)
    start = time.perf_counter()
    try:
        with obs:
            for batch in (batches if batches is not None else iter_batches(samples, batch_size)):
                obs.begin_batch(batch.attention_mask)
                for m in experts.values():  # routed tokens counted on real positions only
                    m.count_rows = obs.valid_rows
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
        expert_tokens = {n: m.token_counts.tolist() for n, m in experts.items()}
        for m in experts.values():
            m.token_counts = m.count_rows = None
    seconds = time.perf_counter() - start
    missing = [m for m in modules if m not in stats]
    notes = unmasked_note(obs.unmasked_calls)
    return Observation(stats=stats, samples=n_samples, tokens=n_tokens, batches=n_done,
                       seconds=seconds, missing=missing, notes=notes,
                       expert_tokens=expert_tokens, unmasked=dict(obs.unmasked_calls))


def unmasked_note(unmasked: dict[str, int]) -> list[str]:
    """The note on modules whose inputs the attention mask did not fit (none: no note)."""
    bad = sorted(m for m, c in unmasked.items() if c)
    if not bad:
        return []
    return [f"{len(bad)} modules received inputs whose shape does not match the attention "
            f"mask, so padding could not be excluded there: {bad[:5]}"]


def reduce_observation(ob: Observation, modules: Sequence[str], comm) -> Observation:
    """The ranks' observations of their shares combined into the observation of all the data,
    on every rank: max of the amaxes (NaN wins, as in one pass), sums of the element counts,
    histograms, routed tokens and sample counts. Exact, so 1, 2 or 4 ranks give the same bits."""
    if not comm.distributed:
        return ob
    import numpy as np
    import torch

    from fp8export.calibration.observers import FINITE_BINS, FinalStats

    names = sorted(set(modules))
    n = len(names)
    have = [ob.stats.get(m) for m in names]
    amax = torch.tensor([s.amax if s is not None else -math.inf for s in have],
                        dtype=torch.float64)
    counts = torch.tensor([[1 if s is not None else 0, s.elements if s else 0,
                            s.nonfinite if s else 0, ob.unmasked.get(m, 0)]
                           for m, s in zip(names, have, strict=True)] or
                          torch.zeros((0, 4)), dtype=torch.int64).reshape(n, 4)
    hist = any(s is not None and s.counts is not None for s in have)
    hist_flag = comm.sum_ints(torch.tensor([int(hist)]), "calibration statistics")
    amax = comm.max_floats(amax, "calibration amaxes")
    counts = comm.sum_ints(counts, "calibration counts")
    table = None
    if int(hist_flag[0]):
        table = torch.zeros((n, FINITE_BINS), dtype=torch.int64)
        for i, s in enumerate(have):
            if s is not None and s.counts is not None:
                table[i] = torch.from_numpy(np.asarray(s.counts, dtype=np.int64))
        table = comm.sum_ints(table, "calibration histograms")
    experts = sorted(ob.expert_tokens)
    flat = torch.tensor([c for e in experts for c in ob.expert_tokens[e]] +
                        [ob.samples, ob.tokens, ob.batches], dtype=torch.int64)
    flat = comm.sum_ints(flat, "routed tokens").tolist()
    expert_tokens, at = {}, 0
    for e in experts:
        k = len(ob.expert_tokens[e])
        expert_tokens[e] = flat[at:at + k]
        at += k
    stats = {}
    for i, m in enumerate(names):
        if int(counts[i, 0]):
            stats[m] = FinalStats(amax=float(amax[i]), elements=int(counts[i, 1]),
                                  counts=None if table is None else table[i].numpy().copy(),
                                  nonfinite=int(counts[i, 2]))
    unmasked = {m: int(counts[i, 3]) for i, m in enumerate(names)}
    # an observation's only note is the unmasked one: made again from the summed counts
    return Observation(stats=stats, samples=flat[-3], tokens=flat[-2], batches=flat[-1],
                       seconds=ob.seconds, missing=[m for m in modules if m not in stats],
                       notes=unmasked_note(unmasked), expert_tokens=expert_tokens,
                       unmasked=unmasked)


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


