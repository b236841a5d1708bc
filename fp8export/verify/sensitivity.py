"""Fix, not just blame: which layers to keep in high precision so FP8 stays within a KL budget.

Each candidate layer is quantized *alone* (emulated E4M3: per-tensor weight scale
``amax/448``; activations with a static per-tensor scale from the max over the same data, or
dynamic per-tensor when convert runs with ``--scales weights``; members of a fused group share
the group's max for both, as convert writes them) and the KL(reference‖that
model) of the next-token distributions is measured against the fp32 reference on the data.
Layers are ranked by that KL; the whole set is quantized and, while the KL exceeds the budget,
the most sensitive remaining layer is kept in high precision (greedy, re-measured each step).

:func:`sensitivity` is an analysis for library users (JSON-serialisable dict). It quantizes
each layer with its own per-tensor scales, so it is a model convert does not write when scales
are shared by fused groups, calibrated by another method or per channel; ``convert
--accuracy-budget`` measures the model it writes instead (``fallback.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fp8export._progress import progress
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3
from fp8export.runners.fp8_linear import Fp8Linear
from fp8export.scales.groups import share_max

DEFAULT_SAMPLES = 16
DEFAULT_SEQ_LEN = 128


def _linear_weight(module: torch.nn.Module) -> torch.Tensor:
    w = module.weight.detach()
    return w.t() if type(module).__name__ == "Conv1D" else w  # GPT-2 Conv1D stores [in, out]


def _fp8_twin(name: str, module: torch.nn.Module, weight_amax: float,
              input_amax: float | None) -> Fp8Linear:
    w = _linear_weight(module).float()
    ws = amax_to_scale(weight_amax, f"{name}.weight")
    s_in = None if input_amax is None else amax_to_scale(input_amax, f"{name} input")
    bias = getattr(module, "bias", None)
    return Fp8Linear(quantize_e4m3(w, ws).contiguous(), ws, s_in, bias, mode="emulate",
                     out_dtype=w.dtype)


class _Swapper:
    def __init__(self, model, twins: dict[str, Fp8Linear]):
        self.model, self.twins = model, twins
        self.orig = {n: model.get_submodule(n) for n in twins}

    def _set(self, name, mod):
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, mod)

    def quantize(self, names) -> None:
        for n in self.twins:
            self._set(n, self.twins[n] if n in names else self.orig[n])


def _kl(ref_logp: torch.Tensor, logits: torch.Tensor) -> tuple[float, int]:
    lq = torch.log_softmax(logits.to(torch.float64), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - lq)).sum(-1).clamp_min(0)
    return float(kl.sum()), kl.numel()


def sensitivity(checkpoint: str | Path, modules: Sequence[str], *, budget_kl: float | None = None,
                data: str | Path | None = None, static_inputs: bool = True,
                samples: int | None = None, seq_len: int | None = None, batch_size: int = 8,
                device: str = "cpu", groups: Mapping[str, Sequence[str]] | None = None
                ) -> dict[str, Any]:
    """Rank ``modules`` by the KL each adds quantized alone; pick exclusions for ``budget_kl``.

    ``groups``: fused groups (name -> member modules) whose members share their weight and
    input scales, as in convert's selection; None or ``{}`` for per-layer scales.

    Returns ``{"ranking": [{"module", "kl"}...] (most sensitive first), "kl_all": float,
    "keep": [module...], "kl_after": float, "budget_kl": float|None, "data": str,
    "steps": [{"kept", "kl"}...]}``.
    """
    from fp8export.inputs.samples import iter_batches
    from fp8export.models import load_model
    from fp8export.placement import resolve_device
    from fp8export.verify.data import load_verify_samples

    if budget_kl is not None and not budget_kl > 0:
        raise UsageError(f"--accuracy-budget must be a KL > 0 (nats per token), got "
                         f"{budget_kl}.")
    dev = resolve_device(device)
    model, config = load_model(checkpoint, dtype=torch.float32, device=dev)
    names = list(modules)
    for n in names:
        try:
            m = model.get_submodule(n)
        except AttributeError:
            raise Fp8ExportError(f"{checkpoint}: no module {n} to analyse.") from None
        if getattr(m, "weight", None) is None or m.weight.dim() != 2:
            raise Fp8ExportError(f"{checkpoint}: {n} is not a linear layer.")
    s, data_info = load_verify_samples(Path(data) if data else None, Path(checkpoint), config,
                                       samples=samples or DEFAULT_SAMPLES,
                                       seq_len=seq_len or DEFAULT_SEQ_LEN)
    batches = [(b.input_ids.to(dev), b.attention_mask.to(dev))
               for b in iter_batches(s, batch_size)]

    # reference pass: log-probs of real tokens, and input amax of every module
    amax = {n: 0.0 for n in names}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda mod, inp, out, n=n: amax.__setitem__(
            n, max(amax[n], float(inp[0].detach().abs().max())))) for n in names]

    def logits_of(ids, mask):
        out = model(input_ids=ids, attention_mask=mask)
        lg = out.logits if hasattr(out, "logits") else out[0]
        return lg[mask > 0] if lg.dim() == 3 else lg

    with torch.inference_mode():
        ref = [torch.log_softmax(logits_of(i, m).to(torch.float64), -1) for i, m in batches]
    for h in hooks:
        h.remove()
    groups = groups or {}
    weight_amax = share_max({n: float(_linear_weight(model.get_submodule(n)).float().abs().max())
                             for n in names}, groups)
    input_amax = share_max(amax, groups)
    twins = {n: _fp8_twin(n, model.get_submodule(n), weight_amax[n],
                          input_amax[n] if static_inputs else None).to(dev) for n in names}
    swap = _Swapper(model, twins)

    def kl_with(quantized) -> float:
        swap.quantize(set(quantized))
        total, count = 0.0, 0
        with torch.inference_mode():
            for (i, m), r in zip(batches, ref):
                t, c = _kl(r, logits_of(i, m))
                total, count = total + t, count + c
        return total / max(count, 1)

    try:
        ranking = [{"module": n, "kl": kl_with([n])}
                   for n in progress(names, total=len(names), desc="sensitivity", unit="layer")]
        ranking.sort(key=lambda r: r["kl"], reverse=True)
        kl_all = kl_with(names)
        keep: list[str] = []
        steps = []
        kl_now = kl_all
        if budget_kl is not None:
            for r in ranking:
                if kl_now <= budget_kl:
                    break
                keep.append(r["module"])
                kl_now = kl_with([n for n in names if n not in keep])
                steps.append({"kept": r["module"], "kl": kl_now})
    finally:
        swap.quantize(set())
    return {"ranking": ranking, "kl_all": kl_all, "keep": keep, "kl_after": kl_now,
            "budget_kl": budget_kl, "data": data_info["source"], "steps": steps,
            "static_inputs": static_inputs}
