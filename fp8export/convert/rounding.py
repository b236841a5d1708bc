"""``convert --weight-rounding gptq``: E4M3 codes chosen for the layer's output, not the weight.

The scales are decided first (per tensor with the fused group's shared max, or per channel),
exactly as for nearest rounding; then the inputs of every quantized linear are collected on
``--calib-data`` (``fp8export.calibration.hessian``) and each weight is rounded to the E4M3
grid of its scale (per tensor, per channel or per block) by GPTQ (``fp8export.numerics.gptq``).
Members of a fused group share their input, so they are rounded as one matrix. The folder
holds the same tensors and config as with nearest rounding — other E4M3 codes — so every
engine that loads one loads the other.

Every fourth calibration sample is held out of the fit: each layer keeps GPTQ's codes (at the
damping that does best there) only where they give a lower output error than nearest rounding
on those held-out tokens, else it is rounded to nearest, and convert says how many and why
(few calibration tokens — fewer than a layer's input width — make GPTQ fit noise). Layer by
layer (a streamed plan, or ``gptq-sequential``) the same samples are held out and the same
check runs on each layer before the next one loads.

The codes reach the writer through :class:`RoundedCheckpoint`, which serves each rounded weight
as its codes times its scale (float32; requantizing that gives the codes back exactly), so the
writer, the read-back and ``--accuracy-budget`` see the weights as written. The manifest's
``weight_sqnr_db`` of such a layer is measured against the source weight, and its
``output_sqnr_db`` / ``output_sqnr_db_nearest`` are the layer's output SQNR on the calibration
inputs with these codes and with nearest rounding.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from fp8export._progress import progress
from fp8export.checkpoint.source import Checkpoint
from fp8export.errors import Fp8ExportError
from fp8export.numerics.metrics import sqnr_from_sums
from fp8export.scales.select import Selection

DEFAULT_SAMPLES = 128
HOLDOUT = 4  # every fourth calibration sample checks the rounding instead of fitting it
# partial sums per input stream on the device at once: the fitted set's (log2(8 slots) + 1,
# its last slot still open) while the held-out set's run (as many, and one fold being formed)
DEVICE_PARTIALS = 9


class RoundedCheckpoint:
    """``ckpt`` with some weights replaced by their E4M3 codes times their scales (everything
    else — tensors, files, config — is the source's)."""

    def __init__(self, ckpt: Checkpoint, rounded: dict[str, tuple[Any, Any, str]],
                 block: tuple[int, int] | None = None):
        self._ckpt = ckpt
        self._rounded = rounded  # weight name -> (codes [stored layout], scale, layout)
        self.block = block  # (bn, bk) when the scales are block grids

    def __getattr__(self, name: str):
        return getattr(self._ckpt, name)

    def load(self, name: str):
        import torch

        if name not in self._rounded:
            return self._ckpt.load(name)
        codes, scale, layout = self._rounded[name]
        return codes.to(torch.float32) * _element_scales(scale, tuple(codes.shape), layout,
                                                         self.block)

    load_scratch = load

    def only(self, weights: set[str]) -> RoundedCheckpoint:
        """The same, serving rounded codes for ``weights`` only: a layer kept in high
        precision (``--accuracy-budget``) is written from the source."""
        return RoundedCheckpoint(self._ckpt, {k: v for k, v in self._rounded.items()
                                              if k in weights}, self.block)


def _element_scales(scale, shape: tuple[int, int], layout: str = "out_in",
                    block: tuple[int, int] | None = None):
    """The dequantization scale of every element of a weight of ``shape`` (stored layout):
    a broadcastable scalar, one per output channel, or a block grid expanded."""
    import torch

    s = torch.from_numpy(np.asarray(scale, dtype=np.float32))
    if block is not None:
        from fp8export.numerics.block import expand_blocks

        return expand_blocks(s, shape, block)
    if s.dim():  # per output channel
        return s.reshape(1, -1) if layout == "in_out" else s.reshape(-1, 1)
    return s


def _unit_weights(ckpt: Checkpoint, sel: Selection, members: list[str]):
    import torch

    by_module = {t.module: t for t in sel.targets}
    rows = []
    for m in members:
        t = by_module[m]
        w = ckpt.load(t.weight).to(torch.float32)
        rows.append(w.t() if t.layout == "in_out" else w)
    return rows


def _units(sel: Selection) -> list[list[str]]:
    seen: set[str] = set()
    units = []
    for t in sel.targets:
        if t.module in seen:
            continue
        members = sel.groups.get(t.fused_group, [t.module]) if t.fused_group else [t.module]
        seen.update(members)
        units.append(list(members))
    return units


class _Rounder:
    """GPTQ of one unit (a linear, or a fused group rounded as one matrix) at a time, checked
    against nearest rounding on held-out tokens where there are any, its codes on every rank
    (rank 0 rounds and broadcasts them under torchrun)."""

    def __init__(self, cfg, ckpt: Checkpoint, sel: Selection, weight_scales: dict[str, Any],
                 dev: str, comm):
        self.cfg, self.ckpt, self.sel, self.scales, self.dev = cfg, ckpt, sel, weight_scales, dev
        self.comm = comm
        self.block = cfg.block_size if str(cfg.weight_granularity) == "block" else None
        self.by_module = {t.module: t for t in sel.targets}
        self.rounded: dict[str, tuple[Any, Any, str]] = {}
        self.fields: dict[str, dict[str, Any]] = {}
        self.gains: list[float] = []
        self.fell_back: list[str] = []  # rounded to nearest: GPTQ was not better held out
        self.few_tokens: list[str] = []  # fewer calibration tokens than input channels
        self.names: set[str] | None = None

    def round(self, members: list[str], h, tokens: int, held=None, held_tokens: int = 0
              ) -> bool:
        """Round ``members`` with input matrix ``h`` (None: no input reached them, or this
        rank is not rank 0) and the held-out tokens' ``held`` (None: none); True when they got
        codes of their own (on every rank)."""
        import torch

        from fp8export.numerics.gptq import round_checked

        comm = self.comm
        rows = _unit_weights(self.ckpt, self.sel, members)
        scale = torch.cat([_element_scales(self.scales[m], tuple(r.shape), "out_in", self.block)
                           .expand(r.shape) for m, r in zip(members, rows, strict=True)])
        flag = torch.tensor([int(h is not None)])
        if comm.distributed:
            flag = comm.broadcast_tensor(flag, 0, "the rounding")
        if not int(flag[0]):
            return False  # no input reached it: nearest rounding (said in the notes)
        r = None
        if comm.rank == 0:
            w = torch.cat(rows).to(self.dev)
            r = round_checked(w, h.to(self.dev), scale.to(self.dev),
                              None if held is None else held.to(self.dev), tokens=tokens)
            codes = r.codes.cpu()
            if r.method == "nearest":
                self.fell_back.extend(members)
            if tokens < w.shape[1]:
                self.few_tokens.extend(members)
            if r.fit_chosen > 0:
                self.gains.append(r.fit_nearest / r.fit_chosen)
            del w
        else:
            codes = torch.empty((sum(x.shape[0] for x in rows), rows[0].shape[1]),
                                dtype=torch.float8_e4m3fn)
        if comm.distributed:
            codes = comm.broadcast_tensor(codes.view(torch.uint8), 0, "the GPTQ codes") \
                .view(torch.float8_e4m3fn)
        start = 0
        for m, src in zip(members, rows, strict=True):
            t = self.by_module[m]
            c = codes[start:start + src.shape[0]]
            q = c.to(torch.float32) * scale[start:start + src.shape[0]]
            start += src.shape[0]
            err = src - q
            fields = {"weight_sqnr_db": _finite(sqnr_from_sums(float((src.double() ** 2).sum()),
                                                              float((err.double() ** 2).sum()))),
                      "calibration_tokens": tokens}
            if r is not None:
                fields.update({
                    "weight_rounding": r.method,
                    "output_sqnr_db": _finite(sqnr_from_sums(r.fit_energy, r.fit_chosen)),
                    "output_sqnr_db_nearest": _finite(sqnr_from_sums(r.fit_energy,
                                                                     r.fit_nearest)),
                    "gptq_damp": r.damp, "rounding_reason": r.reason})
                if r.held_out_energy is not None:
                    fields.update({
                        "held_out_output_sqnr_db": _finite(sqnr_from_sums(
                            r.held_out_energy, r.held_out_chosen)),
                        "held_out_output_sqnr_db_nearest": _finite(sqnr_from_sums(
                            r.held_out_energy, r.held_out_nearest)),
                        "held_out_tokens": held_tokens})
            else:  # another rank: rank 0 chose the codes (its manifest has the details)
                fields["weight_rounding"] = "gptq"
            self.fields[m] = fields
            self.rounded[t.weight] = (c.t().contiguous() if t.layout == "in_out" else c,
                                      self.scales[m], t.layout)
        return True

    def fp8_layer(self, m: str, input_scale, dynamic: str, mode: str):
        """Module ``m`` as the FP8 runtime will run it from the written folder."""
        import torch

        from fp8export.runtime.fp8_linear import Fp8Linear

        t = self.by_module[m]
        codes, scale, layout = self.rounded[t.weight]
        w = codes.t().contiguous() if layout == "in_out" else codes
        bias_name = t.weight.removesuffix(".weight") + ".bias"
        if self.names is None:
            self.names = {i.name for i in self.ckpt.tensors()}
        bias = self.ckpt.load(bias_name).to(torch.bfloat16) if bias_name in self.names else None
        return Fp8Linear(w, np.asarray(scale), input_scale, bias, mode=mode,
                         out_dtype=torch.bfloat16, dynamic=dynamic, block=self.block,
                         group_size=self.block[1] if dynamic == "group" and self.block else None)


def rounding_step(cfg, ckpt: Checkpoint, sel: Selection, weight_scales: dict[str, Any],
                  notes: list[str], input_scales: dict[str, Any] | None = None
                  ) -> tuple[Any, dict[str, dict[str, Any]], dict[str, Any]]:
    """GPTQ codes of every selected weight: ``(checkpoint serving them, per-layer manifest
    fields, the manifest's weight_rounding entry)``.

    The inputs' matrices come from the whole bf16 model, or layer by layer when the plan streams
    (the same matrices) or with ``gptq-sequential`` (each layer's from the rounded layers
    before it, with their input scales ``input_scales``: None, dynamic)."""
    import torch

    from fp8export.convert.config import WeightRounding
    from fp8export.distributed import join
    from fp8export.keras_model.config import is_keras_config
    from fp8export.models import checkpoint_bytes
    from fp8export.numerics.gptq import DAMPS
    from fp8export.placement import parse_max_memory, resolve_device
    from fp8export.streaming.plan import decide

    if is_keras_config(ckpt.config):
        raise Fp8ExportError(f"{cfg.checkpoint}: --weight-rounding gptq runs the model on "
                             "--calib-data, which Keras checkpoints do not support here; use "
                             "--weight-rounding nearest.")
    t0 = time.perf_counter()
    samples = cfg.calib_samples or DEFAULT_SAMPLES
    device = resolve_device(cfg.device)
    comm = join(device)
    dev = "cuda" if torch.cuda.is_available() and str(cfg.device) != "cpu" else "cpu"
    sequential = cfg.weight_rounding is WeightRounding.GPTQ_SEQUENTIAL
    decision = decide(checkpoint_bytes(ckpt.path, 2), device, parse_max_memory(cfg.max_memory),
                      cfg.offload, comm)
    rounder = _Rounder(cfg, ckpt, sel, weight_scales, dev, comm)
    units = _units(sel)
    if decision.mode != "layers" and not sequential:
        from fp8export.calibration.hessian import input_hessians

        hess = input_hessians(ckpt.path, cfg.calib_data, sel.modules, sel.groups,
                              samples=samples, seq_len=cfg.seq_len,
                              batch_size=cfg.batch_size or 8, device=str(cfg.device),
                              holdout=HOLDOUT)
        for members in progress(units, total=len(units), desc="weight rounding: GPTQ",
                                unit="layer"):
            h, tokens = hess.of(members[0])
            held, held_tokens = hess.held_out_of(members[0])
            rounder.round(members, h, tokens, held, held_tokens)
        facts = {"samples": hess.samples, "held_out_samples": hess.held_out_samples,
                 "tokens": max(hess.tokens.values(), default=0), "passes": hess.passes,
                 "notes": hess.notes}
    else:
        facts = _round_by_layer(cfg, ckpt, sel, rounder, units, decision, samples, sequential,
                                input_scales or {}, comm)
    fields, gains, fell_back = rounder.fields, rounder.gains, rounder.fell_back
    gain_db = [10 * math.log10(g) for g in gains if math.isfinite(g) and g > 0]
    method = "gptq-sequential" if sequential else "gptq"
    held_out = facts["held_out_samples"]
    entry = {"method": method, "damp": list(DAMPS), "order": "decreasing input energy",
             "check": (f"every {HOLDOUT}th calibration sample held out; per layer the lowest "
                       "output error there among nearest and GPTQ at each damping") if held_out
             else (f"none (too few samples to hold one out): GPTQ at damping {DAMPS[0]} where "
                   "a layer's calibration tokens reach its input width, else nearest"),
             "data": cfg.calib_data.name, "samples": facts["samples"],
             "held_out_samples": held_out, "tokens": facts["tokens"],
             "passes": facts["passes"], "layers": len(fields),
             "gptq_layers": len(fields) - len(fell_back),
             "nearest_by_check": sorted(fell_back),
             "fewer_tokens_than_inputs": sorted(rounder.few_tokens),
             "nearest_layers": sorted(set(sel.modules) - set(fields)),
             "output_gain_db_median": round(float(np.median(gain_db)), 2) if gain_db else None,
             "seconds": round(time.perf_counter() - t0, 2)}
    if sequential:
        entry["inputs"] = ("each layer's from the layers before it as written (E4M3 codes, "
                           "weight and input scales), llm-compressor's sequential pipeline")
    notes.extend(facts["notes"])
    checked = f" (checked on {held_out} held-out samples)" if held_out else ""
    notes.append(f"--weight-rounding {method}: {len(fields) - len(fell_back)} of {len(fields)} "
                 f"layer(s) rounded for their output on {facts['samples']} samples of "
                 f"{cfg.calib_data.name}{checked}; median output-error gain over nearest "
                 f"rounding {entry['output_gain_db_median']} dB on the fitted data")
    if fell_back:
        few = rounder.few_tokens
        notes.append(f"warning: --weight-rounding {method}: {len(fell_back)} layer(s) rounded "
                     "to nearest, where GPTQ was not better on held-out calibration tokens"
                     + (f" ({len(few)} layer(s) had fewer calibration tokens than input "
                        "channels: give more --calib-data samples)" if few else "")
                     + f": {', '.join(sorted(fell_back)[:6])}"
                     + (" ..." if len(fell_back) > 6 else ""))
    return RoundedCheckpoint(ckpt, rounder.rounded, rounder.block), fields, entry


def _round_by_layer(cfg, ckpt: Checkpoint, sel: Selection, rounder: _Rounder, units, decision,
                    samples: int, sequential: bool, input_scales: dict[str, Any], comm
                    ) -> dict[str, Any]:
    """The matrices layer by layer (``calibration/hessian_streamed.py``), each layer rounded
    before the next one loads; with ``sequential`` the next layer's inputs come through the
    rounded layer."""
    import torch

    from fp8export._progress import info, stage
    from fp8export.calibration.hessian import held_out_split
    from fp8export.calibration.hessian_streamed import layer_hessians
    from fp8export.inputs.samples import iter_batches, load_samples
    from fp8export.models import max_positions, module_names, vocab_size
    from fp8export.runtime.fp8_model import resolve_mode
    from fp8export.streaming.parts import CheckpointParts
    from fp8export.streaming.plan import hidden_bytes, layout, spill_parent, widths
    from fp8export.streaming.stream import Stream

    device = torch.device(decision.device)
    with stage(f"reading the structure of {ckpt.path} for the weight rounding"):
        parts = CheckpointParts(ckpt.path, torch.bfloat16, experts="routed")
    with parts:
        tok_dir = ckpt.path if ckpt.path.is_dir() else None
        s = load_samples(cfg.calib_data, tok_dir, max_samples=samples, seq_len=cfg.seq_len,
                         max_positions=max_positions(parts.config),
                         vocab_size=vocab_size(parts.config))
        fitted, held_out = held_out_split(s, HOLDOUT)
        batches = list(iter_batches(fitted, cfg.batch_size or 8))
        held_batches = [] if held_out is None else \
            list(iter_batches(held_out, cfg.batch_size or 8))
        share, held_share = comm.share(len(batches)), comm.share(len(held_batches))
        # the held-out batches run last: their tokens check the rounding (input_hessians)
        mine = [batches[b] for b in share] + [held_batches[b] for b in held_share]
        hidden, width = widths(parts.config)
        names = module_names(parts.skeleton, sel.modules)
        sums, solve = _gptq_bytes(ckpt, sel, parts, units, names)

        def plan_with(extra: int):
            return layout(decision, [parts.layer_bytes(i) for i in range(parts.count)],
                          parts.rest_bytes(), hidden_bytes(mine, hidden, 2),
                          max((b.input_ids.numel() for b in mine), default=0), width, 2,
                          batches=len(mine), ranks=comm.world, passes=1, extra_bytes=extra)

        # the input matrices' partial sums stay on the device where the budget holds them
        # (one rank): copying each slot to the host and folding there took most of a layer's
        # time on a GPU
        device_sums = comm.world == 1 and device.type != "cpu"
        if device_sums:
            try:
                plan = plan_with(max(DEVICE_PARTIALS * sums, 2 * sums + solve))
            except Fp8ExportError:
                device_sums = False
        if not device_sums:
            plan = plan_with(2 * sums + solve)
        plan.per_block = 1 if sequential else comm.agree_min(plan.per_block)
        for line in plan.lines():
            info(line)
        unit_of = {u[0]: u for u in units}
        mode = resolve_mode("auto", device)
        dynamic = str(cfg.dynamic_activations or "token")

        def on_layer(i, hessians, tokens, held_h, held_tokens):
            swap = {}
            for key in sorted(k for k in unit_of if names[k].startswith(parts.prefix[i])):
                members = unit_of[key]
                if rounder.round(members, hessians.get(key), tokens.get(key, 0),
                                 held_h.get(key), held_tokens.get(key, 0)) and sequential:
                    for m in members:
                        scale = input_scales.get(m)
                        swap[names[m]] = rounder.fp8_layer(
                            m, None if scale is None else np.asarray(scale), dynamic, mode)
            return swap

        stream = Stream(parts, mine, device, tier=plan.tier,
                        spill_dir=spill_parent(cfg.resolved_output), name="gptq")
        try:
            with stage(f"embedding {len(mine)} batch(es)"):
                stream.capture()
            facts = layer_hessians(stream, sel.modules, sel.groups, names=names,
                                   per_block=plan.per_block, comm=comm, total=len(batches),
                                   first=share.start, on_layer=on_layer, sequential=sequential,
                                   held=(len(held_share), len(held_batches), held_share.start),
                                   device_sums=device_sums)
        finally:
            stream.close()
    reached = set(facts["tokens"])
    unreached = [k for k in unit_of if k not in reached]
    notes = []
    if unreached:
        notes.append(f"{len(unreached)} layer(s) received no calibration input and are rounded "
                     f"to nearest: {', '.join(unreached[:6])}"
                     + (" ..." if len(unreached) > 6 else ""))
    return {"samples": len(fitted), "tokens": max(facts["tokens"].values(), default=0),
            "passes": 2 if sequential else 1, "notes": notes, "streaming": plan.to_dict(),
            "held_out_samples": 0 if held_out is None else len(held_out)}


def _gptq_bytes(ckpt: Checkpoint, sel: Selection, parts, units: list[list[str]],
                names: dict[str, str]) -> tuple[int, int]:
    """Device memory the rounding of one layer holds beside its weights: the bytes of one
    float32 ``H`` of each of the layer's input streams (the largest layer's; the fitted and
    held-out sets each have one, and their partial sums while the batches run), and the
    largest unit's solve (``numerics/gptq.py``: ``H`` and its Cholesky factors in float64,
    about 36 bytes per element of ``H`` at the peak, and five float32 copies of the
    weight)."""
    by_module = {t.module: t for t in sel.targets}
    shapes = {i.name: tuple(i.shape) for i in ckpt.tensors()}
    per_layer: dict[int, int] = {}
    solve = 0
    for members in units:
        dims = []
        for m in members:
            t = by_module[m]
            out_, in_ = shapes[t.weight] if t.layout != "in_out" else shapes[t.weight][::-1]
            dims.append((int(out_), int(in_)))
        d = dims[0][1]
        rows = sum(o for o, _ in dims)
        i = next((i for i in range(parts.count)
                  if names[members[0]].startswith(parts.prefix[i])), -1)
        per_layer[i] = per_layer.get(i, 0) + 4 * d * d
        solve = max(solve, 36 * d * d + 20 * rows * d)
    return max(per_layer.values(), default=0), solve


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None
