"""Second moments of linear inputs, ``H = Σ x xᵀ`` over calibration tokens, for error-
compensating weight rounding (``fp8export.numerics.gptq``).

One forward pre-hook per input stream (members of a fused group — q/k/v, gate/up — share their
input and so one ``H``) adds ``xᵀ x`` of the batch's real tokens (padding dropped with the
attention mask) in float32 on the layer's device. ``H`` is ``in × in`` per stream; when the
streams of a model do not fit :data:`BUDGET_BYTES` at once they are collected in several
passes over the data, each holding a share. MoE experts run routed (each expert sees the
tokens the router gives it, as it will when served); an expert no token reached gets no ``H``.

With ``holdout``, every ``holdout``-th sample (the last one of every ``holdout``) is held out:
its tokens go into a second ``H`` per stream, on which the rounding is checked
(``fp8export.numerics.gptq.round_checked``); the others are fitted.

The batches add into the partial sum of their slot (``fp8export.distributed.SlotSums``: fixed
slices of the batches folded in one fixed tree), so the matrices are the same bits whether one
process or several (torchrun, each on its share of the batches) collected them, and whether
the model ran whole or layer by layer (``calibration/hessian_streamed.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8export._progress import progress, stage
from fp8export.errors import Fp8ExportError

BUDGET_BYTES = 2 << 30  # float32 H matrices held at once; more streams take more passes


@dataclass
class Hessians:
    """``H`` and its token count per input stream, keyed by the stream's first module (the
    checkpoint's name); ``stream`` maps every module to that key."""

    hessian: dict[str, Any]
    tokens: dict[str, int]
    stream: dict[str, str]
    samples: int = 0
    passes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    held_out: dict[str, Any] = field(default_factory=dict)  # H of the held-out samples
    held_out_tokens: dict[str, int] = field(default_factory=dict)
    held_out_samples: int = 0

    def of(self, module: str):
        """``(H, tokens)`` of the stream feeding ``module``, or ``(None, 0)``."""
        key = self.stream.get(module, module)
        return self.hessian.get(key), self.tokens.get(key, 0)

    def held_out_of(self, module: str):
        """``(H, tokens)`` of the held-out samples' inputs of ``module``, or ``(None, 0)``."""
        key = self.stream.get(module, module)
        return self.held_out.get(key), self.held_out_tokens.get(key, 0)


def held_out_indices(n: int, every: int) -> set[int]:
    """The samples held out of ``n``: the last of every ``every`` (at least one when there are
    two or more samples, none with ``every`` 0)."""
    if every <= 0 or n < 2:
        return set()
    return {i for i in range(n) if i % every == every - 1} or {n - 1}


def held_out_split(s, every: int):
    """``(fitted, held_out)``: the samples ``s`` without and with the held-out ones
    (:func:`held_out_indices`; ``held_out`` None when none are held out)."""
    from dataclasses import replace

    held = held_out_indices(len(s), every)

    def part(keep):
        idx = [i for i in range(len(s)) if keep(i)]
        return replace(s, input_ids=tuple(s.input_ids[i] for i in idx),
                       labels=None if s.labels is None else tuple(s.labels[i] for i in idx))

    return part(lambda i: i not in held), (part(lambda i: i in held) if held else None)


def _passes(keys: list[str], dims: dict[str, int], budget: int) -> list[list[str]]:
    out: list[list[str]] = [[]]
    used = 0
    for k in keys:
        size = 4 * dims[k] ** 2
        if out[-1] and used + size > budget:
            out.append([])
            used = 0
        out[-1].append(k)
        used += size
    return out


class InputSums:
    """The pre-hooks that add ``xᵀ x`` of each stream's real tokens into ``sums`` (call
    :meth:`begin_batch` before each batch); tokens counted per stream."""

    def __init__(self, sums):
        self.sums = sums
        self.tokens: dict[str, int] = {}
        self.rows = self.shape = None

    def begin_batch(self, b: int, mask) -> None:
        """Global batch ``b`` with attention mask ``mask`` ([B, T]) comes next."""
        import torch

        self.sums.begin_batch(b)
        flat = mask.reshape(-1) != 0
        self.rows = None if bool(flat.all()) else torch.nonzero(flat).reshape(-1)
        self.shape = tuple(mask.shape)

    def hook(self, key: str):
        import torch

        def fn(_mod, args):
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1])
            if self.rows is not None and tuple(x.shape[:2]) == self.shape:
                x2 = x2[self.rows.to(x2.device)]
            if x2.shape[0] == 0:
                return
            x2 = x2.to(torch.float32)
            h = self.sums.accumulator(key, x2.new_empty((x2.shape[1], x2.shape[1])))
            h.addmm_(x2.t(), x2)
            self.tokens[key] = self.tokens.get(key, 0) + int(x2.shape[0])
        return fn


def streams(modules: list[str], groups: dict[str, list[str]]) -> dict[str, str]:
    """Every module -> the key of its input stream (a fused group's first present member)."""
    stream = {m: m for m in modules}
    for members in groups.values():
        present = [m for m in members if m in stream]
        for m in present:
            stream[m] = present[0]
    return stream


