"""``convert --weight-rounding gptq``: E4M3 codes chosen for the layer's output, not the weight.

The scales are decided first (per tensor with the fused group's shared max, or per channel),
exactly as for nearest rounding; then the inputs of every quantized linear are collected on
``--calib-data`` (``fp8export.calibration.hessian``) and each weight is rounded to the E4M3
grid of its scale by GPTQ (``fp8export.numerics.gptq``). Members of a fused group share their
input and their scale, so they are rounded as one matrix. The folder holds the same tensors and
config as with nearest rounding — other E4M3 codes — so every engine that loads one loads the
other.

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


class RoundedCheckpoint:
    """``ckpt`` with some weights replaced by their E4M3 codes times their scales (everything
    else — tensors, files, config — is the source's)."""

    def __init__(self, ckpt: Checkpoint, rounded: dict[str, tuple[Any, Any, str]]):
        self._ckpt = ckpt
        self._rounded = rounded  # weight name -> (codes [stored layout], scale, layout)

    def __getattr__(self, name: str):
        return getattr(self._ckpt, name)

    def load(self, name: str):
        import torch

        if name not in self._rounded:
            return self._ckpt.load(name)
        codes, scale, layout = self._rounded[name]
        s = torch.from_numpy(np.asarray(scale, dtype=np.float32))
        if s.dim():  # per output channel
            s = s.reshape(1, -1) if layout == "in_out" else s.reshape(-1, 1)
        return codes.to(torch.float32) * s

    load_scratch = load

    def only(self, weights: set[str]) -> RoundedCheckpoint:
        """The same, serving rounded codes for ``weights`` only: a layer kept in high
        precision (``--accuracy-budget``) is written from the source."""
        return RoundedCheckpoint(self._ckpt, {k: v for k, v in self._rounded.items()
                                              if k in weights})


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
    from fp8export.numerics.gptq import DAMP, gptq_round

    if is_keras_config(ckpt.config):
        raise Fp8ExportError(f"{cfg.checkpoint}: --weight-rounding gptq runs the model on "
                             "--calib-data, which Keras checkpoints do not support here; use "
                             "--weight-rounding nearest.")
    t0 = time.perf_counter()
    samples = cfg.calib_samples or DEFAULT_SAMPLES
    hess = input_hessians(ckpt.path, cfg.calib_data, sel.modules, sel.groups, samples=samples,
                          seq_len=cfg.seq_len, batch_size=cfg.batch_size or 8,
                          device=str(cfg.device))
    dev = "cuda" if torch.cuda.is_available() and str(cfg.device) != "cpu" else "cpu"
    by_module = {t.module: t for t in sel.targets}
    rounded: dict[str, tuple[Any, Any, str]] = {}
    fields: dict[str, dict[str, Any]] = {}
    gains = []
    units = _units(sel)
    for members in progress(units, total=len(units), desc="weight rounding: GPTQ",
                            unit="layer"):
        h, tokens = hess.of(members[0])
        if h is None:
            continue  # no input reached it: nearest rounding (said in the notes)
        rows = _unit_weights(ckpt, sel, members)
        scales = [np.asarray(weight_scales[m], dtype=np.float32) for m in members]
        if scales[0].ndim:  # per channel: each member's rows keep their own scales
            scale = torch.from_numpy(np.concatenate([s.reshape(-1) for s in scales]))
        else:  # per tensor: the fused group's shared scale
            scale = torch.tensor(float(scales[0]))
        w = torch.cat(rows).to(dev)
        r = gptq_round(w, h.to(dev), scale.to(dev))
        codes = r.codes.cpu()
        gains.append(r.error_nearest / r.error_rounded if r.error_rounded > 0 else math.inf)
        start = 0
        for m, src in zip(members, rows, strict=True):
            t = by_module[m]
            c = codes[start:start + src.shape[0]]
            q = c.to(torch.float32) * (scale[start:start + src.shape[0], None]
                                       if scale.dim() else scale)
            start += src.shape[0]
            err = src - q
            fields[m] = {
                "weight_rounding": "gptq",
                "weight_sqnr_db": _finite(sqnr_from_sums(float((src.double() ** 2).sum()),
                                                         float((err.double() ** 2).sum()))),
                "output_sqnr_db": _finite(sqnr_from_sums(r.output_energy, r.error_rounded)),
                "output_sqnr_db_nearest": _finite(sqnr_from_sums(r.output_energy,
                                                                 r.error_nearest)),
                "calibration_tokens": tokens}
            rounded[t.weight] = (c.t().contiguous() if t.layout == "in_out" else c,
                                 weight_scales[m], t.layout)
        del w, rows
    gain_db = [10 * math.log10(g) for g in gains if math.isfinite(g) and g > 0]
    entry = {"method": "gptq", "damp": DAMP, "order": "decreasing input energy",
             "data": cfg.calib_data.name, "samples": hess.samples,
             "tokens": max(hess.tokens.values(), default=0), "passes": hess.passes,
             "layers": len(fields), "nearest_layers": sorted(set(sel.modules) - set(fields)),
             "output_gain_db_median": round(float(np.median(gain_db)), 2) if gain_db else None,
             "seconds": round(time.perf_counter() - t0, 2)}
    notes.extend(hess.notes)
    notes.append(f"--weight-rounding gptq: {len(fields)} layer(s) rounded for their output on "
                 f"{hess.samples} samples of {cfg.calib_data.name}; median output-error gain "
                 f"over nearest rounding {entry['output_gain_db_median']} dB on that data")
    return RoundedCheckpoint(ckpt, rounded), fields, entry


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None
