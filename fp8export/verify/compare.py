"""verify's run and compare stages: both runners (and the fp32 reference for the noise floor)
infer the same batches; their outputs go to the comparison the head's family picks, and an
FP8-folder candidate's layers to the per-layer probe (the layer check's first tokens, or every
batch with ``--per-layer``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8export._progress import progress
from fp8export._time_limit import check
from fp8export.errors import Fp8ExportError
from fp8export.verify.load import Inputs, Session


@dataclass
class Compared:
    """What the comparison measured: ``result`` (metrics, per-sample values, distributions),
    the comparison itself (its family, sample statistics, pooling), the noise floor (None: not
    measured), the per-layer attribution (None: not asked), the layer check's rows and tokens
    (None: not run) and each runner's inference time."""

    result: dict[str, Any]
    comparison: Any
    family: Any  # family.MetricFamily
    floor: dict[str, Any] | None
    per_layer: list[dict[str, Any]] | None
    seconds: dict[str, float]
    layers: list[dict[str, Any]] | None = None
    layer_tokens: int = 0
    attention_cost: dict[str, Any] | None = None  # --kv-cache / --attention fp8: the ladder


def first_output(out: dict, who: str):
    """The logits among a runner's outputs (the only output, or the one named 'logits')."""
    if "logits" in out:
        return out["logits"]
    if len(out) == 1:
        return next(iter(out.values()))
    raise Fp8ExportError(f"{who} returned outputs {sorted(out)} and none is named 'logits'; "
                         "export the model with a 'logits' output.")


def compare(session: Session, inputs: Inputs, layer_check: bool = False) -> Compared:
    """Run every batch through the reference, the candidate and the floor runner; compare.
    ``layer_check``: measure each quantized layer's isolated SQNR (layer_check.py)."""
    from fp8export.inputs.samples import iter_batches, num_batches
    from fp8export.verify.family import family_of, new_comparison
    from fp8export.verify.metrics import class_logits
    from fp8export.verify.noise_floor import FLOOR_DTYPE

    cfg, ref, cand, floor_runner = session.cfg, session.reference, session.candidate, \
        session.floor
    samples, head = inputs.samples, inputs.head
    probe = _per_layer_probe(session, layer_check)
    rows = None
    variants = session.candidate.attention_variants()
    ladder: dict[str, Any] = {}
    cmp = floor_cmp = vs_fp32 = family = None
    t_ref = t_cand = t_floor = 0.0
    try:
        for batch in progress(iter_batches(samples, cfg.batch_size),
                              total=num_batches(samples, cfg.batch_size),
                              desc=f"comparing logits on {len(samples)} sample(s)", unit="batch"):
            check()  # the time limit, between batches wherever the run is (signals or not)
            feed = {"input_ids": batch.input_ids.numpy(),
                    "attention_mask": batch.attention_mask.numpy(),
                    **{k: v.numpy() for k, v in (batch.extras or {}).items()}}
            if probe is not None and probe.active:
                probe.set_mask(batch.attention_mask)
            ref_logits = class_logits(first_output(ref.infer(feed), "the reference"), head)
            t_ref += ref.last_inference_time or 0.0
            cand_logits = class_logits(first_output(cand.infer(feed), "the candidate"), head)
            t_cand += cand.last_inference_time or 0.0
            labels = batch.labels.numpy() if batch.labels is not None else None
            if cmp is None:  # the head decides the metrics, once
                family = family_of(inputs.task, ref_logits.ndim)
                cmp = new_comparison(family, inputs.task, cfg.reference)
                if floor_runner is not None:
                    floor_cmp = new_comparison(family, inputs.task, cfg.reference)
                    vs_fp32 = new_comparison(family, inputs.task, cfg.reference)
            like = {"attention_mask": feed["attention_mask"], "input_ids": feed["input_ids"],
                    "labels": labels, "indices": batch.indices}
            cmp.add(ref_logits, cand_logits, **like)
            for label, mode in variants:  # the same batch through the cheaper configurations
                cand.set_attention(mode)
                try:
                    out = class_logits(first_output(cand.infer(feed), label), head)
                finally:
                    cand.set_attention("judged")
                ladder.setdefault(label, new_comparison(family, inputs.task, cfg.reference)
                                  ).add(ref_logits, out, **like)
            if floor_runner is not None:
                fp32 = class_logits(first_output(floor_runner.infer(feed),
                                                 f"the {FLOOR_DTYPE} reference"), head)
                t_floor += floor_runner.last_inference_time or 0.0
                floor_cmp.add(fp32, ref_logits, **like)
                vs_fp32.add(fp32, cand_logits, **like)
    finally:
        if probe is not None:
            rows = probe.result()
            probe.close()
    if cmp is None:
        raise Fp8ExportError("no samples to compare: the data gave no batch. Give data "
                             "with at least one non-empty sample.")
    compared = cmp.result()
    floor = None if floor_cmp is None else _floor(cfg, compared, floor_cmp, vs_fp32)
    cost = _attention_cost(cand, ladder, cmp, compared) if variants else None
    return Compared(compared, cmp, family, floor, rows if session.cfg.per_layer else None,
                    {"reference_s": t_ref, "candidate_s": t_cand, "floor_s": t_floor},
                    layers=rows, layer_tokens=probe.tokens if probe is not None else 0,
                    attention_cost=cost)


