"""``verify(cfg)``: run reference and candidate on the same inputs, compare, gate.

Stages, each a module producing plain data: load (load.py: the runners, the tokenizer, the
inputs from inputs/eval_data.py) → run and compare (compare.py: both runners' outputs into
metrics.py's comparison, per-layer attribution from analysis/per_layer.py) → judge (judge.py:
checks from thresholds.py, the VerifyResult). The reports are written above this stage
(reports/report.py). Bad input raises Fp8ExportError before any comparison; a candidate that
misses its thresholds raises VerificationFailed with the result, which the reports are made of.
"""

from __future__ import annotations

import contextlib
import time

from fp8export._progress import where
from fp8export._threads import fit_torch
from fp8export._time_limit import TimeUp, time_limit
from fp8export.errors import Fp8ExportError, VerificationFailed
from fp8export.runners.base import TimeLimitExceeded
from fp8export.verify.config import VerifyConfig
from fp8export.verify.load import Session
from fp8export.verify.result import VerifyResult


def verify(cfg: VerifyConfig) -> VerifyResult:
    """Compare ``cfg.candidate`` against ``cfg.reference`` and gate on thresholds; no reports
    (``fp8export.reports.report.verify_and_report`` writes them around this).

    Returns:
        VerifyResult (passed).
    Raises:
        Fp8ExportError: bad input or environment (exit 1).
        VerificationFailed: thresholds missed (exit 3); ``.result`` is the VerifyResult.
    """
    t0, started = time.perf_counter(), time.monotonic()
    limit = float(cfg.timeout or 0)
    try:
        with time_limit(limit):
            result = _verify(cfg, t0, started, limit)
    except (TimeUp, TimeLimitExceeded) as exc:
        at = getattr(exc, "where", None) or where() or "starting"
        raise Fp8ExportError(
            f"verify {cfg.candidate}: stopped by --timeout {limit:g} s after "
            f"{time.perf_counter() - t0:.0f} s, while {at}; nothing was "
            "written. Raise --timeout (0: no limit) if the run is just slow; a graph that never "
            "ends or a model far too large for the device stops here.") from None
    failures = result.failures
    if failures:
        names = ", ".join(f["message"] for f in failures)
        per_layer = result.per_layer
        worst = f" Worst layer: {per_layer[0]['module']}." if per_layer else ""
        applicable = sum(c["status"] != "skipped" for c in result.checks)
        raise VerificationFailed(f"{len(failures)} of {applicable} thresholds failed: {names}."
                                 f"{worst} Report: {cfg.report_dir}", result)
    return result


def _verify(cfg: VerifyConfig, t0: float, started: float, limit: float) -> VerifyResult:
    """The run under its time limit: inputs checked, the models loaded, compared, judged."""
    from fp8export.verify.candidates import candidate_kind
    from fp8export.verify.load import open_session, reference_tokenizer
    from fp8export.verify.thresholds import load_thresholds

    if cfg.data is not None:  # a typo'd data file fails before any model loads
        from fp8export.inputs.samples import check_data_file

        check_data_file(cfg.data)
    thr_source, thresholds = load_thresholds(cfg.thresholds)
    measure_floor = _measures_floor(cfg, thr_source, thresholds)
    kind = candidate_kind(cfg.candidate)
    fit_torch()  # the CPU threads fitted to this machine, before any model runs
    session = open_session(cfg, kind, measure_floor)
    if limit:  # onnxruntime stops mid-graph at the deadline; the others before each batch
        for runner in session.runners():
            runner.deadline = started + limit
    with reference_tokenizer(cfg, session.notes) as session.tokenizer:
        return _run(session, thr_source, thresholds, t0)


