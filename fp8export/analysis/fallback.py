"""``convert --accuracy-budget KL``: keep the fewest linears in high precision, measured on the
model convert writes, decided on calibration text that no calibration step saw.

convert hands over every layer as it will write it (the E4M3 bytes — GPTQ's codes with
``--weight-rounding gptq`` —, the weight scale — per tensor with the fused group's shared max,
per channel or per block — and the calibrated input scale or the dynamic scheme) and, with
``--kv-cache fp8``, the KV-cache scales, so every model measured here is exactly a model
convert can write: a layer kept in high precision changes no other layer's scales (weight
scales are per layer or per fused group, activation ranges were calibrated on the
high-precision model).

**Data.** The samples of the data file are split in file order (:func:`plan_split`): the first
ones calibrate (activation ranges, GPTQ, KV cache), the next ``--accuracy-samples`` are the
*search* split, and the ``--accuracy-samples / 2`` after them the *check* split. Neither
budget split was seen by a calibration step (GPTQ fitted to the tokens it measured on looked
better than it was), and the check split was not seen by the search either.

1. **Score** (one forward and one backward of the bf16 reference on the search split): at
   every candidate linear the FP8 layer's output error ``d = y_fp8 - y`` on the reference's own
   input is paired with the gradient ``g`` of the next-token loss at that output, per token:
   ``p[t, l] = g · d``. ``0.5 · mean_t (Σ_l p[t, l])²`` estimates the KL of any set of FP8
   layers (``fallback_units.py``: the empirical Fisher, cross terms included).
2. **Order** (``fallback_units.py``): units — fused groups (kept whole: vLLM refuses a partly
   quantized fused layer), single linears, and each decoder layer's attention, MLP and the
   whole layer — join the keep list greedily by estimated KL saved per parameter. The order
   does not depend on the budget.
3. **Search** (:func:`bisect_steps`) on the number ``k`` of steps of that order kept: the
   measured KL of the all-FP8 model first, then a plain bisection over ``k`` to a crossing
   (``k`` passes, ``k - 1`` fails). A count passes when the upper end of its KL's 95 %
   bootstrap interval over the search samples is within the budget: the search chose on those
   samples, so it asks for a margin that holds on others of the same kind. The probes depend
   on the budget only through the pass/fail outcomes, so a tighter budget never keeps fewer
   steps (the first probe where two budgets disagree sends the tighter one above it and the
   looser one at or below it), and the result is never "everything kept" while a count below
   it was measured to pass. When only keeping everything passes, no FP8 layer can meet the
   budget: convert refuses, naming the smallest KL measured with FP8 layers in it.
4. convert writes the folder without the kept layers and :meth:`FallbackSearch.check_written`
   measures it through the FP8 runtime on the check split: ``met`` is that KL within the
   budget, with its 95 % bootstrap interval; convert publishes the folder either way and exits
   3 when it is not met.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
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
BATCH = 4
HELD_OUT_FRACTION = 0.5  # check samples per search sample


@dataclass(frozen=True)
class FallbackLayer:
    """One quantized linear as convert will write it."""

    module: str
    weight: torch.Tensor  # E4M3 [out, in]
    weight_scale: Any  # np.float32, float32 [out] per channel, or the block grid
    input_scale: Any  # np.float32 or None (dynamic)
    group: str | None  # fused group: kept or quantized as a whole
    block: tuple[int, int] | None = None  # (bn, bk) of a block grid; inputs per token group


@dataclass(frozen=True)
class BudgetSplit:
    """How the data file's samples are shared, in file order: ``calibration`` first (what the
    calibration steps may read), then ``search``, then ``check``."""

    calibration: int
    search: int
    check: int
    available: int  # usable samples read (at most what the three want)
    shortened: bool  # the data held fewer than asked: the splits were shrunk in proportion

    def to_dict(self) -> dict[str, Any]:
        return {"calibration": [0, self.calibration],
                "search": [self.calibration, self.calibration + self.search],
                "check": [self.calibration + self.search,
                          self.calibration + self.search + self.check]}


def split_counts(available: int, calibration: int, search: int, check: int) -> BudgetSplit:
    """The split of :class:`BudgetSplit` for ``available`` samples when the steps want
    ``calibration``, ``search`` and ``check`` of them. Short data: the budget's splits keep
    their size while calibration still gets as many samples (calibration wants "up to N"),
    else all three shrink in proportion, each keeping at least one sample. Raises
    Fp8ExportError when there are too few samples to split at all."""
    budget = search + check
    if available >= calibration + budget:
        return BudgetSplit(calibration, search, check, available, False)
    if calibration and available >= 2 * budget:
        return BudgetSplit(available - budget, search, check, available, True)
    need = (1 if calibration else 0) + 2
    if available < need:
        raise Fp8ExportError(
            f"--accuracy-budget needs samples that no calibration step reads: at least {need} "
            f"usable samples in the data ({'1 to calibrate, ' if calibration else ''}1 to "
            f"search, 1 to check), but it holds {available}. Give more samples.")
    weight = min(calibration, budget)
    cal = min(max(1, round(available * weight / (weight + budget))), available - 2) \
        if calibration else 0
    rest = available - cal
    chk = min(max(1, round(rest * check / budget)), rest - 1)
    return BudgetSplit(cal, rest - chk, chk, available, True)


def check_language_model(checkpoint: Path, config: dict[str, Any]) -> None:
    """The budget is a KL between token distributions and its scores follow the next-token
    loss: a model without a language-model head (an encoder's hidden states, a classifier's
    labels) has neither, so it is refused before any work rather than measured wrongly."""
    from fp8export.errors import UsageError
    from fp8export.models import task_of

    archs = config.get("architectures") or []
    if not archs or task_of(config) in ("causal-lm", "masked-lm"):
        return
    what = ("a classifier" if task_of(config) == "seq-cls" else
            "an encoder without a language-model head, judged by pooled embeddings")
    raise UsageError(
        f"{checkpoint}: --accuracy-budget is a KL budget on token logits, and {archs[0]} is "
        f"{what}. Convert without it and judge the folder with `fp8export verify`; for "
        "encoders the recipe measured best is --weight-granularity block --weight-rounding "
        "gptq --calib-data FILE (bench/results/minilm.md).")


def plan_split(cfg, checkpoint: Path, config: dict[str, Any], calibration: int) -> BudgetSplit:
    """The split of ``cfg.calib_data`` (or the built-in set) for a budget whose calibration
    steps want the first ``calibration`` samples."""
    from fp8export.inputs.eval_data import load_verify_samples

    check_language_model(checkpoint, config)
    search = cfg.accuracy_samples or DEFAULT_SAMPLES
    check = max(1, int(search * HELD_OUT_FRACTION))
    s, _ = load_verify_samples(cfg.calib_data, Path(checkpoint), config or {},
                               samples=calibration + search + check,
                               seq_len=cfg.seq_len or DEFAULT_SEQ_LEN)
    return split_counts(len(s), calibration, search, check)


def bisect_steps(measure: Callable[[int], float], n: int, budget: float, *,
                 kl_all_kept: float = 0.0) -> tuple[int | None, dict[int, float]]:
    """The count of kept steps ``k`` in ``[0, n]`` that the search takes, and every
    measurement ``{k: KL}``. ``measure(0)`` first; then bisection between the largest count
    known to fail and the smallest known to pass (``n``, everything kept, passes when
    ``kl_all_kept`` — the KL left without any FP8 linear, e.g. by an FP8 KV cache — is within
    the budget), to a crossing. Returns ``None`` for ``k`` when not even ``n`` passes.

    Monotone in the budget for any measured curve: the probes are a fixed binary tree walked by
    pass/fail outcomes, and a looser budget passes wherever a tighter one does."""
    measured: dict[int, float] = {}

    def passes(k: int) -> bool:
        if k not in measured:
            measured[k] = float(measure(k))
        return measured[k] <= budget

    if n > 0 and kl_all_kept > budget:
        measured[n] = kl_all_kept
        return None, measured
    if n == 0 or passes(0):
        if n == 0:
            measured[0] = kl_all_kept
        return (0 if measured[0] <= budget else None), measured
    lo, hi = 0, n  # lo fails; hi passes (measured, or everything kept)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi, measured


class FallbackSearch:
    """The reference, the data and the FP8 twins of every candidate layer (see module doc)."""

    def __init__(self, checkpoint: Path, layers: Sequence[FallbackLayer], *, data: Path | None,
                 samples: int | None, seq_len: int | None, dynamic: str = "tensor",
                 offset: int = 0, check: int | None = None,
                 kv_scales: dict[str, tuple[float, float]] | None = None):
        """``offset``: samples of the data before the search split (the calibration split);
        ``samples``/``check``: the search and check splits' sizes (defaults 32 and half of
        it); ``kv_scales``: attention module -> (k_scale, v_scale) of an FP8 KV cache."""
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
        held = check if check is not None else max(1, int(n * HELD_OUT_FRACTION))
        s, self.data_info = load_verify_samples(data, Path(checkpoint), config,
                                                samples=offset + n + held,
                                                seq_len=seq_len or DEFAULT_SEQ_LEN)
        if len(s) < offset + 2:
            raise Fp8ExportError(
                f"{data or 'the built-in sample set'}: --accuracy-budget needs at least 2 "
                f"samples after the {offset} that calibrate; it has {len(s)}.")
        _, s = _split(s, offset)
        search, rest = _split(s, min(n, len(s) - 1))
        self.data_info = {**self.data_info, "offset": offset, "samples": len(search),
                          "tokens": search.num_tokens,
                          "held_out_samples": len(rest) if rest is not None else 0,
                          "held_out_tokens": rest.num_tokens if rest is not None else 0}
        self.batches = [(b.input_ids, b.attention_mask) for b in iter_batches(search, BATCH)]
        self.held_out = [] if rest is None else [
            (b.input_ids, b.attention_mask) for b in iter_batches(rest, BATCH)]
        # the KV scales under the model's names of the attention modules
        self.kv_scales = None if not kv_scales else dict(zip(
            module_names(self.model, list(kv_scales)).values(), kv_scales.values()))
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
            block = tuple(layer.block) if layer.block else None
            self.twins[layer.module] = Fp8Linear(
                layer.weight, np.asarray(layer.weight_scale),
                None if block else layer.input_scale,
                None if bias is None else bias.detach(), mode="emulate",
                out_dtype=torch.bfloat16, dynamic="group" if block else dynamic, block=block,
                group_size=block[1] if block else None)
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
        """KL(reference || candidate) per token and top-1 agreement, on the scored tokens, of
        the model convert writes when it keeps ``keep`` (its FP8 KV cache included).
        ``model``: measure that model instead (the written folder)."""
        if not self.ref_logp:
            self.score()
        if model is not None:
            return _measure(model, self.batches, self.ref_logp)
        for n in self.twins:
            self._set(n, self.orig[n] if n in keep else self.twins[n])
        try:
            if not self.kv_scales:
                return _measure(self.model, self.batches, self.ref_logp)
            from fp8export.runtime import attention as fp8_attention

            # the FP8 KV cache the runtime runs the written folder with (E4M3 keys and values)
            fp8_attention.install(self.model, self.kv_scales, mode="kv")
            try:
                return _measure(self.model, self.batches, self.ref_logp)
            finally:
                fp8_attention.set_mode(self.model, "off")
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

    def search(self, budget: float) -> dict[str, Any]:
        """The fewest steps of the keep order whose measured KL is within ``budget`` (see
        :func:`bisect_steps`). Raises Fp8ExportError when no FP8 layer can meet it."""
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"budget must be a finite KL > 0, got {budget}")
        if not self.scores:
            self.score()
        t0 = time.perf_counter()
        bases, path, estimate = self.order()
        total_params = sum(b.params for b in bases)
        kept_params = np.concatenate([[0], np.cumsum([sum(bases[i].params for i in add)
                                                      for _, add in path])])
        n = len(path)
        results: dict[int, dict[str, Any]] = {}

        def keep_of(k: int) -> list[str]:
            return [m for _, add in path[:k] for i in add for m in bases[i].modules]

        def measure(k: int) -> float:
            keep = set(keep_of(k))
            r = self.kl(keep)
            results[k] = r
            self.evaluations.append({
                "kept_steps": k, "kept_layers": len(keep),
                "kept_param_fraction": float(kept_params[k]) / max(total_params, 1),
                "estimate": float(estimate[k]),
                **{key: v for key, v in r.items() if key != "per_sample"}})
            info(f"fallback: {k} step(s) kept ({100 * kept_params[k] / total_params:.1f}% "
                 f"of the parameters) -> KL {r['kl']:.3e}"
                 + (f" (95% up to {r['interval'][1]:.3e})" if r.get("interval") else ""))
            return _upper(r)

        kv_only = measure(n) if self.kv_scales else 0.0  # the KV cache's own share
        hi, _ = bisect_steps(measure, n, budget, kl_all_kept=kv_only)
        self.seconds["search"] = time.perf_counter() - t0
        with_fp8 = {k: r["kl"] for k, r in results.items() if k < n}
        if hi is None or hi == n:
            best = min(with_fp8, key=with_fp8.get) if with_fp8 else None
            found = (f"the smallest KL measured with FP8 linears is {with_fp8[best]:.3e} "
                     f"({100 * (1 - kept_params[best] / max(total_params, 1)):.1f}% of the "
                     "linear parameters in FP8)") if best is not None else \
                "no FP8 layer was measured"
            kv = (f"; the FP8 KV cache alone gives KL {results[n]['kl']:.3e}, so drop "
                  "--kv-cache fp8 "
                  "or raise the budget above it") if self.kv_scales and kv_only > budget else ""
            raise Fp8ExportError(
                f"--accuracy-budget {budget:g}: no FP8 layer can meet it: {found}, on "
                f"{self.data_info.get('samples')} held-out samples of "
                f"{self.data_info.get('source')}{kv}. Nothing was written; raise the budget "
                f"(to at least {min(with_fp8.values()):.3g} for that) or convert without it."
                if with_fp8 else
                f"--accuracy-budget {budget:g}: no FP8 layer can meet it ({found}{kv}). "
                "Nothing was written; raise the budget or convert without it.")
        keep = keep_of(hi)
        chosen = results[hi]
        return {
            "budget_kl": budget, "data": self.data_info.get("source"),
            "samples": self.data_info.get("samples"), "tokens": self.tokens,
            "held_out_samples": self.data_info.get("held_out_samples"),
            "split_offset": self.data_info.get("offset"),
            "score": "empirical Fisher with cross terms: 0.5 * mean_t (sum_l grad_l . "
                     "(y_fp8 - y)_l)^2 over the FP8 layers",
            "search": "bisection over the kept steps of the keep order, to a crossing; a count "
                      "passes when the upper end of its KL's 95% interval is within the "
                      "budget",
            "keep": keep, "kept_layers": len(keep), "candidate_layers": len(self.layers),
            "kept_params": int(kept_params[hi]), "linear_params": total_params,
            "kept_param_fraction": float(kept_params[hi]) / max(total_params, 1),
            "kl_all_fp8": results[0]["kl"], "kl_selected": chosen["kl"],
            "kl_selected_interval": chosen.get("interval"),
            "top1_selected": chosen["top1_agreement"],
            **({"kl_kv_cache_only": results[n]["kl"]} if self.kv_scales else {}),
            "kl_estimated_all_fp8": float(estimate[0]),
            "steps": [{"unit": name, "layers": [m for i in add for m in bases[i].modules]}
                      for name, add in path[:hi]],
            "evaluations": list(self.evaluations),
            "ranking": [{"module": n, "score": s} for n, s in
                        sorted(self.scores.items(), key=lambda kv: -kv[1])[:20]],
        }

    def check_written(self, folder: Path, kl_selected: float | None = None, *,
                      held_out: bool = True, budget: float | None = None) -> dict[str, Any]:
        """KL of the written FP8 folder (through the FP8 runtime) on the check split (the
        search tokens when the data has none, or with ``held_out=False``), with its interval,
        its gap to the search's measurement ``kl_selected`` and, given the ``budget``,
        ``met``: the KL within it."""
        from fp8export.runtime.fp8_model import load_fp8_model

        t0 = time.perf_counter()
        batches, where = self.held_out, "held-out"
        if not (batches and held_out):
            batches, where = self.batches, "search"
        if where == "search" and self.ref_logp:
            ref = self.ref_logp
        else:
            with torch.inference_mode():  # the reference on these samples
                ref = [torch.log_softmax(self._logits(ids, mask)[mask > 0].float(), -1)
                       for ids, mask in batches]
        model = load_fp8_model(folder, dtype=torch.bfloat16, mode="emulate")[0]
        r = _measure(model, batches, ref)
        r.pop("per_sample", None)
        r.update(data=where, samples=sum(int(ids.shape[0]) for ids, _ in batches))
        if kl_selected:
            r["gap"] = r["kl"] / kl_selected - 1.0  # > 0: the estimate was optimistic
        if budget is not None:
            r["budget_kl"] = budget
            r["met"] = bool(r["kl"] <= budget)
            iv = r.get("interval")
            # how sure: the whole interval on one side of the budget, or not
            r["certain"] = bool(iv is not None and (iv[1] <= budget or iv[0] > budget))
        self.seconds["check_written"] = time.perf_counter() - t0
        return r

    def cost(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in
                {**self.seconds, "total": time.perf_counter() - self.t0}.items()}


def _upper(r: dict[str, Any]) -> float:
    """What a count is judged by: the upper end of its KL's 95% interval (the point value
    where there is none), so that the folder meets the budget on text the search did not see
    (the check split) and not only on the text it chose on."""
    iv = r.get("interval")
    return max(r["kl"], iv[1]) if iv else r["kl"]


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


def start(cfg, checkpoint: Path, layers: Sequence[FallbackLayer], *,
          split: BudgetSplit | None = None,
          kv_scales: dict[str, tuple[float, float]] | None = None) -> FallbackSearch:
    """The hook convert calls: a search over ``layers`` on ``cfg``'s data, on the search and
    check splits of ``split``."""
    return FallbackSearch(checkpoint, layers, data=cfg.calib_data,
                          samples=split.search if split else cfg.accuracy_samples,
                          seq_len=cfg.seq_len, dynamic=str(cfg.dynamic_activations),
                          offset=split.calibration if split else 0,
                          check=split.check if split else None, kv_scales=kv_scales)
