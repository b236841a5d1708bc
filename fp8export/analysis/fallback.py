"""``convert --accuracy-budget KL``: keep the fewest linears in high precision, measured on the
model convert writes.

convert hands over every layer as it will write it (the E4M3 bytes — GPTQ's codes with
``--weight-rounding gptq`` —, the weight scale — per tensor with the fused group's shared max,
or per channel — and the calibrated input scale or the dynamic scheme), so every model
measured here is exactly a model convert can write: a layer kept in high precision changes no
other layer's scales (weight scales are per layer or per fused group, and activation ranges
were calibrated on the high-precision model).

1. **Score** (one forward and one backward of the bf16 reference on the search samples): at
   every candidate linear the FP8 layer's output error ``d = y_fp8 - y`` on the reference's own
   input is paired with the gradient ``g`` of the next-token loss at that output, per token:
   ``p[t, l] = g · d``. ``0.5 · mean_t (Σ_l p[t, l])²`` estimates the KL of any set of FP8
   layers (``fallback_units.py``: the empirical Fisher, cross terms included); a layer's own
   score is its diagonal term. The reference's log-probabilities are kept for step 3.
2. **Order** (``fallback_units.py``): units — fused groups (kept whole: vLLM refuses a partly
   quantized fused layer), single linears, and each decoder layer's attention, MLP and the
   whole layer — join the keep list greedily by estimated KL saved per parameter.
3. **Search** on the number of steps of that order: the KL of the full FP8 model is measured,
   the estimates (scaled to the last measurement) predict the count that meets the budget, and
   each measurement (KL of the candidate against the reference's log-probabilities on the same
   tokens) re-fits the prediction or narrows a bisection, for at most ``max_evals``
   measurements before the first count that passes is taken.
4. convert writes the folder without the kept layers and :func:`FallbackSearch.check_written`
   measures the written folder through the FP8 runtime on **held-out** samples: the samples of
   the data that follow the search samples (as many as half of them), which the search never
   saw. The gap between that and the search's estimate goes into the manifest; without
   held-out samples the written folder is measured on the search tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp8export._progress import info, progress
from fp8export.analysis.fallback_units import Base, base_units, greedy_path, predicted, structures
from fp8export.errors import Fp8ExportError
from fp8export.runtime.fp8_linear import Fp8Linear

DEFAULT_SAMPLES = 32
DEFAULT_SEQ_LEN = 128
MAX_EVALS = 4
BATCH = 4
HELD_OUT_FRACTION = 0.5  # held-out samples for the written check, per search sample


@dataclass(frozen=True)
class FallbackLayer:
    """One quantized linear as convert will write it."""

    module: str
    weight: torch.Tensor  # E4M3 [out, in]
    weight_scale: Any  # np.float32, or float32 [out] per channel
    input_scale: Any  # np.float32 or None (dynamic)
    group: str | None  # fused group: kept or quantized as a whole


class FallbackSearch:
    """The reference, the data and the FP8 twins of every candidate layer (see module doc)."""

    def __init__(self, checkpoint: Path, layers: Sequence[FallbackLayer], *, data: Path | None,
                 samples: int | None, seq_len: int | None, dynamic: str = "tensor"):
        from fp8export.inputs.eval_data import load_verify_samples
        from fp8export.inputs.samples import iter_batches
        from fp8export.models import load_model, module_names
        from fp8export.moe import unfuse_experts

        self.t0 = time.perf_counter()
        self.model, config = load_model(checkpoint, dtype=torch.bfloat16, device="cpu")
        unfuse_experts(self.model)  # MoE: one linear per expert projection, as the folder has
        # the model's module name of each layer (transformers renames some, e.g. Mixtral's)
        self.names = module_names(self.model, [layer.module for layer in layers])
        for p in self.model.parameters():  # gradients are wanted at layer outputs only
            p.requires_grad_(False)
        n = samples or DEFAULT_SAMPLES
        held = max(1, int(n * HELD_OUT_FRACTION))
        s, self.data_info = load_verify_samples(data, Path(checkpoint), config,
                                                samples=n + held,
                                                seq_len=seq_len or DEFAULT_SEQ_LEN)
        search, rest = _split(s, n)
        self.data_info = {**self.data_info, "samples": len(search),
                          "tokens": search.num_tokens,
                          "held_out_samples": len(rest) if rest is not None else 0,
                          "held_out_tokens": rest.num_tokens if rest is not None else 0}
        self.batches = [(b.input_ids, b.attention_mask) for b in iter_batches(search, BATCH)]
        self.held_out = [] if rest is None else [
            (b.input_ids, b.attention_mask) for b in iter_batches(rest, BATCH)]
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
        self.cov: np.ndarray | None = None  # C over the layers (fallback_units.py)
        self.evaluations: list[dict[str, Any]] = []
        self.seconds: dict[str, float] = {"load": time.perf_counter() - self.t0}

    # -- measuring ------------------------------------------------------------------------------
    def _logits(self, ids, mask) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask)
        return out.logits if hasattr(out, "logits") else out[0]

    def score(self) -> dict[str, float]:
        """Reference log-probs and each token's Fisher-weighted output error per layer (one
        fwd + bwd); returns each layer's own score (the diagonal of ``C``)."""
        t0 = time.perf_counter()
        order = {name: i for i, name in enumerate(self.twins)}
        columns: list[list[torch.Tensor]] = [[] for _ in order]
        emb = self.model.get_input_embeddings()
        hooks = [emb.register_forward_hook(lambda _m, _i, out: out.requires_grad_())]

        def hook(name):
            twin = self.twins[name]

            def fn(_m, inp, out):
                with torch.no_grad():
                    d = twin(inp[0]).float() - out.detach().float()

                def on_grad(g, d=d):
                    columns[order[name]].append((g.float() * d).sum(-1).reshape(-1).double())
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
        # P [positions, layers]: padded positions have no gradient, hence zero rows; a layer
        # no batch reached (an expert never routed to) has an all-zero column
        width = sum(int(ids.numel()) for ids, _ in self.batches)
        cols = [torch.cat(c) if c else torch.zeros(width, dtype=torch.float64)
                for c in columns]
        # an MoE expert sees only the tokens routed to it, so its projections are not aligned
        # with positions: it keeps its own term (the diagonal) and no cross terms
        routed = [i for i, c in enumerate(cols) if c.numel() != width]
        diag = {i: float((cols[i] ** 2).sum()) for i in routed}
        for i in routed:
            cols[i] = torch.zeros(width, dtype=torch.float64)
        p = torch.stack(cols, 1)
        self.cov = (0.5 * (p.T @ p) / max(tokens, 1)).numpy()
        for i, energy in diag.items():
            self.cov[i, i] = 0.5 * energy / max(tokens, 1)
        self.scores = {n: float(self.cov[i, i]) for n, i in order.items()}
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
        try:
            return _measure(model, self.batches, self.ref_logp)
        finally:
            for n in self.twins:
                self._set(n, self.orig[n])

    # -- searching ------------------------------------------------------------------------------
    def order(self) -> tuple[list[Base], list[tuple[str, list[int]]], np.ndarray]:
        """Base units, the greedy keep order and the estimated KL after each step."""
        column = {name: i for i, name in enumerate(self.twins)}
        bases = base_units(self.layers, column)
        path = greedy_path(self.cov, bases, structures(bases))
        return bases, path, predicted(self.cov, bases, path)

    def search(self, budget: float, max_evals: int = MAX_EVALS) -> dict[str, Any]:
        """The fewest steps of the keep order whose measured KL is within ``budget``."""
        if not self.scores:
            self.score()
        t0 = time.perf_counter()
        bases, path, estimate = self.order()
        total_params = sum(b.params for b in bases)
        kept_params = np.concatenate([[0], np.cumsum([sum(bases[i].params for i in add)
                                                      for _, add in path])])
        measured: dict[int, dict[str, Any]] = {}

        def keep_of(k: int) -> list[str]:
            return [m for _, add in path[:k] for i in add for m in bases[i].modules]

        def measure(k: int) -> float:
            keep = set(keep_of(k))
            r = self.kl(keep)
            measured[k] = r
            self.evaluations.append({
                "kept_steps": k, "kept_layers": len(keep),
                "kept_param_fraction": float(kept_params[k]) / max(total_params, 1),
                "estimate": float(estimate[k]),
                **{key: v for key, v in r.items() if key != "per_sample"}})
            info(f"fallback: {k} step(s) kept ({100 * kept_params[k] / total_params:.1f}% "
                 f"of the parameters) -> KL {r['kl']:.3e}")
            return r["kl"]

        lo, hi = 0, None  # lo: a count known to fail; hi: the smallest count known to pass
        if measure(0) <= budget:
            hi = 0
        n = len(path)
        while hi is None or hi - lo > 1:
            if hi is not None and len(measured) >= max_evals:
                break
            if hi is None:
                ratio = measured[lo]["kl"] / max(estimate[lo], 1e-30)  # re-fit at the last fail
                fits = np.flatnonzero(ratio * estimate <= 0.9 * budget)
                fits = fits[fits > lo]
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
        keep = keep_of(hi)
        self.seconds["search"] = time.perf_counter() - t0
        chosen = measured[hi]
        return {
            "budget_kl": budget, "data": self.data_info.get("source"),
            "samples": self.data_info.get("samples"), "tokens": self.tokens,
            "held_out_samples": self.data_info.get("held_out_samples"),
            "score": "empirical Fisher with cross terms: 0.5 * mean_t (sum_l grad_l . "
                     "(y_fp8 - y)_l)^2 over the FP8 layers",
            "keep": keep, "kept_layers": len(keep), "candidate_layers": len(self.layers),
            "kept_params": int(kept_params[hi]), "linear_params": total_params,
            "kept_param_fraction": float(kept_params[hi]) / max(total_params, 1),
            "kl_all_fp8": measured[0]["kl"], "kl_selected": chosen["kl"],
            "kl_selected_interval": chosen.get("interval"),
            "top1_selected": chosen["top1_agreement"],
            "kl_estimated_all_fp8": float(estimate[0]),
            "steps": [{"unit": name, "layers": [m for i in add for m in bases[i].modules]}
                      for name, add in path[:hi]],
            "evaluations": list(self.evaluations),
            "ranking": [{"module": n, "score": s} for n, s in
                        sorted(self.scores.items(), key=lambda kv: -kv[1])[:20]],
        }

    def check_written(self, folder: Path, kl_selected: float | None = None, *,
                      held_out: bool = True) -> dict[str, Any]:
        """KL of the written FP8 folder (through the FP8 runtime) on the held-out samples (the
        search tokens when the data has none, or with ``held_out=False``), with its interval
        and its gap to the search's measurement ``kl_selected``."""
        from fp8export.runtime.fp8_model import load_fp8_model

        t0 = time.perf_counter()
        batches, where = self.held_out, "held-out"
        if batches and held_out:
            with torch.inference_mode():  # the reference on the held-out samples
                ref = [torch.log_softmax(self._logits(ids, mask)[mask > 0].float(), -1)
                       for ids, mask in batches]
        else:
            batches, ref, where = self.batches, self.ref_logp, "search"
        model = load_fp8_model(folder, dtype=torch.bfloat16, mode="emulate")[0]
        r = _measure(model, batches, ref)
        r.pop("per_sample", None)
        r.update(data=where, samples=sum(int(ids.shape[0]) for ids, _ in batches))
        if kl_selected:
            r["gap"] = r["kl"] / kl_selected - 1.0  # > 0: the estimate was optimistic
        self.seconds["check_written"] = time.perf_counter() - t0
        return r

    def cost(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in
                {**self.seconds, "total": time.perf_counter() - self.t0}.items()}