def plan_verify(cfg: VerifyConfig) -> list[str]:
    """``verify --plan``: how the run would place its models (and, streamed, what one layer
    measures), nothing compared or written."""
    from fp8export.verify.candidates import candidate_kind
    from fp8export.verify.load import activate, load_inputs, open_session, reference_tokenizer
    from fp8export.verify.thresholds import load_thresholds

    thr_source, thresholds = load_thresholds(cfg.thresholds)
    kind = candidate_kind(cfg.candidate)
    fit_torch()
    session = open_session(cfg, kind, _measures_floor(cfg, thr_source, thresholds))
    if not session.streamed:
        from fp8export.streaming.plan import whole_lines

        if session.decision is None:
            return ["mode: the whole model (a Keras reference runs whole)"]
        return whole_lines(session.decision)
    import torch

    from fp8export.distributed import current
    from fp8export.inputs.samples import iter_batches
    from fp8export.streaming.plan import estimate, measure
    from fp8export.verify.streamed import streamed_plan, streamed_runners

    with reference_tokenizer(cfg, session.notes) as session.tokenizer, \
            contextlib.ExitStack() as running:
        activate(session, running)
        inputs = load_inputs(session)
        batches = list(iter_batches(inputs.samples, cfg.batch_size))
        mine = [batches[b] for b in current().share(len(batches))]
        plan = streamed_plan(session, mine)
        runners = streamed_runners(session)
        if mine:
            plan.probe = measure(session.reference.parts, mine,
                                 torch.device(session.reference.device))
            plan.seconds = estimate(plan, plan.probe, streams=len(runners))
    return plan.lines()


def _measures_floor(cfg: VerifyConfig, thr_source: str, thresholds: dict) -> bool:
    """Whether the fp32 noise floor is measured; thresholds relative to it need it."""
    from fp8export.verify.noise_floor import FLOOR_DTYPE, FLOOR_KEY

    # A model spread over devices (--max-memory naming several) has no room for an fp32 copy
    # beside it; one device's cap counts the copy in its plan (streamed if it does not fit).
    measure = cfg.noise_floor and str(cfg.reference_dtype) != FLOOR_DTYPE and \
        not spreads(cfg)
    if thresholds.get(FLOOR_KEY) and not measure:
        why = ("--no-noise-floor was given" if not cfg.noise_floor else
               "the reference already runs in fp32 (--reference-dtype fp32)"
               if str(cfg.reference_dtype) == FLOOR_DTYPE else
               "--max-memory spreads the model, leaving no room for an fp32 copy")
        raise Fp8ExportError(
            f"{thr_source}: its '{FLOOR_KEY}' bounds are relative to the noise floor, which is "
            f"not measured because {why}. Measure it (bf16 reference, no --no-noise-floor) or "
            "drop the floor bounds.")
    return bool(measure)


def spreads(cfg: VerifyConfig) -> bool:
    """``--max-memory`` names several GPUs (or disk), or comes with ``--offload none``:
    accelerate spreads the model (``fp8export.streaming.plan.decide``; one GPU and ``cpu``
    otherwise cap the device and layer streaming's host memory)."""
    from fp8export.config import Offload
    from fp8export.placement import parse_max_memory

    mm = parse_max_memory(cfg.max_memory)
    if not mm:
        return False
    return len([k for k in mm if isinstance(k, int)]) > 1 or "disk" in mm or \
        cfg.offload is Offload.NONE


def _run(session: Session, thr_source: str, thresholds: dict, t0: float) -> VerifyResult:
    """Load, run, compare (the part under the time limit), then judge; no reports written."""
    from fp8export.verify.compare import compare
    from fp8export.verify.judge import judge
    from fp8export.verify.layer_check import METRIC
    from fp8export.verify.load import activate, load_inputs

    with contextlib.ExitStack() as running:
        activate(session, running)
        t_load = time.perf_counter() - t0
        inputs = load_inputs(session)
        measured = compare(session, inputs, layer_check=METRIC in thresholds)
        described = session.reference.describe(), session.candidate.describe()
    timing = {"load_s": t_load, **measured.seconds}
    result = judge(session, inputs, measured, thr_source, thresholds, described,
                   {k: round(v, 3) for k, v in timing.items()})
    result.timing["total_s"] = round(time.perf_counter() - t0, 3)
    return result
