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


class Accumulator:
    """Both models' (and the fp32 reference's) logits of each batch into the comparisons the
    head's family picks; in a data-parallel run each rank adds its share and :meth:`finish`
    merges the shares in sample order, on every rank (so every rank judges alike)."""

    def __init__(self, session: Session, inputs: Inputs, batches: list, mine: range):
        from fp8export.distributed import current

        self.session, self.inputs = session, inputs
        self.comm = current()
        # real tokens of the samples before this rank's first (the scatter's draws replay)
        self.before = tuple(int(t) for b in batches[:mine.start]
                            for t in b.attention_mask.sum(dim=1).tolist())
        self.cmp = self.floor_cmp = self.vs_fp32 = self.family = None

    def _new(self):
        from fp8export.verify.family import new_comparison
        from fp8export.verify.metrics import Comparison

        cmp = new_comparison(self.family, self.inputs.task, self.session.cfg.reference)
        if self.comm.distributed:
            if not isinstance(cmp, Comparison):
                raise Fp8ExportError(f"data-parallel verify compares logits; an {self.family} "
                                     "model's comparison needs all samples in one process. "
                                     "Run verify without torchrun.")
            cmp = Comparison(causal=cmp.causal, before=self.before)
        return cmp

    def add(self, batch, ref_logits, cand_logits, fp32_logits=None) -> None:
        from fp8export.verify.family import family_of

        if self.cmp is None:  # the head decides the metrics, once
            self.family = family_of(self.inputs.task, ref_logits.ndim)
            self.cmp = self._new()
            if fp32_logits is not None:
                self.floor_cmp, self.vs_fp32 = self._new(), self._new()
        labels = batch.labels.numpy() if batch.labels is not None else None
        like = {"attention_mask": batch.attention_mask.numpy(),
                "input_ids": batch.input_ids.numpy(), "labels": labels,
                "indices": batch.indices}
        self.cmp.add(ref_logits, cand_logits, **like)
        if fp32_logits is not None:
            self.floor_cmp.add(fp32_logits, ref_logits, **like)
            self.vs_fp32.add(fp32_logits, cand_logits, **like)

    def finish(self, per_layer, seconds: dict[str, float]) -> Compared:
        comm = self.comm
        if comm.distributed:
            self._merge()
        if self.cmp is None:
            raise Fp8ExportError("no samples to compare: the data gave no batch. Give data "
                                 "with at least one non-empty sample.")
        compared = self.cmp.result()
        floor = None if self.floor_cmp is None else _floor(self.session.cfg, compared,
                                                          self.floor_cmp, self.vs_fp32)
        return Compared(compared, self.cmp, self.family, floor, per_layer, seconds)

    def _merge(self) -> None:
        """Every rank's comparisons, gathered and merged in rank (= sample) order."""
        from fp8export.verify.family import MetricFamily
        from fp8export.verify.metrics import Comparison

        comm = self.comm
        kinds = ("cmp", "floor_cmp", "vs_fp32")
        for kind in kinds:
            mine = getattr(self, kind)
            parts = comm.all_gather_bytes(b"" if mine is None else mine.to_bytes(),
                                          f"the comparison ({kind})")
            parts = [p for p in parts if p]
            if parts:
                setattr(self, kind, Comparison.merged(parts))
        names = comm.all_gather_bytes(str(self.family or "").encode(), "the metric family")
        named = [n.decode() for n in names if n]
        if named:
            self.family = MetricFamily(named[0])


