"""The observation pass with layer streaming: every batch through decoder layer (block) ``i``
with that layer's observers attached, then layer ``i + 1``
(:mod:`fp8export.streaming`); the statistics are those of :func:`.observe.observe` on the whole
model, bit for bit (each observer sees the same tensors in the same order).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fp8export.calibration.observe import Observation, unmasked_note


def observe_layers(stream, modules: Sequence[str], *, method: str,
                   groups: dict[str, list[str]] | None, per_block: int, comm=None,
                   hist_rows: int | None = -1) -> Observation:
    """Statistics of ``modules`` (model names) over the batches of ``stream`` (a captured
    :class:`~fp8export.streaming.stream.Stream` of the bf16 model, experts calibrated all)."""
    import torch

    from fp8export.calibration.calibrators import get_calibrator
    from fp8export.calibration.observers import DEFAULT_HIST_ROWS, ActivationObserver
    from fp8export.streaming.stream import Blocks, each_block

    parts = stream.parts
    rows = DEFAULT_HIST_ROWS if hist_rows == -1 else hist_rows
    inside = {i: [m for m in modules if m.startswith(parts.prefix[i])]
              for i in range(parts.count)}
    outside = [m for m in modules if not any(m in ms for ms in inside.values())]
    group_list = list((groups or {}).values())
    stats: dict[str, Any] = {}
    unmasked: dict[str, int] = {}
    expert_tokens: dict[str, list[int]] = {}
    batches = stream.batches
    start = time.perf_counter()

    def observer(model, names):
        return ActivationObserver(model, names, lambda: get_calibrator(method),
                                  groups=[[m for m in g if m in set(names)] for g in group_list],
                                  hist_rows=rows)

    with Blocks(parts, per_block, stream.device, comm) as blocks:
        for _k, block in each_block(blocks, f"calibrate ({method}), layer by layer"):
            _observe_block(stream, block, inside, observer, stats, unmasked, expert_tokens)
    if outside:  # a calibrated head (--include lm_head): observed in the tail pass
        obs = observer(parts.skeleton, outside).attach()
        try:
            with stream.tail() as logits:
                for b, batch in enumerate(batches):
                    obs.begin_batch(batch.attention_mask)
                    logits(b)
                    obs.end_batch()
        finally:
            obs.detach()
        stats.update(obs.finalize())
        for m, c in obs.unmasked_calls.items():
            unmasked[m] = unmasked.get(m, 0) + c
    if stream.device.type == "cuda":
        torch.cuda.synchronize()
    return Observation(stats=stats, samples=sum(len(b) for b in batches),
                       tokens=sum(b.num_tokens for b in batches), batches=len(batches),
                       seconds=time.perf_counter() - start,
                       missing=[m for m in modules if m not in stats],
                       notes=unmasked_note(unmasked), expert_tokens=expert_tokens,
                       unmasked=unmasked)


def _observe_block(stream, block, inside, observer, stats, unmasked, expert_tokens) -> None:
    """One block: its observers attached, every batch through it, the statistics kept. A
    function of its own, so nothing of the block outlives it (the next block loads after)."""
    import torch

    from fp8export.moe import moe_modules

    parts, batches = stream.parts, stream.batches
    observers, experts = [], {}
    for i, layer in block:
        view = parts.named(i, layer)
        if inside[i]:
            observers.append(observer(view, inside[i]).attach())
        for name, m in moe_modules(view).items():
            m.token_counts = torch.zeros(m.num_experts, dtype=torch.int64)
            experts[name] = m

    def before(b):
        for obs in observers:
            obs.begin_batch(batches[b].attention_mask)
        for m in experts.values():  # routed tokens counted on real positions only
            m.count_rows = observers[0].valid_rows if observers else None

    def after(b, _out):
        for obs in observers:
            obs.end_batch()

    stream.run(block, before=before, after=after)
    for obs in observers:
        obs.detach()
        stats.update(obs.finalize())
        for m, c in obs.unmasked_calls.items():
            unmasked[m] = unmasked.get(m, 0) + c
    for name, m in experts.items():
        expert_tokens[name] = m.token_counts.tolist()
        m.token_counts = m.count_rows = None