def _split(s, n: int):
    """The first ``n`` samples, and the rest (None when there are none)."""
    if len(s) <= n:
        return s, None

    def part(sl):
        return replace(s, input_ids=s.input_ids[sl],
                       labels=None if s.labels is None else s.labels[sl])

    return part(slice(0, n)), part(slice(n, None))


def _measure(model, batches, ref_logp) -> dict[str, Any]:
    """KL(reference || model) per token, top-1 agreement and the KL's bootstrap interval over
    samples, on ``batches`` against the reference's log-probabilities ``ref_logp``."""
    from fp8export.analysis.confidence import SampleStats, intervals

    total, agree, count = 0.0, 0, 0
    kl_sum: list[float] = []
    tokens: list[int] = []
    with torch.inference_mode():
        for (ids, mask), ref in zip(batches, ref_logp):
            out = model(input_ids=ids, attention_mask=mask)
            lg = (out.logits if hasattr(out, "logits") else out[0])[mask > 0].float()
            lq = torch.log_softmax(lg, -1)
            kl = (ref.exp() * (ref - lq)).sum(-1).clamp_min(0)
            total += float(kl.sum())
            agree += int((ref.argmax(-1) == lq.argmax(-1)).sum())
            count += ref.shape[0]
            start = 0
            for n in (mask > 0).sum(1).tolist():  # rows of ``ref`` are the samples in order
                kl_sum.append(float(kl[start:start + n].sum()))
                tokens.append(n)
                start += n
    stats = SampleStats({"kl_sum": np.asarray(kl_sum), "tokens": np.asarray(tokens, float)})
    iv = intervals(stats, ["kl_mean"]).get("kl_mean") if len(tokens) > 1 else None
    return {"kl": total / max(count, 1), "top1_agreement": agree / max(count, 1),
            "tokens": count, "interval": iv}


def start(cfg, checkpoint: Path, layers: Sequence[FallbackLayer]) -> FallbackSearch:
    """The hook convert calls: a search over ``layers`` on ``cfg``'s data."""
    return FallbackSearch(checkpoint, layers, data=cfg.calib_data,
                          samples=cfg.accuracy_samples, seq_len=cfg.seq_len,
                          dynamic=str(cfg.dynamic_activations))
