"""Per-layer attribution: where does error enter? SQNR of each quantized linear's output.

Hooks on the reference model capture, for every module the FP8 model quantizes, its input
``x`` and output ``y_ref``. Two numbers per layer, over real (unpadded) tokens:

* ``sqnr_db`` (**isolated**, used for the ranking): the FP8 layer is fed the *reference's own
  input* ``x``, so ``SQNR(y_ref, fp8_layer(x))`` measures the error this layer adds by itself
  — errors of earlier layers do not compound into it. A layer whose weight scale is wrong by
  8x shows about −17 dB here however deep it sits.
* ``sqnr_e2e_db`` (**end-to-end**): the FP8 model's own output of the same layer in its full
  FP8 forward, against the reference: the error accumulated up to and including this layer.

Also recorded: ``saturated`` (fraction of input elements beyond ±448·input_scale, i.e. clipped
by a static input scale). Lower SQNR is worse; the ranking is worst-first.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics.fp8 import E4M3_MAX
from fp8export.numerics.metrics import sqnr_from_sums


class _Acc:
    __slots__ = ("signal", "noise", "noise_e2e", "saturated", "elements")

    def __init__(self):
        self.signal = self.noise = self.noise_e2e = 0.0
        self.saturated = self.elements = 0


class PerLayerProbe:
    """Attach to a reference model and an FP8 model (``Fp8Linear`` layers) that see the same
    batches; call :meth:`set_mask` before each batch's two forwards (reference first)."""

    def __init__(self, reference: torch.nn.Module, fp8_model: torch.nn.Module,
                 manifest: dict[str, Any] | None = None):
        from fp8export.runtime.fp8_model import fp8_modules

        self.fp8 = fp8_modules(fp8_model)
        if not self.fp8:
            raise Fp8ExportError("per-layer attribution found no FP8 layers in the candidate.")
        self.manifest = manifest or {}
        self.acc = {name: _Acc() for name in self.fp8}
        self._ref_out: dict[str, torch.Tensor] = {}
        self._mask: torch.Tensor | None = None
        self._handles = []
        for name in self.fp8:
            try:
                ref_mod = reference.get_submodule(name)
            except AttributeError:
                raise Fp8ExportError(f"per-layer: the reference has no module {name}; it is not "
                                     "the model the candidate was converted from.") from None
            self._handles.append(ref_mod.register_forward_hook(self._ref_hook(name)))
            self._handles.append(self.fp8[name].register_forward_hook(self._fp8_hook(name)))
        self._in_isolated = False

    def set_mask(self, attention_mask) -> None:
        m = torch.as_tensor(attention_mask)
        self._mask = m.reshape(-1) > 0
        self._ref_out.clear()

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1, t.shape[-1])
        if self._mask is not None and self._mask.numel() == flat.shape[0]:
            flat = flat[self._mask.to(flat.device)]
        return flat

    def _ref_hook(self, name):
        def hook(module, inputs, output):
            x = inputs[0]
            y_ref = self._rows(output).to(torch.float64)
            layer = self.fp8[name]
            self._in_isolated = True
            dev = layer.weight.device
            try:  # the layer's GPU current: its Triton kernels launch on the current device
                with torch.inference_mode(), (torch.cuda.device(dev) if dev.type == "cuda"
                                              else contextlib.nullcontext()):
                    y_iso = layer(x.to(dev))
            finally:
                self._in_isolated = False
            y_iso = self._rows(y_iso).to(torch.float64).to(y_ref.device)
            a = self.acc[name]
            a.signal += float((y_ref * y_ref).sum())
            a.noise += float(((y_ref - y_iso) ** 2).sum())
            if layer.input_scale is not None:
                xs = self._rows(x).float().abs()
                a.saturated += int((xs > E4M3_MAX * float(layer.input_scale)).sum())
            a.elements += self._rows(x).numel()
            self._ref_out[name] = y_ref.to(torch.float32).cpu()
        return hook

    def _fp8_hook(self, name):
        def hook(module, inputs, output):
            if self._in_isolated or name not in self._ref_out:
                return
            y = self._rows(output).to(torch.float64).cpu()
            ref = self._ref_out.pop(name).to(torch.float64)
            self.acc[name].noise_e2e += float(((ref - y) ** 2).sum())
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def result(self) -> list[dict[str, Any]]:
        """Layers ranked worst-first by isolated SQNR (JSON-serialisable; inf as a float)."""
        quantized = self.manifest.get("quantized") or {}
        rows = []
        for order, (name, a) in enumerate(self.acc.items()):
            entry = quantized.get(name, {})
            rows.append({
                "module": name, "order": order,
                "sqnr_db": sqnr_from_sums(a.signal, a.noise),
                "sqnr_e2e_db": sqnr_from_sums(a.signal, a.noise_e2e),
                "saturated": (a.saturated / a.elements) if a.elements else 0.0,
                "weight_sqnr_db": entry.get("weight_sqnr_db"),
                "weight_scale": entry.get("weight_scale"),
                "input_scale": entry.get("input_scale"),
                "static_input": self.fp8[name].input_scale is not None,
            })
        rows.sort(key=lambda r: (r["sqnr_db"], r["order"]))
        for rank, r in enumerate(rows, 1):
            r["rank"] = rank
        return rows
