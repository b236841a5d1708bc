"""``convert --accuracy-budget KL``: keep the fewest linears in high precision, measured on the
model convert writes.

convert hands over every layer as it will write it (the E4M3 bytes, the weight scale — per
tensor with the fused group's shared max, or per channel — and the calibrated input scale or
the dynamic scheme), so every model measured here is exactly a model convert can write: a
layer kept in high precision changes no other layer's scales (weight scales are per layer or
per fused group, and activation ranges were calibrated on the high-precision model).

1. **Score** (one forward and one backward of the bf16 reference on the data): at every
   candidate linear the FP8 layer's output error ``d = y_fp8 - y`` on the reference's own input
   is paired with the gradient ``g`` of the next-token loss at that output; the layer's score
   is ``0.5 * sum_tokens (g . d)^2 / tokens``, the empirical-Fisher estimate of the KL that
   layer alone adds. The reference's log-probabilities are kept for step 2.
2. **Units**: a fused group (q/k/v, gate/up) is kept or quantized as a whole (vLLM refuses a
   partly quantized fused layer); units are ranked by score per parameter, so that the fewest
   parameters buy the most KL.
3. **Search** on the count of units kept, in that order: the KL of the full FP8 model is
   measured, the scores predict the count that meets the budget, and each measurement
   (KL of the candidate against the reference's log-probabilities on the same tokens)
   re-fits the prediction or narrows a bisection, for at most ``max_evals`` measurements
   before the first count that passes is taken.
4. convert writes the folder without the kept layers and :func:`FallbackSearch.check_written`
   measures the written folder through the FP8 runtime, on the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp8export._progress import info, progress
from fp8export.errors import Fp8ExportError
from fp8export.runners.fp8_linear import Fp8Linear

DEFAULT_SAMPLES = 16
DEFAULT_SEQ_LEN = 128
MAX_EVALS = 4
BATCH = 4


@dataclass(frozen=True)
class FallbackLayer:
    """One quantized linear as convert will write it."""

    module: str
    weight: torch.Tensor  # E4M3 [out, in]
    weight_scale: Any  # np.float32, or float32 [out] per channel
    input_scale: Any  # np.float32 or None (dynamic)
    group: str | None  # fused group: kept or quantized as a whole


@dataclass
class _Unit:
    modules: list[str]
    params: int
    score: float


class FallbackSearch:
    """The reference, the data and the FP8 twins of every candidate layer (see module doc)."""

    def __init__(self, checkpoint: Path, layers: Sequence[FallbackLayer], *, data: Path | None,
                 samples: int | None, seq_len: int | None, dynamic: str = "tensor"):
        from fp8export.inputs.samples import iter_batches
        from fp8export.models import load_model, module_names
        from fp8export.moe import unfuse_experts
        from fp8export.verify.data import load_verify_samples

        self.t0 = time.perf_counter()
        self.model, config = load_model(checkpoint, dtype=torch.bfloat16, device="cpu")
        unfuse_experts(self.model)  # MoE: one linear per expert projection, as the folder has
        # the model's module name of each layer (transformers renames some, e.g. Mixtral's)
        self.names = module_names(self.model, [layer.module for layer in layers])
        for p in self.model.parameters():  # gradients are wanted at layer outputs only
            p.requires_grad_(False)
        s, self.data_info = load_verify_samples(data, Path(checkpoint), config,
                                                samples=samples or DEFAULT_SAMPLES,
                                                seq_len=seq_len or DEFAULT_SEQ_LEN)
        self.batches = [(b.input_ids, b.attention_mask) for b in iter_batches(s, BATCH)]
        self.orig = {}
        self.twins: dict[str, Fp8Linear] = {}
        for layer in layers:
            try:
                old = self.model.get_submodule(self.names[layer.module])
            except AttributeError:
                raise Fp8ExportError(f"{checkpoint}: no module {layer.module} to measure for "
                                     "--accuracy-budget.") from None
            bias = getattr(old, "bias", None)
            self.orig[layer.module] = old
            self.twins[layer.module] = Fp8Linear(
                layer.weight, np.asarray(layer.weight_scale), layer.input_scale,
                None if bias is None else bias.detach(), mode="emulate",
                out_dtype=torch.bfloat16, dynamic=dynamic)
        self.layers = list(layers)
        self.ref_logp: list[torch.Tensor] = []
        self.scores: dict[str, float] = {}
        self.evaluations: list[dict[str, Any]] = []
        self.seconds: dict[str, float] = {"load": time.perf_counter() - self.t0}

    # -- measuring ------------------------------------------------------------------------------
    def _logits(self, ids, mask) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask)
        return out.logits if hasattr(out, "logits") else out[0]

    def score(self) -> dict[str, float]:
        """Reference log-probs and each layer's Fisher-weighted output error (one fwd + bwd)."""
        t0 = time.perf_counter()
        acc = dict.fromkeys(self.twins, 0.0)
        emb = self.model.get_input_embeddings()
        hooks = [emb.register_forward_hook(lambda _m, _i, out: out.requires_grad_())]

        def hook(name):
            twin = self.twins[name]

            def fn(_m, inp, out):
                with torch.no_grad():
                    d = twin(inp[0]).float() - out.detach().float()

                def on_grad(g, d=d):
                    acc[name] += float(((g.float() * d).sum(-1) ** 2).sum())
                out.register_hook(on_grad)
            return fn

        hooks += [self.orig[n].register_forward_hook(hook(n)) for n in self.twins]
        tokens = 0
        try:
            for ids, mask in progress(self.batches, total=len(self.batches),
                                      desc="fallback: scoring", unit="batch"):
                logits = self._logits(ids, mask)
                real = mask > 0
                self.ref_logp.append(torch.log_softmax(logits.detach()[real].float(), -1))
                lp = torch.log_softmax(logits[:, :-1].float(), -1)
                nll = -lp.gather(-1, ids[:, 1:, None])[..., 0]
                loss = (nll * (mask[:, 1:] * mask[:, :-1])).sum()
                loss.backward()
                tokens += int(real.sum())
        finally:
            for h in hooks:
                h.remove()
        self.tokens = tokens
        self.scores = {n: 0.5 * v / max(tokens, 1) for n, v in acc.items()}
        self.seconds["score"] = time.perf_counter() - t0
        return self.scores

    def _set(self, name: str, module: torch.nn.Module) -> None:
        parent, _, child = self.names.get(name, name).rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, module)

    def kl(self, keep: set[str], model: torch.nn.Module | None = None) -> dict[str, float]:
        """KL(reference || candidate) per token and top-1 agreement, on the scored tokens.
        ``model``: measure that model instead (the written folder)."""
        if model is None:
            for n in self.twins:
                self._set(n, self.orig[n] if n in keep else self.twins[n])
            model = self.model
        total, agree, count = 0.0, 0, 0
        try:
            with torch.inference_mode():
                for (ids, mask), ref in zip(self.batches, self.ref_logp):
                    out = model(input_ids=ids, attention_mask=mask)
                    lg = (out.logits if hasattr(out, "logits") else out[0])[mask > 0].float()
                    lq = torch.log_softmax(lg, -1)
                    total += float((ref.exp() * (ref - lq)).sum(-1).clamp_min(0).sum())
                    agree += int((ref.argmax(-1) == lq.argmax(-1)).sum())
                    count += ref.shape[0]
        finally:
            for n in self.twins:
                self._set(n, self.orig[n])
        return {"kl": total / max(count, 1), "top1_agreement": agree / max(count, 1)}

    # -- searching ------------------------------------------------------------------------------
    def units(self) -> list[_Unit]:
        by_key: dict[str, _Unit] = {}
        for layer in self.layers:
            key = layer.group or layer.module
            u = by_key.setdefault(key, _Unit([], 0, 0.0))
            u.modules.append(layer.module)
            u.params += layer.weight.numel()
            u.score += self.scores[layer.module]
        return sorted(by_key.values(), key=lambda u: (-u.score / max(u.params, 1), u.modules[0]))

    def search(self, budget: float, max_evals: int = MAX_EVALS) -> dict[str, Any]:
        """The fewest units (in score order) whose measured KL is within ``budget``."""
        if not self.scores:
            self.score()
        t0 = time.perf_counter()
        units = self.units()
        total_params = sum(u.params for u in units)
        remaining = np.concatenate([[0.0], np.cumsum([u.score for u in units])])
        remaining = remaining[-1] - remaining  # score left in FP8 when the first k are kept
        measured: dict[int, dict[str, float]] = {}

        def measure(k: int) -> float:
            keep = {m for u in units[:k] for m in u.modules}
            r = self.kl(keep)
            measured[k] = r
            self.evaluations.append({"kept_units": k, "kept_layers": len(keep),
                                     "kept_param_fraction": sum(u.params for u in units[:k])
                                     / max(total_params, 1), **r})
            info(f"fallback: {k} unit(s) kept -> KL {r['kl']:.3e}")
            return r["kl"]

        lo, hi = 0, None  # lo: a count known to fail; hi: the smallest count known to pass
        if measure(0) <= budget:
            hi = 0
        n = len(units)
        while hi is None or hi - lo > 1:
            if hi is not None and len(measured) >= max_evals:
                break
            if hi is None:
                ratio = measured[lo]["kl"] / max(remaining[lo], 1e-30)  # re-fit at the last fail
                fits = np.flatnonzero(ratio * remaining <= 0.9 * budget)
                k = int(fits[0]) if fits.size else n
                if len(measured) >= max_evals:  # out of measurements: double, never stall
                    k = max(k, min(n, 2 * lo if lo else 1))
                k = min(n, max(k, lo + 1))
            else:
                k = (lo + hi) // 2
            if measure(k) <= budget:
                hi = k
            else:
                lo = k
                if k == n:
                    break
        if hi is None:
            raise Fp8ExportError(
                f"--accuracy-budget {budget}: even with every candidate layer in high precision "
                f"the measured KL is {measured[lo]['kl']:.3e} (the layers kept by default, such "
                "as embeddings and the output head, are not FP8). Raise the budget.")
        keep = [m for u in units[:hi] for m in u.modules]
        kept_params = sum(u.params for u in units[:hi])
        self.seconds["search"] = time.perf_counter() - t0
        return {
            "budget_kl": budget, "data": self.data_info.get("source"),
            "samples": self.data_info.get("samples"), "tokens": self.tokens,
            "score": "empirical Fisher: 0.5 * sum (grad . (y_fp8 - y))^2 per token, per layer",
            "keep": keep, "kept_layers": len(keep), "candidate_layers": len(self.layers),
            "kept_params": kept_params, "linear_params": total_params,
            "kept_param_fraction": kept_params / max(total_params, 1),
            "kl_all_fp8": measured[0]["kl"], "kl_selected": measured[hi]["kl"],
            "top1_selected": measured[hi]["top1_agreement"],
            "evaluations": list(self.evaluations),
            "ranking": [{"module": n, "score": s} for n, s in
                        sorted(self.scores.items(), key=lambda kv: -kv[1])[:20]],
        }

    def check_written(self, folder: Path) -> dict[str, float]:
        """KL of the written FP8 folder (through the FP8 runtime) on the same tokens."""
        from fp8export.runners.fp8_model import load_fp8_model

        t0 = time.perf_counter()
        model = load_fp8_model(folder, dtype=torch.bfloat16, mode="emulate")[0]
        r = self.kl(set(), model=model)
        self.seconds["check_written"] = time.perf_counter() - t0
        return r

    def cost(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in
                {**self.seconds, "total": time.perf_counter() - self.t0}.items()}


def start(cfg, checkpoint: Path, layers: Sequence[FallbackLayer]) -> FallbackSearch:
    """The hook convert calls: a search over ``layers`` on ``cfg``'s data."""
    return FallbackSearch(checkpoint, layers, data=cfg.calib_data,
                          samples=cfg.accuracy_samples, seq_len=cfg.seq_len,
                          dynamic=str(cfg.dynamic_activations))
