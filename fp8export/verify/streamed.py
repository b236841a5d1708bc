"""verify with layer streaming: the reference, the FP8 candidate and the fp32 reference of the
noise floor each stream their hidden states through their own layers, block by block (the
reference's block, then the candidate's, then the floor's, so one block is on the device at a
time); at the end every batch's logits come from each model's final norm and head and go to the
same comparison as in the whole-model run, which they equal bit for bit. A candidate that does
not stream (an ONNX graph, an engine) runs batch by batch at the end, beside them.
"""

from __future__ import annotations

import time
from typing import Any

from fp8export._progress import info, stage
from fp8export.verify.load import Inputs, Session


def compare_streamed(session: Session, inputs: Inputs, batches: list, acc) -> Any:
    """The streamed counterpart of :func:`fp8export.verify.compare.compare` over ``batches``
    (this rank's share); ``acc`` its :class:`~fp8export.verify.compare.Accumulator`."""
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
    plan = streamed_plan(session, batches)
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
    try:
        with stage(f"embedding {len(batches)} batch(es) in {len(streams)} model(s)"):
            for _, _, st in streams:
                st.capture()
        blocks = [Blocks(r.parts, plan.per_block, device, None) for _, r, _ in streams]
        try:
            _run_layers(streams, blocks, seconds, comm, moe_modules, device)
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
    return acc.finish(None, {"reference_s": seconds["reference"], "candidate_s": cand_s,
                             "floor_s": seconds.get(FLOOR_DTYPE, 0.0)})


def streamed_runners(session: Session) -> list[tuple[str, Any]]:
    """``(name, runner)`` of every streamed model: the reference, the candidate when it
    streams, the fp32 reference of the noise floor."""
    from fp8export.verify.noise_floor import FLOOR_DTYPE

    runners = [("reference", session.reference)]
    if getattr(session.candidate, "parts", None) is not None:
        runners.append(("candidate", session.candidate))
    if session.floor is not None:
        runners.append((FLOOR_DTYPE, session.floor))
    return runners


def streamed_plan(session: Session, batches: list):
    """The plan of a streamed verify over ``batches``: the largest of the models' layers, every
    stream's hidden states, the heads of all of them at the end (agreed by the ranks)."""
    from fp8export.distributed import current
    from fp8export.streaming.plan import hidden_bytes, layout, widths

    comm = current()
    runners = streamed_runners(session)
    hidden, width = widths(session.reference.parts.config)
    count = min(r.parts.count for _, r in runners)
    vocab = int(session.reference.config.get("vocab_size") or 0)
    tokens = max((b.input_ids.numel() for b in batches), default=0)
    plan = layout(session.decision,
                  [max(r.parts.layer_bytes(i) for _, r in runners) for i in range(count)],
                  sum(r.parts.rest_bytes() for _, r in runners),
                  sum(hidden_bytes(batches, hidden, r.dtype.itemsize) for _, r in runners),
                  tokens, width, 4, batches=len(batches), ranks=comm.world,
                  logits_bytes=tokens * vocab * 4 * (len(runners) + 1))
    plan.per_block = comm.agree_min(plan.per_block)
    return plan


def _run_layers(streams, blocks, seconds, comm, moe_modules, device) -> None:
    import torch

    from fp8export._progress import progress

    n = len(blocks[0])
    for k in progress(range(n), total=n, desc="comparing, layer by layer", unit="block"):
        for (name, runner, stream), bl in zip(streams, blocks, strict=True):
            t0 = time.perf_counter()
            _run_block(bl, k, stream, getattr(runner.parts, "expert_gemms", None), moe_modules)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[name] += time.perf_counter() - t0
        comm.check(f"layer block {k + 1} of {n}")


def _run_block(blocks, k: int, stream, gemms, moe_modules) -> None:
    """One model's block ``k`` through its stream (a function, so the block dies with it);
    the experts' GEMMs counted by weight dtype, as the whole run counts them."""
    built = blocks.build(k)
    stream.run(built)
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
