"""verify with layer streaming: the reference, the FP8 candidate and the fp32 reference of the
noise floor each stream their hidden states through their own layers, block by block (the
reference's block, then the candidate's, then the floor's, so one block is on the device at a
time); at the end every batch's logits come from each model's final norm and head and go to the
same comparison as in the whole-model run, which they equal bit for bit. A candidate that does
not stream (an ONNX graph, an engine) runs batch by batch at the end, beside them.

The layer check runs here too: for each block the candidate's layers are built before the
reference's block runs, and the per-layer probe (``analysis/per_layer.py``) feeds each FP8
layer the reference layer's own input on the block's first check tokens, as the whole run
does (one candidate block more on the device while the reference's runs).
"""

from __future__ import annotations

import time
from typing import Any

from fp8export._progress import info, stage
from fp8export.verify.load import Inputs, Session


def compare_streamed(session: Session, inputs: Inputs, batches: list, acc,
                     layer_check: bool = False) -> Any:
    """The streamed counterpart of :func:`fp8export.verify.compare.compare` over ``batches``
    (this rank's share); ``acc`` its :class:`~fp8export.verify.compare.Accumulator`;
    ``layer_check``: each quantized layer's isolated SQNR (``verify/layer_check.py``)."""
    import torch

    from fp8export.distributed import current
    from fp8export.moe import moe_modules
    from fp8export.streaming.plan import spill_parent
    from fp8export.streaming.stream import Blocks, Stream
    from fp8export.verify.compare import first_output
    from fp8export.verify.metrics import class_logits
    from fp8export.verify.noise_floor import FLOOR_DTYPE

    cfg, comm = session.cfg, current()
    runners = streamed_runners(session)
    device = torch.device(session.reference.device)
    plan = streamed_plan(session, batches, layer_check)
    for line in plan.lines():
        info(line)
    for _, r in runners:
        r.streaming = plan.to_dict()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    streams = [(name, r, Stream(r.parts, batches, device, tier=plan.tier,
                                spill_dir=spill_parent(cfg.report_dir), name=name))
               for name, r in runners]
    seconds = {name: 0.0 for name, _ in runners}
    streams_candidate = any(name == "candidate" for name, _ in runners)
    # under torchrun rank 0 measures the layers on its share (the run's first batches) and
    # every rank judges its rows
    check = _LayerCheck(session.candidate) if layer_check and streams_candidate \
        and comm.rank == 0 else None
    try:
        with stage(f"embedding {len(batches)} batch(es) in {len(streams)} model(s)"):
            for _, _, st in streams:
                st.capture()
        blocks = [Blocks(r.parts, plan.per_block, device, None) for _, r, _ in streams]
        try:
            _run_layers(streams, blocks, seconds, comm, moe_modules, device, check)
        finally:
            for b in blocks:
                b.close()
        _tails(session, inputs, batches, streams, acc, seconds, class_logits, first_output)
    finally:
        for _, _, st in streams:
            st.close()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        for _, r in runners:
            r.streaming = {**plan.to_dict(), "peak_device_bytes": peak}
    notes = session.notes
    if cfg.per_layer:
        notes.append("--per-layer needs the whole model in memory; with layer streaming it was "
                     "not measured.")
    cand_s = seconds.get("candidate", seconds.get("candidate_batches", 0.0))
    measured = acc.finish(None, {"reference_s": seconds["reference"], "candidate_s": cand_s,
                                 "floor_s": seconds.get(FLOOR_DTYPE, 0.0)})
    if check is not None:
        measured.layers, measured.layer_tokens = check.result(), check.tokens
    if comm.distributed and layer_check and streams_candidate:
        from fp8export.verify.compare import from_rank0

        measured.layers, measured.layer_tokens = from_rank0(comm, measured.layers,
                                                            measured.layer_tokens)
    return measured


class _LayerCheck:
    """The layer check block by block: a per-layer probe on each layer of the reference's block
    against the same layer of the candidate's, on the first check tokens of the batches."""

    def __init__(self, candidate):
        self.manifest = candidate.manifest or {}
        self.rows: list[dict[str, Any]] = []
        self.tokens = 0

    def probes(self, ref_parts, ref_block, cand_parts, cand_block) -> list:
        from fp8export.analysis.per_layer import PerLayerProbe
        from fp8export.errors import Fp8ExportError
        from fp8export.runtime.fp8_model import fp8_modules
        from fp8export.verify.layer_check import CHECK_TOKENS

        out = []
        for (i, ref), (j, cand) in zip(ref_block, cand_block, strict=True):
            if i != j:
                raise Fp8ExportError(f"internal: the reference's block holds layer {i} where "
                                     f"the candidate's holds {j}.")
            cand_view = cand_parts.named(j, cand)
            if fp8_modules(cand_view):  # a layer kept whole in high precision has none
                out.append(PerLayerProbe(ref_parts.named(i, ref), cand_view, self.manifest,
                                         end_to_end=False, max_tokens=CHECK_TOKENS))
        return out

    def add(self, probes: list) -> None:
        for probe in probes:
            for row in probe.result():
                self.rows.append({**row, "order": len(self.rows)})
            self.tokens = max(self.tokens, probe.tokens)
            probe.close()

    def result(self) -> list[dict[str, Any]]:
        """Rows as :meth:`PerLayerProbe.result` gives them, worst first over every block."""
        import math

        rows = sorted(self.rows, key=lambda r: (r["sqnr_db"] is None, math.inf
                                                if r["sqnr_db"] is None else r["sqnr_db"],
                                                r["order"]))
        for rank, r in enumerate(rows, 1):
            r["rank"] = rank
        return rows