def input_dim(mod, key: str, checkpoint) -> int:
    """The input width of linear ``mod`` (GPT-2's Conv1D stores [in, out])."""
    w = getattr(mod, "weight", None)
    if w is None or w.dim() != 2:
        raise Fp8ExportError(f"{checkpoint}: {key} has no 2-D weight; --weight-rounding "
                             "needs linear layers.")
    return int(w.shape[0] if type(mod).__name__ == "Conv1D" else w.shape[1])


def summed_tokens(tokens: dict[str, int], keys: list[str], comm) -> dict[str, int]:
    """Token counts per key summed over the ranks (keys no rank saw are left out)."""
    import torch

    got = comm.sum_ints(torch.tensor([tokens.get(k, 0) for k in keys] or [0],
                                     dtype=torch.int64), "token counts").tolist()
    return {k: int(n) for k, n in zip(keys, got, strict=False) if n}


def input_hessians(checkpoint: Path, data: Path, modules: list[str],
                   groups: dict[str, list[str]], *, samples: int, seq_len: int | None,
                   batch_size: int, device: str = "auto", budget: int = BUDGET_BYTES,
                   holdout: int = 0) -> Hessians:
    """``H`` of the inputs of ``modules`` (checkpoint names) on ``samples`` samples of
    ``data``, run through the bf16 model on ``device``; with ``holdout`` the held-out samples'
    ``H`` apart (module doc). Under torchrun each rank runs its share of the batches and rank 0
    gets the sums (the others: empty ``hessian``)."""
    import torch

    from fp8export._threads import fit_torch
    from fp8export.calibration.observe import forward_fn
    from fp8export.distributed import SlotSums, join
    from fp8export.inputs.samples import iter_batches, load_samples
    from fp8export.models import load_model_placed, max_positions, module_names, vocab_size
    from fp8export.moe import unfuse_experts
    from fp8export.placement import resolve_device

    fit_torch()
    dev = resolve_device(device)
    comm = join(dev)
    with stage(f"loading the bf16 model {checkpoint} for the weight rounding ({dev})"):
        model, config, _ = load_model_placed(checkpoint, dev, None, dtype=torch.bfloat16)
        unfuse_experts(model)  # experts see their routed tokens
    tok_dir = checkpoint if checkpoint.is_dir() else None
    s = load_samples(data, tok_dir, max_samples=samples, seq_len=seq_len,
                     max_positions=max_positions(config), vocab_size=vocab_size(config))
    fitted, held_out = held_out_split(s, holdout)
    parts = [(fitted, False)] + ([(held_out, True)] if held_out is not None else [])
    names = module_names(model, modules)
    stream = streams(modules, groups)
    keys = sorted(set(stream.values()), key=modules.index)
    dims = {}
    for k in keys:
        try:
            mod = model.get_submodule(names[k])
        except AttributeError:
            raise Fp8ExportError(f"{checkpoint}: no module {k} to collect inputs of for "
                                 "--weight-rounding.") from None
        dims[k] = input_dim(mod, k, checkpoint)
    plan = _passes(keys, dims, budget // len(parts))
    forward = forward_fn(model, [names[k] for k in keys])
    batched = [(list(iter_batches(p, batch_size)), is_held) for p, is_held in parts]
    hessian: dict[str, Any] = {}
    tokens: dict[str, int] = {}
    held_h: dict[str, Any] = {}
    held_tokens: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, share in enumerate(plan):
        desc = "weight rounding: collecting inputs" + (f" ({i + 1}/{len(plan)})"
                                                         if len(plan) > 1 else "")
        for batches, is_held in batched:
            sums = InputSums(SlotSums(comm, len(batches)))
            handles = [model.get_submodule(names[k]).register_forward_pre_hook(sums.hook(k))
                       for k in share]
            mine = comm.share(len(batches))
            try:
                for b in progress(mine, total=len(mine),
                                  desc=desc + (" (held out)" if is_held else ""), unit="batch"):
                    sums.begin_batch(b, batches[b].attention_mask)
                    forward(batches[b], dev)
            finally:
                for h in handles:
                    h.remove()
            # on the host between passes (rank 0): the device holds one pass's share
            into, count = (held_h, held_tokens) if is_held else (hessian, tokens)
            into.update(sums.sums.total(share, {k: (dims[k], dims[k]) for k in share}))
            count.update(summed_tokens(sums.tokens, share, comm))
    notes = []
    unreached = [k for k in keys if k not in tokens]
    if unreached:
        notes.append(f"{len(unreached)} layer(s) received no calibration input and are rounded "
                     f"to nearest: {', '.join(unreached[:6])}"
                     + (" ..." if len(unreached) > 6 else ""))
    return Hessians(hessian, tokens, stream, samples=len(fitted), passes=len(plan),
                    seconds=time.perf_counter() - t0, notes=notes, held_out=held_h,
                    held_out_tokens=held_tokens,
                    held_out_samples=0 if held_out is None else len(held_out))