COST_METRICS = ("kl_mean", "top1_agreement", "kl_p99", "top5_overlap", "ppl_ratio")


def _attention_cost(cand, ladder: dict[str, Any], judged, judged_result: dict[str, Any]
                    ) -> dict[str, Any]:
    """Rows ``{configuration, <metric>, <metric>_interval}``: each configuration against the
    reference on the same batches, the FP8-linears-only one first, the judged one last (95%
    bootstrap intervals over samples, as the checks have)."""
    from fp8export.analysis.confidence import intervals

    rows = []
    for label, comparison in [*ladder.items(), (cand.judged_variant(), judged)]:
        result = judged_result if comparison is judged else comparison.result()
        metrics = {k: result["metrics"][k] for k in COST_METRICS if k in result["metrics"]}
        spans = intervals(comparison.sample_stats(), list(metrics))
        rows.append({"configuration": label, **metrics,
                     **{f"{k}_interval": v for k, v in spans.items()}})
    return {"rows": rows, **cand.attention_setup()}


def _per_layer_probe(session: Session, layer_check: bool):
    """The per-layer probe on the reference and FP8 models (None: not asked, or noted why not):
    on every batch with ``--per-layer``, else on the layer check's first tokens only."""
    if not (session.cfg.per_layer or layer_check):
        return None
    if session.kind != "fp8-folder":
        if session.cfg.per_layer:
            session.notes.append(f"--per-layer needs the FP8 folder as the candidate (got a "
                                 f"{session.kind}); run verify on the FP8 folder for per-layer "
                                 "attribution.")
        return None
    from fp8export.analysis.per_layer import PerLayerProbe
    from fp8export.verify.layer_check import CHECK_TOKENS

    cand, full = session.candidate, session.cfg.per_layer
    return PerLayerProbe(session.reference.model, cand.model, cand.manifest, end_to_end=full,
                         max_tokens=None if full else CHECK_TOKENS)


def _floor(cfg, compared: dict, floor_cmp, vs_fp32) -> dict[str, Any]:
    """The noise floor: the reference against fp32, beside the candidate against both."""
    from fp8export.verify.noise_floor import FLOOR_DTYPE, side_by_side

    floor_metrics = floor_cmp.result()["metrics"]
    cand_fp32 = vs_fp32.result()["metrics"]
    return {"reference_dtype": str(cfg.reference_dtype), "against": FLOOR_DTYPE,
            "metrics": floor_metrics, "candidate_vs_fp32": cand_fp32,
            "rows": side_by_side(compared["metrics"], floor_metrics, cand_fp32)}
