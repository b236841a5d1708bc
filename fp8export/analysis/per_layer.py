"""Per-layer attribution: where does error enter? SQNR of each quantized linear's output.

Hooks on the reference model capture, for every module the FP8 model quantizes, its input
``x`` and output ``y_ref``. Two numbers per layer, over real (unpadded) tokens:

* ``sqnr_db`` (**isolated**, used for the ranking and for verify's layer check): the FP8 layer
  is fed the *reference's own input* ``x``, so ``SQNR(y_ref, fp8_layer(x))`` measures the
  error this layer adds by itself — errors of earlier layers do not compound into it. A layer
  whose weight scale is wrong by 2x shows 0 dB here, by 8x about −17 dB, however deep it sits.
* ``sqnr_e2e_db`` (**end-to-end**, only with ``end_to_end``): the FP8 model's own output of the
  same layer in its full FP8 forward, against the reference: the error accumulated up to and
  including this layer. Not for MoE experts (the FP8 model routes its tokens itself, so the two
  sides' expert inputs are different token sets): None there.

MoE experts: transformers runs the experts of a layer as one module of 3-D weights, which has
no per-expert linear to hook; the probe hooks that module and runs the same computation per
expert through :class:`fp8export.moe.ExpertLinears` views of its weights (no copy) on the real
tokens routed to each expert, so each expert projection is measured on the reference's own
routing and inputs. The reference's own forward is untouched.

Also recorded: ``saturated`` (fraction of input elements beyond ±448·input_scale, i.e. clipped
by a static input scale) and ``tokens`` (rows measured; an expert no token was routed to has 0
and no SQNR). Lower SQNR is worse; the ranking is worst-first, unmeasured layers last.
``max_tokens`` bounds the measurement: once that many real tokens were seen (and every layer,
each expert included, got some) the hooks are removed, so a check on the first batches costs
nothing on the rest.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics.fp8 import E4M3_MAX
from fp8export.numerics.metrics import sqnr_from_sums


class _Acc:
    __slots__ = ("signal", "noise", "noise_e2e", "saturated", "elements", "rows")

    def __init__(self):
        self.signal = self.noise = self.noise_e2e = 0.0
        self.saturated = self.elements = self.rows = 0


def _sq_sum(t: torch.Tensor) -> float:
    """Σt² accumulated in float64 (the squares in float32: enough for a level in dB)."""
    t = t.to(torch.float32)
    return float(torch.sum(t * t, dtype=torch.float64))


class PerLayerProbe:
    """Attach to a reference model and an FP8 model (``Fp8Linear`` layers) that see the same
    batches; call :meth:`set_mask` before each batch's two forwards (reference first)."""

    def __init__(self, reference: torch.nn.Module, fp8_model: torch.nn.Module,
                 manifest: dict[str, Any] | None = None, *, end_to_end: bool = True,
                 max_tokens: int | None = None):
        from fp8export.runtime.fp8_model import fp8_modules

        self.fp8 = fp8_modules(fp8_model)
        if not self.fp8:
            raise Fp8ExportError("per-layer attribution found no FP8 layers in the candidate.")
        self.manifest = manifest or {}
        self.end_to_end = end_to_end
        self.max_tokens = max_tokens
        self.tokens = 0  # real tokens of the batches measured so far
        self.acc = {name: _Acc() for name in self.fp8}
        self._ref_out: dict[str, torch.Tensor] = {}
        self._mask: torch.Tensor | None = None
        self._handles = []
        self._routed: set[str] = set()  # expert projections: rows are real routed tokens
        self._views: list[Any] = []
        ref_modules = self._reference_modules(reference)
        for name in self.fp8:
            self._handles.append(ref_modules[name].register_forward_hook(self._ref_hook(name)))
            if end_to_end and name not in self._routed:
                self._handles.append(self.fp8[name].register_forward_hook(self._fp8_hook(name)))
        self._in_isolated = False

    def _reference_modules(self, reference: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The reference module each FP8 layer is compared with: the same name, or an expert
        projection of a fused experts module (a view, driven by a hook on that module)."""
        from fp8export.models import weight_conversions
        from fp8export.moe import ExpertLinears, expert_leaves, is_fused_experts

        found: dict[str, torch.nn.Module] = {}
        views: dict[str, ExpertLinears] = {}
        for name in self.fp8:
            try:
                found[name] = reference.get_submodule(name)
                continue
            except AttributeError:
                pass
            # <experts>.<index>.<leaf>: one projection of one expert of a fused module
            parts = name.split(".")
            experts = ".".join(parts[:-2]) if len(parts) > 2 else ""
            fused = None
            with contextlib.suppress(AttributeError):
                fused = reference.get_submodule(experts) if experts else None
            if fused is not None and is_fused_experts(fused) and parts[-2].isdigit():
                if experts not in views:
                    leaves = expert_leaves(weight_conversions(reference)[1]) or (
                        "gate_proj", "up_proj", "down_proj")
                    views[experts] = ExpertLinears(fused, leaves, "routed")
                    self._handles.append(fused.register_forward_hook(
                        self._experts_hook(views[experts])))
                with contextlib.suppress(AttributeError):
                    found[name] = views[experts].get_submodule(".".join(parts[-2:]))
                    self._routed.add(name)
                    continue
            raise Fp8ExportError(f"per-layer: the reference has no module {name} (nor an "
                                 "experts module holding it); it is not the model the "
                                 "candidate was converted from.")
        self._views = list(views.values())
        return found

    def set_mask(self, attention_mask) -> None:
        m = torch.as_tensor(attention_mask)
        self._mask = m.reshape(-1) > 0
        self._ref_out.clear()
        if self.max_tokens is not None and self.tokens >= self.max_tokens \
                and all(a.rows for a in self.acc.values()):
            self.close()  # measured enough: the rest of the run costs nothing more
            return
        self.tokens += int(self._mask.sum())

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _rows(self, t: torch.Tensor, name: str | None = None) -> torch.Tensor:
        flat = t.reshape(-1, t.shape[-1])
        if name in self._routed:
            return flat  # the experts hook ran them on real tokens only
        if self._mask is not None and self._mask.numel() == flat.shape[0]:
            flat = flat[self._mask.to(flat.device)]
        return flat

    def _experts_hook(self, view):
        def hook(module, inputs, output):
            hidden, top_k_index, top_k_weights = inputs[:3]
            if self._mask is not None and self._mask.numel() == hidden.shape[0]:
                real = self._mask.to(hidden.device)
                hidden, top_k_index, top_k_weights = (hidden[real], top_k_index[real],
                                                      top_k_weights[real])
            with torch.inference_mode():
                view(hidden, top_k_index, top_k_weights)  # fires the projections' hooks
        return hook

    def _ref_hook(self, name):
        def hook(module, inputs, output):
            x = inputs[0]
            y_ref = self._rows(output, name)
            layer = self.fp8[name]
            self._in_isolated = True
            dev = layer.weight.device
            try:  # the layer's GPU current: its Triton kernels launch on the current device
                with torch.inference_mode(), (torch.cuda.device(dev) if dev.type == "cuda"
                                              else contextlib.nullcontext()):
                    y_iso = layer(x.to(dev))
            finally:
                self._in_isolated = False
            y_iso = self._rows(y_iso, name).to(y_ref.device)
            a = self.acc[name]
            a.signal += _sq_sum(y_ref)
            a.noise += _sq_sum(y_ref.to(torch.float32) - y_iso.to(torch.float32))
            xs = self._rows(x, name)
            if layer.input_scale is not None:
                a.saturated += int((xs.float().abs() > E4M3_MAX * float(layer.input_scale)).sum())
            a.elements += xs.numel()
            a.rows += xs.shape[0]
            if self.end_to_end and name not in self._routed:
                self._ref_out[name] = y_ref.to(torch.float32).cpu()
        return hook

    def _fp8_hook(self, name):
        def hook(module, inputs, output):
            if self._in_isolated or name not in self._ref_out:
                return
            y = self._rows(output, name).to(torch.float32).cpu()
            ref = self._ref_out.pop(name)
            self.acc[name].noise_e2e += _sq_sum(ref - y)
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._ref_out.clear()

    def result(self) -> list[dict[str, Any]]:
        """Layers ranked worst-first by isolated SQNR, unmeasured ones (no token routed to an
        expert) last with ``sqnr_db`` None (JSON-serialisable; inf as a float)."""
        quantized = self.manifest.get("quantized") or {}
        rows = []
        for order, (name, a) in enumerate(self.acc.items()):
            entry = quantized.get(name, {})
            measured = a.rows > 0
            e2e = measured and self.end_to_end and name not in self._routed
            rows.append({
                "module": name, "order": order,
                "sqnr_db": sqnr_from_sums(a.signal, a.noise) if measured else None,
                "sqnr_e2e_db": sqnr_from_sums(a.signal, a.noise_e2e) if e2e else None,
                "saturated": (a.saturated / a.elements) if a.elements else 0.0,
                "tokens": a.rows,
                "weight_sqnr_db": entry.get("weight_sqnr_db"),
                "weight_scale": entry.get("weight_scale"),
                "input_scale": entry.get("input_scale"),
                "static_input": self.fp8[name].input_scale is not None,
            })
        rows.sort(key=lambda r: (r["sqnr_db"] is None,
                                 math.inf if r["sqnr_db"] is None else r["sqnr_db"], r["order"]))
        for rank, r in enumerate(rows, 1):
            r["rank"] = rank
        return rows
