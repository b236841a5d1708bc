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
(few calibration tokens — fewer than a layer's input width — make GPTQ fit noise).

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


def rounding_step(cfg, ckpt: Checkpoint, sel: Selection, weight_scales: dict[str, Any],
                  notes: list[str]) -> tuple[Any, dict[str, dict[str, Any]], dict[str, Any]]:
    """GPTQ codes of every selected weight: ``(checkpoint serving them, per-layer manifest
    fields, the manifest's weight_rounding entry)``."""
    import torch

    from fp8export.calibration.hessian import input_hessians
    from fp8export.keras_model.config import is_keras_config
    from fp8export.numerics.gptq import DAMPS, round_checked

    if is_keras_config(ckpt.config):
        raise Fp8ExportError(f"{cfg.checkpoint}: --weight-rounding gptq runs the model on "
                             "--calib-data, which Keras checkpoints do not support here; use "
                             "--weight-rounding nearest.")
    t0 = time.perf_counter()
    samples = cfg.calib_samples or DEFAULT_SAMPLES
    block = cfg.block_size if str(cfg.weight_granularity) == "block" else None
    hess = input_hessians(ckpt.path, cfg.calib_data, sel.modules, sel.groups, samples=samples,
                          seq_len=cfg.seq_len, batch_size=cfg.batch_size or 8,
                          device=str(cfg.device), holdout=HOLDOUT)
    dev = "cuda" if torch.cuda.is_available() and str(cfg.device) != "cpu" else "cpu"
    by_module = {t.module: t for t in sel.targets}
    rounded: dict[str, tuple[Any, Any, str]] = {}
    fields: dict[str, dict[str, Any]] = {}
    gains = []
    fell_back: list[str] = []
    few_tokens: list[str] = []
    units = _units(sel)
    for members in progress(units, total=len(units), desc="weight rounding: GPTQ",
                            unit="layer"):
        h, tokens = hess.of(members[0])
        if h is None:
            continue  # no input reached it: nearest rounding (said in the notes)
        hv, held_tokens = hess.held_out_of(members[0])
        rows = _unit_weights(ckpt, sel, members)
        scale = torch.cat([_element_scales(weight_scales[m], tuple(r.shape), "out_in", block)
                           .expand(r.shape) for m, r in zip(members, rows, strict=True)])
        w = torch.cat(rows).to(dev)
        r = round_checked(w, h.to(dev), scale.to(dev), None if hv is None else hv.to(dev),
                          tokens=tokens)
        codes = r.codes.cpu()
        if r.method == "nearest":
            fell_back.extend(members)
        if tokens < w.shape[1]:
            few_tokens.extend(members)
        if r.fit_chosen > 0:
            gains.append(r.fit_nearest / r.fit_chosen)
        start = 0
        for m, src in zip(members, rows, strict=True):
            t = by_module[m]
            c = codes[start:start + src.shape[0]]
            q = c.to(torch.float32) * scale[start:start + src.shape[0]]
            start += src.shape[0]
            err = src - q
            fields[m] = {
                "weight_rounding": r.method,
                "weight_sqnr_db": _finite(sqnr_from_sums(float((src.double() ** 2).sum()),
                                                         float((err.double() ** 2).sum()))),
                "output_sqnr_db": _finite(sqnr_from_sums(r.fit_energy, r.fit_chosen)),
                "output_sqnr_db_nearest": _finite(sqnr_from_sums(r.fit_energy, r.fit_nearest)),
                **({"held_out_output_sqnr_db": _finite(sqnr_from_sums(r.held_out_energy,
                                                                      r.held_out_chosen)),
                    "held_out_output_sqnr_db_nearest": _finite(sqnr_from_sums(
                        r.held_out_energy, r.held_out_nearest))}
                   if r.held_out_energy is not None else {}),
                "gptq_damp": r.damp, "rounding_reason": r.reason,
                "calibration_tokens": tokens, "held_out_tokens": held_tokens}
            rounded[t.weight] = (c.t().contiguous() if t.layout == "in_out" else c,
                                 weight_scales[m], t.layout)
        del w, rows, scale
    gain_db = [10 * math.log10(g) for g in gains if math.isfinite(g) and g > 0]
    entry = {"method": "gptq", "damp": list(DAMPS), "order": "decreasing input energy",
             "check": f"every {HOLDOUT}th calibration sample held out; per layer the lowest "
                      "output error there among nearest and GPTQ at each damping",
             "data": cfg.calib_data.name, "samples": hess.samples,
             "held_out_samples": hess.held_out_samples,
             "tokens": max(hess.tokens.values(), default=0), "passes": hess.passes,
             "layers": len(fields), "gptq_layers": len(fields) - len(fell_back),
             "nearest_by_check": sorted(fell_back),
             "fewer_tokens_than_inputs": sorted(few_tokens),
             "nearest_layers": sorted(set(sel.modules) - set(fields)),
             "output_gain_db_median": round(float(np.median(gain_db)), 2) if gain_db else None,
             "seconds": round(time.perf_counter() - t0, 2)}
    notes.extend(hess.notes)
    notes.append(f"--weight-rounding gptq: {len(fields) - len(fell_back)} of {len(fields)} "
                 f"layer(s) rounded for their output on {hess.samples} samples of "
                 f"{cfg.calib_data.name} (checked on {hess.held_out_samples} held-out "
                 f"samples); median output-error gain over nearest rounding "
                 f"{entry['output_gain_db_median']} dB on the fitted data")
    if fell_back:
        notes.append(f"warning: --weight-rounding gptq: {len(fell_back)} layer(s) rounded to "
                     "nearest, where GPTQ was not better on held-out calibration tokens"
                     + (f" ({len(few_tokens)} layer(s) had fewer calibration tokens than "
                        "input channels: give more --calib-data samples)" if few_tokens else "")
                     + f": {', '.join(sorted(fell_back)[:6])}"
                     + (" ..." if len(fell_back) > 6 else ""))
    return RoundedCheckpoint(ckpt, rounded, block), fields, entry


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None