def streamed_runners(session: Session) -> list[tuple[str, Any]]:
    """``(name, runner)`` of every streamed model: the reference, the candidate when it
    streams, the fp32 reference of the noise floor."""
    from fp8export.verify.noise_floor import FLOOR_DTYPE

    runners = [("reference", session.reference)]
    if session.candidate.parts is not None:
        runners.append(("candidate", session.candidate))
    if session.floor is not None:
        runners.append((FLOOR_DTYPE, session.floor))
    return runners


def streamed_plan(session: Session, batches: list, layer_check: bool = True):
    """The plan of a streamed verify over ``batches``: the largest of the models' layers (with
    ``layer_check`` and a streamed candidate, the reference's and the candidate's together:
    both are on the device while the reference's runs), every stream's hidden states, the
    heads of all of them at the end (agreed by the ranks)."""
    from fp8export.distributed import current
    from fp8export.streaming.plan import hidden_bytes, layout, widths

    comm = current()
    runners = streamed_runners(session)
    hidden, width = widths(session.reference.parts.config)
    count = min(r.parts.count for _, r in runners)
    vocab = int(session.reference.config.get("vocab_size") or 0)
    tokens = max((b.input_ids.numel() for b in batches), default=0)
    by_name = dict(runners)
    pair = ("reference", "candidate") if layer_check and "candidate" in by_name else ()

    def held(i: int) -> int:
        return max(max(r.parts.layer_bytes(i) for _, r in runners),
                   sum(by_name[n].parts.layer_bytes(i) for n in pair))

    plan = layout(session.decision, [held(i) for i in range(count)],
                  sum(r.parts.rest_bytes() for _, r in runners),
                  sum(hidden_bytes(batches, hidden, r.dtype.itemsize) for _, r in runners),
                  tokens, width, 4, batches=len(batches), ranks=comm.world,
                  logits_bytes=tokens * vocab * 4 * (len(runners) + 1))
    plan.per_block = comm.agree_min(plan.per_block)
    return plan


def _run_layers(streams, blocks, seconds, comm, moe_modules, device, check=None) -> None:
    import torch

    from fp8export._progress import progress

    n = len(blocks[0])
    names = [name for name, _, _ in streams]
    for k in progress(range(n), total=n, desc="comparing, layer by layer", unit="block"):
        built: dict[str, list] = {}
        probes: list = []
        if check is not None:  # the candidate's layers first: the probe feeds them
            c = names.index("candidate")
            built["candidate"] = blocks[c].build(k)
        for (name, runner, stream), bl in zip(streams, blocks, strict=True):
            t0 = time.perf_counter()
            block = built.pop(name, None) or bl.build(k)
            before = None
            if check is not None and name == "reference":
                c = names.index("candidate")
                probes = check.probes(runner.parts, block, streams[c][1].parts,
                                      built["candidate"])

                def before(b, batches=stream.batches, probes=probes):
                    for p in probes:
                        if p.active:
                            p.set_mask(batches[b].attention_mask)
            parts = runner.parts
            _run_block(block, stream, getattr(parts, "expert_gemms", None), moe_modules, before)
            if probes and name == "reference":
                check.add(probes)
                probes = []
            del block
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[name] += time.perf_counter() - t0
        comm.check(f"layer block {k + 1} of {n}")


def _run_block(built, stream, gemms, moe_modules, before=None) -> None:
    """One model's built block through its stream; the experts' GEMMs counted by weight
    dtype, as the whole run counts them."""
    stream.run(built, before=before)
    if gemms is not None:
        for _i, layer in built:
            for m in moe_modules(layer).values():
                for key, v in m.gemms.items():
                    gemms[key] = gemms.get(key, 0) + v


def _tails(session, inputs, batches, streams, acc, seconds, class_logits, first_output) -> None:
    """Each batch's logits from every stream's final norm and head, compared."""
    import contextlib

    head = inputs.head
    by_name = {name: st for name, _, st in streams}
    with contextlib.ExitStack() as stack:
        tails = {name: stack.enter_context(st.tail()) for name, st in by_name.items()}
        for b, batch in enumerate(batches):
            out = {}
            for name, tail in tails.items():
                t0 = time.perf_counter()
                logits = first_output(_as_dict(tail(b)), f"the {name}")
                out[name] = class_logits(logits.float().cpu().numpy(), head)
                seconds[name] += time.perf_counter() - t0
            if "candidate" not in out:  # a graph or engine: batch by batch
                feed = {"input_ids": batch.input_ids.numpy(),
                        "attention_mask": batch.attention_mask.numpy()}
                cand = session.candidate
                out["candidate"] = class_logits(first_output(cand.infer(feed),
                                                             "the candidate"), head)
                seconds["candidate_batches"] = seconds.get("candidate_batches", 0.0) + \
                    (cand.last_inference_time or 0.0)
            floor = next((v for k, v in out.items() if k not in ("reference", "candidate")),
                         None)
            acc.add(batch, out["reference"], out["candidate"], floor)


def _as_dict(out) -> dict:
    if hasattr(out, "logits"):
        return {"logits": out.logits}
    if isinstance(out, dict):
        return out
    return {"logits": out[0] if isinstance(out, tuple) else out}
