"""verify's judge stage: the comparison checked against the thresholds (with bootstrap
confidence), what ran noted, the worst samples and the provenance header: the VerifyResult."""

from __future__ import annotations

from typing import Any

from fp8export._progress import info
from fp8export.verify.compare import Compared
from fp8export.verify.load import Inputs, Session
from fp8export.verify.result import VerifyResult


def judge(session: Session, inputs: Inputs, measured: Compared, thresholds_source: str,
          thresholds: dict, described: tuple[dict[str, Any], dict[str, Any]],
          timing: dict[str, float]) -> VerifyResult:
    """The result of the run; ``described``: what the reference and candidate runners said of
    themselves while active (``Runner.describe()``)."""
    from fp8export.analysis.confidence import assess
    from fp8export.verify import layer_check
    from fp8export.verify.embeddings import recipe_note
    from fp8export.verify.family import MetricFamily
    from fp8export.verify.provenance import header
    from fp8export.verify.thresholds import evaluate
    from fp8export.verify.worst_samples import worst_samples

    cfg, notes, kind = session.cfg, session.notes, session.kind
    ref_desc, cand_desc = described
    compared, family = measured.result, measured.family
    notes.extend(runner_notes(cand_desc))
    notes.append(family_note(measured) + ".")
    worst = [] if family is MetricFamily.EMBEDDINGS else worst_samples(
        compared["per_sample"], inputs.samples.input_ids,
        cfg.reference if cfg.reference.is_dir() else cfg.reference.parent, inputs.task,
        inputs.config, tokenizer=session.tokenizer)
    head = header(cfg, reference=ref_desc, candidate=cand_desc, kind=kind,
                  data=inputs.data_info, backend=session.candidate.backend)
    edited = head["candidate"].get("edited_after_convert")
    if edited:
        info(f"Note: the FP8 folder was edited after convert ({', '.join(edited[:5])} differ "
             "from what convert wrote).")
        notes.append(f"The FP8 folder was edited after convert: {len(edited)} file(s) differ "
                     f"from what convert wrote and verified ({', '.join(edited[:5])}); this "
                     "report judges the folder as it is now, not the converted one.")
    floor = measured.floor
    compared["metrics"].update(layer_check.layer_metrics(measured.layers))
    checks = evaluate(compared["metrics"], thresholds, floor and floor["metrics"])
    layer_check.name_layers(checks, measured.layers, kind)
    unmeasured = layer_check.unmeasured_note(measured.layers)
    if unmeasured:
        notes.append(unmeasured)
    confidence = assess(checks, measured.comparison.sample_stats(),
                        tokens=int(compared["metrics"]["tokens"]))
    failures = [{k: c[k] for k in ("metric", "op", "threshold", "value", "message")}
                for c in checks if c["status"] == "failed"]
    if family is MetricFamily.EMBEDDINGS:
        advice = recipe_note(compared["metrics"], _options(cfg.candidate, kind))
        if advice:
            notes.append(advice)
    folder = {}
    if session.folder_format is not None:
        notes.append(f"candidate FP8 folder: {session.folder_format.describe()}")
        folder = {"format": session.folder_format.dialect,
                  "folder": session.folder_format.to_dict()}
    return VerifyResult(
        passed=not failures, backend=session.candidate.backend,
        samples=measured.comparison.samples, metrics=compared["metrics"],
        thresholds=thresholds, failures=failures, checks=checks, per_layer=measured.per_layer,
        thresholds_source=thresholds_source, reference=ref_desc,
        candidate={**cand_desc, "kind": kind, "format": None, **folder},
        data=inputs.data_info, task=inputs.task, notes=notes,
        per_sample=compared["per_sample"], distributions=compared["distributions"],
        timing=timing, header=head, worst_samples=worst, family=str(family),
        noise_floor=floor, confidence=confidence,
        layer_check=layer_check.summary(measured.layers, measured.layer_tokens,
                                        (thresholds.get(layer_check.METRIC) or {}).get("value")),
        attention_cost=measured.attention_cost,
    )


def _options(candidate, kind: str) -> dict[str, Any] | None:
    """The convert options an fp8export folder recorded (None for anything else)."""
    from fp8export.errors import Fp8ExportError
    from fp8export.fp8dir.manifest import MANIFEST_NAME, read_manifest

    if kind != "fp8-folder" or not (candidate / MANIFEST_NAME).is_file():
        return None
    try:
        options = read_manifest(candidate).get("options")
    except Fp8ExportError:  # an unreadable manifest is reported elsewhere; no advice from it
        return None
    return options if isinstance(options, dict) else None


def runner_notes(cand_desc: dict[str, Any]) -> list[str]:
    """What the candidate's runner did that the reader should know: emulated layers,
    onnxruntime's level and its warning, the MoE experts' weights."""
    notes = [f"{name}: ran in emulation, not torch._scaled_mm ({reason})."
             for name, reason in (cand_desc.get("fallbacks") or {}).items()]
    if cand_desc.get("graph_optimization_level"):
        notes.append(f"onnxruntime ran the graph at {cand_desc['graph_optimization_level']} "
                     f"({cand_desc.get('level_source')}).")
    if cand_desc.get("level_warning"):
        notes.append(cand_desc["level_warning"] + ".")
    if cand_desc.get("moe"):
        notes.append(moe_note(cand_desc["moe"], cand_desc.get("mode")))
    return notes


def family_note(measured: Compared) -> str:
    """Which metrics judged the model (and, for embeddings, how they were pooled)."""
    from fp8export.verify.family import DESCRIPTIONS, MetricFamily

    note = f"Judged by {DESCRIPTIONS[measured.family]}"
    if measured.family is MetricFamily.EMBEDDINGS:
        pooling = measured.comparison.pooling
        note += f": {pooling.describe()}"
        if pooling.skipped:
            note += f"; modules after pooling not applied: {', '.join(pooling.skipped)}"
    return note


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