def compare(session: Session, inputs: Inputs, layer_check: bool = False) -> Compared:
    """Run every batch (this rank's share) through the reference, the candidate and the floor
    runner; compare. ``layer_check``: measure each quantized layer's isolated SQNR
    (layer_check.py). A streamed session runs layer by layer (``verify/streamed.py``)."""
    from fp8export.distributed import current
    from fp8export.inputs.samples import iter_batches
    from fp8export.verify.family import new_comparison
    from fp8export.verify.metrics import class_logits
    from fp8export.verify.noise_floor import FLOOR_DTYPE

    cfg, ref, cand, floor_runner = session.cfg, session.reference, session.candidate, \
        session.floor
    batches = list(iter_batches(inputs.samples, cfg.batch_size))
    comm = current()
    mine = comm.share(len(batches))
    acc = Accumulator(session, inputs, batches, mine)
    if session.streamed:
        from fp8export.verify.streamed import compare_streamed

        return compare_streamed(session, inputs, [batches[b] for b in mine], acc, layer_check)
    head = inputs.head
    variants = cand.attention_variants()
    if variants and comm.distributed:
        raise Fp8ExportError("--kv-cache fp8 / --attention fp8 compare several configurations "
                             "of the candidate in one process; run verify without torchrun.")
    # under torchrun rank 0 measures the layers, on the run's first batches as one process does
    probe = _per_layer_probe(session, layer_check) if comm.rank == 0 else None
    rows = None
    ladder: dict[str, Any] = {}
    t_ref = t_cand = t_floor = 0.0
    try:
        for b in progress(mine, total=len(mine),
                          desc=f"comparing logits on {len(inputs.samples)} sample(s)",
                          unit="batch"):
            check()  # the time limit, between batches wherever the run is (signals or not)
            batch = batches[b]
            feed = {"input_ids": batch.input_ids.numpy(),
                    "attention_mask": batch.attention_mask.numpy(),
                    **{k: v.numpy() for k, v in (batch.extras or {}).items()}}
            if probe is not None and probe.active:
                probe.set_mask(batch.attention_mask)
            ref_logits = class_logits(first_output(ref.infer(feed), "the reference"), head)
            t_ref += ref.last_inference_time or 0.0
            cand_logits = class_logits(first_output(cand.infer(feed), "the candidate"), head)
            t_cand += cand.last_inference_time or 0.0
            fp32 = None
            if floor_runner is not None:
                fp32 = class_logits(first_output(floor_runner.infer(feed),
                                                 f"the {FLOOR_DTYPE} reference"), head)
                t_floor += floor_runner.last_inference_time or 0.0
            acc.add(batch, ref_logits, cand_logits, fp32)
            labels = batch.labels.numpy() if batch.labels is not None else None
            like = {"attention_mask": feed["attention_mask"], "input_ids": feed["input_ids"],
                    "labels": labels, "indices": batch.indices}
            for label, mode in variants:  # the same batch through the cheaper configurations
                cand.set_attention(mode)
                try:
                    out = class_logits(first_output(cand.infer(feed), label), head)
                finally:
                    cand.set_attention("judged")
                ladder.setdefault(label, new_comparison(acc.family, inputs.task, cfg.reference)
                                  ).add(ref_logits, out, **like)
        if probe is not None and comm.distributed:
            _probe_past_share(probe, batches, mine.stop, ref, cand)
    finally:
        if probe is not None:
            rows = probe.result()
            probe.close()
    tokens = probe.tokens if probe is not None else 0
    if comm.distributed and session.kind == "fp8-folder" and (layer_check or cfg.per_layer):
        rows, tokens = from_rank0(comm, rows, tokens)
    measured = acc.finish(rows if cfg.per_layer else None,
                          {"reference_s": t_ref, "candidate_s": t_cand, "floor_s": t_floor})
    measured.layers = rows
    measured.layer_tokens = tokens
    if variants:
        measured.attention_cost = _attention_cost(cand, ladder, measured.comparison,
                                                  measured.result)
    return measured

def _probe_past_share(probe, batches: list, start: int, ref, cand) -> None:
    """Rank 0 of a torchrun run: the probe goes on over the batches after its share, in order,
    until it has what one process would have measured (the reference runs them; the candidate
    too where the probe compares the models' own outputs)."""
    for batch in batches[start:]:
        if not probe.active:
            return
        check()
        probe.set_mask(batch.attention_mask)
        if not probe.active:
            return
        feed = {"input_ids": batch.input_ids.numpy(),
                "attention_mask": batch.attention_mask.numpy(),
                **{k: v.numpy() for k, v in (batch.extras or {}).items()}}
        ref.infer(feed)
        if probe.end_to_end:
            cand.infer(feed)


def from_rank0(comm, rows, tokens: int):
    """Rank 0's layer rows and token count on every rank (each judges alike)."""
    import json

    mine = json.dumps({"rows": rows, "tokens": tokens}).encode() if comm.rank == 0 else b""
    got = next(p for p in comm.all_gather_bytes(mine, "the layer check") if p)
    doc = json.loads(got)
    return doc["rows"], doc["tokens"]


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
