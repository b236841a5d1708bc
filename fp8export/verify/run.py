"""``verify(cfg)``: run reference and candidate on the same inputs, compare, report, gate.

Stages, each producing plain data: inputs (data.py) → outputs of two runners (runners/) →
comparison (metrics.py) and per-layer attribution (per_layer.py) → checks (thresholds.py) →
reports (report.py). Bad input raises Fp8ExportError before any comparison; a candidate that
misses its thresholds raises VerificationFailed *after* the reports are written.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp8export._progress import info, progress, stage
from fp8export._threads import fit_torch
from fp8export.errors import Fp8ExportError, VerificationFailed
from fp8export.runners.base import TimeLimitExceeded
from fp8export.verify.config import VerifyConfig


@dataclass
class VerifyResult:
    """Everything verify found; ``to_dict()`` is JSON-serialisable (report.json is its subset)."""

    passed: bool
    backend: str
    samples: int
    metrics: dict[str, Any]
    thresholds: dict[str, dict[str, float]]
    failures: list[dict[str, Any]]
    checks: list[dict[str, Any]]
    per_layer: list[dict[str, Any]] | None
    thresholds_source: str
    reference: dict[str, Any]
    candidate: dict[str, Any]
    data: dict[str, Any]
    task: str
    notes: list[str] = field(default_factory=list)
    per_sample: list[dict[str, Any]] = field(default_factory=list)
    distributions: dict[str, list[float]] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    reports: dict[str, str] = field(default_factory=dict)
    header: dict[str, Any] = field(default_factory=dict)  # what was judged (provenance.py)
    worst_samples: list[dict[str, Any]] = field(default_factory=list)  # with their text
    family: str = "logits"  # which metrics judged the model (family.py)
    noise_floor: dict[str, Any] | None = None  # the reference against fp32 (noise_floor.py)
    confidence: dict[str, Any] | None = None  # bootstrap intervals of the checks (confidence.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first_output(out: dict, who: str):
    if "logits" in out:
        return out["logits"]
    if len(out) == 1:
        return next(iter(out.values()))
    raise Fp8ExportError(f"{who} returned outputs {sorted(out)} and none is named 'logits'; "
                         "export the model with a 'logits' output.")


def _check_same_model(ref_cfg: dict, cand_runner, reference, candidate) -> None:
    cand_cfg = getattr(cand_runner, "config", None) or {}
    ref_layers, cand_layers = _keras_layers(ref_cfg), _keras_layers(cand_cfg)
    if ref_layers is not None and cand_layers is not None and ref_layers != cand_layers:
        diff = next((a, b) for a, b in zip(ref_layers + [None], cand_layers + [None],
                                           strict=False) if a != b)
        raise Fp8ExportError(
            f"reference {reference} and candidate {candidate} are different Keras models "
            f"(first difference: {diff[0]} vs {diff[1]}). Verify the candidate against the "
            "checkpoint it was converted from.")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "model_type"):
        a, b = ref_cfg.get(key), cand_cfg.get(key)
        if a is not None and b is not None and a != b:
            raise Fp8ExportError(
                f"reference {reference} and candidate {candidate} are different models: "
                f"{key} is {a!r} vs {b!r}. Verify the candidate against the checkpoint it was "
                "converted from.")


def _keras_layers(config: dict) -> list | None:
    """(name, class, options) of each layer of a Keras config; None for other configs."""
    from fp8export.keras_model.config import is_keras_config, parse_keras_config

    if not is_keras_config(config):
        return None
    return [(s.name, s.kind, s.options) for s in parse_keras_config(config, "config").layers]


def _fp8_folder_format(folder, notes: list[str]):
    """What the candidate folder is, as the one reader found it (``FolderFormat``: producer,
    dialect, granularity, activations); what its dialect means for loaders, noted."""
    from fp8export.config import OutputFormat
    from fp8export.fp8dir.formats import format_notes
    from fp8export.fp8dir.reader import read_fp8_folder
    from fp8export.keras_model.config import is_keras_config

    with read_fp8_folder(folder) as opened:
        fmt, keras = opened.format, is_keras_config(opened.config)
    known = {str(f): f for f in OutputFormat}
    if fmt.ours and fmt.dialect in known and not keras:
        notes.extend(f"{note} verify ran it with fp8export's torch FP8 runtime, which applies "
                     "its scales as vLLM does."
                     for note in format_notes(known[fmt.dialect], block=fmt.granularity == "block"))
    return fmt


def verify(cfg: VerifyConfig) -> VerifyResult:
    """Compare ``cfg.candidate`` against ``cfg.reference``; write reports; gate on thresholds.

    Returns:
        VerifyResult (passed).
    Raises:
        Fp8ExportError: bad input or environment (exit 1).
        VerificationFailed: thresholds missed (exit 3); ``.result`` is the VerifyResult and the
            reports are already on disk.
    """
    from fp8export.placement import parse_max_memory
    from fp8export.verify.candidates import candidate_kind, open_candidate, open_reference
    from fp8export.verify.noise_floor import FLOOR_DTYPE, FLOOR_KEY
    from fp8export.verify.thresholds import PRESETS, load_thresholds

    t0, started = time.perf_counter(), time.monotonic()
    if cfg.data is not None:  # a typo'd data file fails before any model loads
        from fp8export.inputs.samples import check_data_file

        check_data_file(cfg.data)
    if cfg.write_reports:
        from fp8export.verify.report import check_report_dir

        thresholds_file = None if isinstance(cfg.thresholds, dict) or \
            str(cfg.thresholds) in PRESETS else Path(cfg.thresholds)
        check_report_dir(cfg.report_dir, cfg.force,
                         inputs=(cfg.reference, cfg.candidate, cfg.data, thresholds_file))
    thr_source, thresholds = load_thresholds(cfg.thresholds)
    # A model spread over devices (--max-memory) has no room for an fp32 copy beside it.
    measure_floor = cfg.noise_floor and str(cfg.reference_dtype) != FLOOR_DTYPE \
        and not cfg.max_memory
    if thresholds.get(FLOOR_KEY) and not measure_floor:
        why = ("--no-noise-floor was given" if not cfg.noise_floor else
               "the reference already runs in fp32 (--reference-dtype fp32)"
               if str(cfg.reference_dtype) == FLOOR_DTYPE else
               "--max-memory spreads the model, leaving no room for an fp32 copy")
        raise Fp8ExportError(
            f"{thr_source}: its '{FLOOR_KEY}' bounds are relative to the noise floor, which is "
            f"not measured because {why}. Measure it (bf16 reference, no --no-noise-floor) or "
            "drop the floor bounds.")
    kind = candidate_kind(cfg.candidate)
    max_memory = parse_max_memory(cfg.max_memory) or None
    fit_torch()  # the CPU threads fitted to this machine, before any model runs
    ref_runner = open_reference(cfg.reference, dtype=str(cfg.reference_dtype),
                                device=str(cfg.device), max_memory=max_memory)
    floor_runner = open_reference(cfg.reference, dtype=FLOOR_DTYPE, device=str(cfg.device)) \
        if measure_floor else None
    cand_runner = open_candidate(cfg.candidate, backend=str(cfg.backend), device=str(cfg.device),
                                 dtype="bf16" if kind == "fp8-folder" else str(cfg.reference_dtype),
                                 fp8_mode=cfg.fp8_mode, max_memory=max_memory,
                                 ort_opt_level=cfg.ort_opt_level)
    notes: list[str] = []
    if cfg.noise_floor and cfg.max_memory:
        notes.append("No noise floor: --max-memory spreads the model over devices, leaving no "
                     "room for the fp32 copy it needs.")
    folder_format = _fp8_folder_format(cfg.candidate, notes) if kind == "fp8-folder" else None
    limit = float(cfg.timeout or 0)
    if limit:
        for runner in (ref_runner, cand_runner, floor_runner):
            if runner is not None:
                runner.deadline = started + limit
    try:
        with _reference_tokenizer(cfg, notes) as tokenizer:
            result = _run(cfg, ref_runner, cand_runner, kind, t0, notes, thr_source,
                          thresholds, folder_format, floor_runner, tokenizer)
    except TimeLimitExceeded as exc:
        raise Fp8ExportError(
            f"verify {cfg.candidate}: stopped after --timeout {limit:g} s ({exc}); nothing was "
            "written. A graph that never ends (a Loop from elsewhere) or a model too large for "
            "the device; raise --timeout if the run is just slow.") from exc
    if cfg.write_reports:
        from fp8export.verify.report import write_reports

        with stage(f"writing the reports to {cfg.report_dir}"):
            result.reports = write_reports(result.to_dict(), cfg.report_dir)
    failures = result.failures
    if failures:
        names = ", ".join(f["message"] for f in failures)
        per_layer = result.per_layer
        worst = f" Worst layer: {per_layer[0]['module']}." if per_layer else ""
        applicable = sum(c["status"] != "skipped" for c in result.checks)
        raise VerificationFailed(f"{len(failures)} of {applicable} thresholds failed: {names}."
                                 f"{worst} Report: {cfg.report_dir}", result)
    return result


@contextlib.contextmanager
def _reference_tokenizer(cfg: VerifyConfig, notes: list[str]):
    """The reference's tokenizer, opened (in its limited child process) before the models load:
    a hostile one fails in a second, and it loads while they do. One child serves the samples'
    encoding and the report's decoding. None without a tokenizer; with token-id data, a
    tokenizer that is refused only costs the report its decoded text (said in a note; False).
    """
    from fp8export.inputs.samples import TEXT_SUFFIXES
    from fp8export.inputs.tokenizer import has_tokenizer, open_tokenizer
    from fp8export.verify.data import tokenizer_folder

    folder = tokenizer_folder(cfg.reference)
    if not has_tokenizer(folder):
        yield None
        return
    try:
        tokenizer = open_tokenizer(folder, for_file=cfg.data)
    except Fp8ExportError as exc:
        if cfg.data is None or cfg.data.suffix.lower() in TEXT_SUFFIXES:
            raise
        info(f"Note: the report shows token ids instead of text: {exc}")
        notes.append(f"The report shows token ids instead of text: {exc}")
        yield False  # tried and refused: not opened again for the report
        return
    with tokenizer:
        yield tokenizer


def _run(cfg: VerifyConfig, ref_runner, cand_runner, kind: str, t0: float, notes: list[str],
         thr_source: str, thresholds, folder_format, floor_runner=None,
         tokenizer=None) -> VerifyResult:
    """Load, infer and compare (the part under the time limit); no reports written."""
    from fp8export.models import task_of
    from fp8export.verify.confidence import assess
    from fp8export.verify.data import load_verify_samples
    from fp8export.verify.family import DESCRIPTIONS, MetricFamily, family_of, new_comparison
    from fp8export.verify.metrics import class_logits
    from fp8export.verify.noise_floor import FLOOR_DTYPE, side_by_side
    from fp8export.verify.provenance import header
    from fp8export.verify.report_samples import worst_samples
    from fp8export.verify.thresholds import evaluate

    per_layer = None
    with contextlib.ExitStack() as running:
        with stage(f"loading the reference {cfg.reference} (torch, {cfg.reference_dtype})"):
            running.enter_context(ref_runner)
        placed = getattr(ref_runner, "placement", None)
        if placed is not None and getattr(cand_runner, "max_memory", None):
            # --max-memory holds both models: the candidate gets what the reference left
            cand_runner.max_memory = placed.remaining(cand_runner.max_memory)
        with stage(f"loading the candidate {cfg.candidate} ({kind}, {cand_runner.backend})"):
            running.enter_context(cand_runner)
        if floor_runner is not None:
            with stage(f"loading the reference again in {FLOOR_DTYPE} (the noise floor)"):
                running.enter_context(floor_runner)
        t_load = time.perf_counter() - t0
        ref_cfg = ref_runner.config
        _check_same_model(ref_cfg, cand_runner, cfg.reference, cfg.candidate)
        if kind == "fp8-folder":
            info(f"candidate runs: {cand_runner.fp8_path()}")
        task = task_of(ref_cfg)
        data_cfg = getattr(ref_runner, "data_config", None) or ref_cfg
        samples, data_info = load_verify_samples(cfg.data, cfg.reference, data_cfg,
                                                 samples=cfg.samples, seq_len=cfg.seq_len,
                                                 tokenizer=tokenizer or None)
        head = getattr(ref_runner, "output_activation", "linear")  # Keras heads: probabilities
        if data_info.get("note"):
            notes.append(data_info["note"])
            info(data_info["note"])
        probe = None
        if cfg.per_layer:
            if kind == "fp8-folder":
                from fp8export.verify.per_layer import PerLayerProbe

                probe = PerLayerProbe(ref_runner.model, cand_runner.model, cand_runner.manifest)
            else:
                notes.append(f"--per-layer needs the FP8 folder as the candidate (got a {kind}); "
                             "run verify on the FP8 folder for per-layer attribution.")
        from fp8export.inputs.samples import iter_batches, num_batches

        cmp = floor_cmp = vs_fp32 = family = None
        t_ref = t_cand = t_floor = 0.0
        try:
            for batch in progress(iter_batches(samples, cfg.batch_size),
                                  total=num_batches(samples, cfg.batch_size),
                                  desc=f"comparing logits on {len(samples)} sample(s)",
                                  unit="batch"):
                feed = {"input_ids": batch.input_ids.numpy(),
                        "attention_mask": batch.attention_mask.numpy()}
                if probe is not None:
                    probe.set_mask(batch.attention_mask)
                ref_logits = class_logits(_first_output(ref_runner.infer(feed), "the reference"),
                                          head)
                t_ref += ref_runner.last_inference_time or 0.0
                cand_logits = class_logits(_first_output(cand_runner.infer(feed),
                                                         "the candidate"), head)
                t_cand += cand_runner.last_inference_time or 0.0
                labels = batch.labels.numpy() if batch.labels is not None else None
                if cmp is None:  # the head decides the metrics, once
                    family = family_of(task, ref_logits.ndim)
                    cmp = new_comparison(family, task, cfg.reference)
                    if floor_runner is not None:
                        floor_cmp = new_comparison(family, task, cfg.reference)
                        vs_fp32 = new_comparison(family, task, cfg.reference)
                like = {"attention_mask": feed["attention_mask"], "input_ids": feed["input_ids"],
                        "labels": labels, "indices": batch.indices}
                cmp.add(ref_logits, cand_logits, **like)
                if floor_runner is not None:
                    fp32 = class_logits(_first_output(floor_runner.infer(feed),
                                                      f"the {FLOOR_DTYPE} reference"), head)
                    t_floor += floor_runner.last_inference_time or 0.0
                    floor_cmp.add(fp32, ref_logits, **like)
                    vs_fp32.add(fp32, cand_logits, **like)
        finally:
            if probe is not None:
                per_layer = probe.result()
                probe.close()
        if cmp is None:
            raise Fp8ExportError("no samples to compare: the data gave no batch. Give data "
                                 "with at least one non-empty sample.")
        compared = cmp.result()
        floor = None
        if floor_cmp is not None:
            floor_metrics = floor_cmp.result()["metrics"]
            cand_fp32 = vs_fp32.result()["metrics"]
            floor = {"reference_dtype": str(cfg.reference_dtype), "against": FLOOR_DTYPE,
                     "metrics": floor_metrics, "candidate_vs_fp32": cand_fp32,
                     "rows": side_by_side(compared["metrics"], floor_metrics, cand_fp32)}
        ref_desc, cand_desc = ref_runner.describe(), cand_runner.describe()
    for name, reason in (cand_desc.get("fallbacks") or {}).items():
        notes.append(f"{name}: ran in emulation, not torch._scaled_mm ({reason}).")
    if cand_desc.get("graph_optimization_level"):
        notes.append(f"onnxruntime ran the graph at {cand_desc['graph_optimization_level']} "
                     f"({cand_desc.get('level_source')}).")
    if cand_desc.get("level_warning"):
        notes.append(cand_desc["level_warning"] + ".")
    if cand_desc.get("moe"):
        notes.append(moe_note(cand_desc["moe"], cand_desc.get("mode")))
    family_note = f"Judged by {DESCRIPTIONS[family]}"
    if family is MetricFamily.EMBEDDINGS:
        family_note += f": {cmp.pooling.describe()}"
        if cmp.pooling.skipped:
            family_note += (f"; modules after pooling not applied: "
                            f"{', '.join(cmp.pooling.skipped)}")
    notes.append(family_note + ".")
    worst = [] if family is MetricFamily.EMBEDDINGS else worst_samples(
        compared["per_sample"], samples.input_ids,
        cfg.reference if cfg.reference.is_dir() else cfg.reference.parent, task, ref_cfg,
        tokenizer=tokenizer)
    head = header(cfg, reference=ref_desc, candidate=cand_desc, kind=kind, data=data_info,
                  backend=cand_runner.backend)
    edited = head["candidate"].get("edited_after_convert")
    if edited:
        info(f"Note: the FP8 folder was edited after convert ({', '.join(edited[:5])} differ "
             "from what convert wrote).")
        notes.append(f"The FP8 folder was edited after convert: {len(edited)} file(s) differ "
                     f"from what convert wrote and verified ({', '.join(edited[:5])}); this "
                     "report judges the folder as it is now, not the converted one.")
    checks = evaluate(compared["metrics"], thresholds, floor and floor["metrics"])
    confidence = assess(checks, cmp.sample_stats(), tokens=int(compared["metrics"]["tokens"]))
    failures = [{k: c[k] for k in ("metric", "op", "threshold", "value", "message")}
                for c in checks if c["status"] == "failed"]
    described = {}
    if folder_format is not None:
        notes.append(f"candidate FP8 folder: {folder_format.describe()}")
        described = {"format": folder_format.dialect, "folder": folder_format.to_dict()}
    result = VerifyResult(
        passed=not failures, backend=cand_runner.backend, samples=cmp.samples,
        metrics=compared["metrics"], thresholds=thresholds, failures=failures, checks=checks,
        per_layer=per_layer, thresholds_source=thr_source, reference=ref_desc,
        candidate={**cand_desc, "kind": kind, "format": None, **described}, data=data_info,
        task=task,
        notes=notes,
        per_sample=compared["per_sample"], distributions=compared["distributions"],
        timing={"load_s": round(t_load, 3), "reference_s": round(t_ref, 3),
                "candidate_s": round(t_cand, 3), "floor_s": round(t_floor, 3),
                "total_s": round(time.perf_counter() - t0, 3)},
        header=head, worst_samples=worst, family=str(family), noise_floor=floor,
        confidence=confidence,
    )
    return result


def moe_note(moe: dict[str, Any], mode: str | None) -> str:
    """One line: which weights the MoE expert projections ran with, and how many calls."""
    calls = moe.get("expert_gemms") or {}
    fp8 = calls.get("float8_e4m3fn", 0)
    other = {k: v for k, v in calls.items() if k != "float8_e4m3fn"}
    how = "emulated FP8" if mode == "emulate" else "torch._scaled_mm"
    per = f" x {moe['experts_per_layer']} experts" if moe.get("experts_per_layer") else ""
    text = (f"MoE: {moe.get('moe_layers')} layers{per}; "
            f"{fp8} expert projection calls ran with E4M3 weights ({how})")
    if other:
        text += "; in high precision: " + ", ".join(f"{v} ({k})" for k, v in other.items())
    if moe.get("note"):
        text += f"; {moe['note']}"
    return text + "."
