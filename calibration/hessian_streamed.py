"""``H = Σ xᵀx`` of linear inputs collected layer by layer (:mod:`fp8export.streaming`), each
decoder layer's matrices handed to the caller as soon as its batches have run, so the caller
rounds that layer before the next one loads.

Two variants of what the next layer sees:

* **parallel** (``--weight-rounding gptq``): every layer's inputs come from the bf16 model, as
  :func:`.hessian.input_hessians` collects them on the whole model: the same matrices, bit
  for bit (same batches, same order, same slot sums);
* **sequential** (``--weight-rounding gptq-sequential``, llm-compressor's sequential pipeline):
  after a layer is rounded, the caller gives its quantized linears as the FP8 runtime will run
  them (E4M3 codes, weight and input scales), the batches run through the layer again, and
  their outputs (with this layer's quantization error) feed the next layer's matrices. Within
  a layer every linear's ``H`` comes from the layer's inputs with the layer still in bf16.

With ``held`` batches (the stream's last ones: the held-out samples, as
:func:`.hessian.input_hessians` splits them), their tokens go into a second ``H`` per stream,
on which the caller checks the rounding, exactly as on the whole model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fp8export.calibration.hessian import InputSums, input_dim, streams, summed_tokens
from fp8export.errors import Fp8ExportError


def layer_hessians(stream, modules: list[str], groups: dict[str, list[str]], *,
                   names: dict[str, str], per_block: int, comm, total: int,
                   first: int, on_layer: Callable[..., dict[str, Any] | None],
                   sequential: bool = False, held: tuple[int, int, int] = (0, 0, 0),
                   device_sums: bool = False) -> dict[str, Any]:
    """Run ``stream`` (a captured bf16 :class:`~fp8export.streaming.stream.Stream`) through
    its layers, collecting ``H`` of the input streams of ``modules`` (checkpoint names;
    ``names`` maps them to the model's).

    ``total``: the run's batch count of fitted batches; ``first``: the global index of the
    stream's first batch (this rank's share). ``held``: ``(n, total, first)`` of the held-out
    batches, the stream's last ``n`` (none: ``(0, 0, 0)``). ``on_layer(i, hessians, tokens,
    held_hessians, held_tokens)`` gets layer ``i``'s matrices by stream key (rank 0; empty on
    the other ranks; on the stream's device with ``device_sums``, else on the host) and token
    counts (every rank) and returns,
    for ``sequential``, the model name -> module to run in place of each quantized linear of
    the layer (None: keep the layer as it is). Returns facts: streams, tokens, seconds.
    """
    from fp8export.streaming.stream import Blocks, each_block

    parts = stream.parts
    stream_of = streams(modules, groups)
    keys = sorted(set(stream_of.values()), key=modules.index)
    by_layer: dict[int, list[str]] = {}
    for k in keys:
        i = next((i for i in range(parts.count) if names[k].startswith(parts.prefix[i])), None)
        if i is None:
            raise Fp8ExportError(f"{parts.path}: {k} is outside the decoder layers; "
                                 "--weight-rounding with layer streaming rounds the layers' "
                                 "linears (exclude it, or run the model whole).")
        by_layer.setdefault(i, []).append(k)
    tokens: dict[str, int] = {}
    t0 = time.perf_counter()
    per_block = 1 if sequential else per_block
    with Blocks(parts, per_block, stream.device, comm) as blocks:
        desc = "weight rounding: " + ("sequential GPTQ" if sequential else "GPTQ") + \
            ", layer by layer"
        for _k, block in each_block(blocks, desc):
            _block(stream, block, by_layer, names, comm, total, first, on_layer, sequential,
                   tokens, held, device_sums)
    return {"streams": stream_of, "tokens": tokens, "seconds": time.perf_counter() - t0}


def _block(stream, block, by_layer, names, comm, total: int, first: int, on_layer,
           sequential: bool, tokens: dict[str, int], held: tuple[int, int, int],
           device_sums: bool) -> None:
    """One block: its matrices collected and handed over, the layer rounded in place for
    ``sequential`` and run again. A function of its own, so nothing of the block outlives it."""
    from fp8export.distributed import SlotSums

    parts, batches = stream.parts, stream.batches
    n_held, held_total, held_first = held
    n_fit = len(batches) - n_held
    layer_keys = [k for i, _ in block for k in by_layer.get(i, [])]
    fit = InputSums(SlotSums(comm, total, device_sums))
    kept = InputSums(SlotSums(comm, held_total, device_sums)) if held_total else None
    active = [fit]
    views = {i: parts.named(i, layer) for i, layer in block}
    handles = []
    dims = {}

    def hook(k):
        fns = [fit.hook(k), kept.hook(k) if kept is not None else None]
        return lambda mod, args: fns[active[0] is not fit](mod, args)

    def before(b):
        if b < n_fit:
            active[0] = fit
            fit.begin_batch(first + b, batches[b].attention_mask)
        else:
            active[0] = kept
            kept.begin_batch(held_first + b - n_fit, batches[b].attention_mask)

    for k in layer_keys:
        i = next(i for i, _ in block if names[k].startswith(parts.prefix[i]))
        mod = views[i].get_submodule(names[k])
        dims[k] = input_dim(mod, k, parts.path)
        handles.append(mod.register_forward_pre_hook(hook(k)))
    try:
        stream.run(block, before=before, write=not sequential)
    finally:
        for h in handles:
            h.remove()
    for i, _ in block:
        mine = by_layer.get(i, [])
        shapes = {k: (dims[k], dims[k]) for k in mine}
        hessians = fit.sums.total(mine, shapes)
        counted = summed_tokens(fit.tokens, mine, comm)
        held_h, held_counted = ({}, {}) if kept is None else \
            (kept.sums.total(mine, shapes), summed_tokens(kept.tokens, mine, comm))
        tokens.update(counted)
        swap = on_layer(i, hessians, counted, held_h, held_counted)
        if sequential:
            for name, module in (swap or {}).items():
                parent, _, child = name.rpartition(".")
                setattr(views[i].get_submodule(parent), child, module.to(stream.device))
    if sequential:  # the layer as it will be written gives the next one its inputs
        stream.run(block)
