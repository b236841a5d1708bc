"""Logit comparison metrics, per token, per sample and aggregated (padding masked out).

Everything here is pure computation on arrays: :class:`Comparison` takes the reference's and
the candidate's logits batch by batch and :meth:`Comparison.result` returns plain Python
numbers and lists (JSON-serialisable). Definitions (``p`` = softmax of the reference,
``q`` = softmax of the candidate, over the last axis):

* ``kl``: KL(p‖q) = Σ p (log p − log q) in nats, per token; ``kl_mean`` over all valid tokens,
  ``kl_p99`` its 99th percentile, ``kl_max`` its maximum. Per sample also where its KL peaks
  (``kl_max_pos``) and what each model predicts there (``reference_top1``, ``candidate_top1``).
* ``cosine``: cosine similarity of a sample's valid logits flattened; ``cosine_mean`` and
  ``cosine_min`` over samples (``cosine_token_min`` is the worst single position).
* ``rel_l2`` = ‖ref − cand‖₂ / ‖ref‖₂ over all valid logits; ``max_abs`` = max |ref − cand|.
* ``top1_agreement``: fraction of valid positions where both argmaxes agree;
  ``top5_overlap``: mean |top5(ref) ∩ top5(cand)| / 5.
* causal LMs: ``ppl_reference`` / ``ppl_candidate`` = exp(mean next-token NLL) over positions
  whose next token is real (not padding); ``ppl_ratio`` = candidate / reference.
* ``prob_max_abs`` = max |softmax(ref) − softmax(cand)|: the largest change of any predicted
  probability (for a sigmoid classifier, of its output).
* sequence labels: ``accuracy_reference`` / ``accuracy_candidate`` and ``accuracy_drop``.

A model whose output is already probabilities (a Keras sigmoid or softmax head) is compared
through :func:`class_logits`, whose softmax gives back those probabilities.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fp8export.errors import Fp8ExportError

SCATTER_POINTS = 20000  # logit pairs kept for the scatter plot


_PROB_FLOOR = 1e-30  # log(0) would make every divergence infinite


def class_logits(out: np.ndarray, activation: str) -> np.ndarray:
    """Logits whose softmax is the model's class probabilities.

    ``activation`` is the output layer's: "sigmoid" turns ``p`` [..., 1] into
    ``[log(1 - p), log(p)]`` (two classes; the argmax is ``p > 0.5``, Keras's binary accuracy),
    "softmax" gives ``log(p)``; anything else is returned unchanged.
    """
    if activation not in ("sigmoid", "softmax"):
        return out
    p = np.asarray(out, dtype=np.float64)
    if activation == "sigmoid":
        if p.shape[-1] != 1:
            return np.log(np.clip(p, _PROB_FLOOR, 1.0))  # multi-label: per-output log p
        p = np.concatenate([1.0 - p, p], axis=-1)
    return np.log(np.clip(p, _PROB_FLOOR, 1.0))


def token_metrics(ref: torch.Tensor, cand: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position metrics of ``[N, V]`` logit rows (float64 inside). Returns tensors [N]."""
    r = ref.to(torch.float64)
    c = cand.to(torch.float64)
    lp = torch.log_softmax(r, dim=-1)
    lq = torch.log_softmax(c, dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)  # rounding can give -1e-17
    prob = (lp.exp() - lq.exp()).abs().amax(-1)
    cos = torch.nn.functional.cosine_similarity(r, c, dim=-1, eps=1e-30)
    top1 = (r.argmax(-1) == c.argmax(-1)).to(torch.float64)
    k = min(5, r.shape[-1])
    tr = r.topk(k, dim=-1).indices
    tc = c.topk(k, dim=-1).indices
    overlap = (tr.unsqueeze(-1) == tc.unsqueeze(-2)).any(-1).sum(-1).to(torch.float64) / k
    return {"kl": kl, "cosine": cos, "top1": top1, "top5": overlap, "prob": prob}


def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample sum of next-token NLL and count of scored positions ([B] each).

    Position t predicts token t+1; it is scored when both t and t+1 are real tokens.
    """
    lp = torch.log_softmax(logits[:, :-1].to(torch.float64), dim=-1)
    target = input_ids[:, 1:]
    valid = (mask[:, :-1] > 0) & (mask[:, 1:] > 0)
    nll = -lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    nll = torch.where(valid, nll, torch.zeros_like(nll))
    return nll.sum(-1), valid.sum(-1)


class Comparison:
    """Accumulates the comparison of two runners' logits over batches.

    Args:
        causal: score perplexity (next-token NLL) of both models.
        seed: seed of the subsample kept for the logit scatter plot.
    """

    def __init__(self, *, causal: bool, seed: int = 0, before: tuple[int, ...] = ()):
        self.causal = causal
        self._rng = np.random.default_rng(seed)
        # data parallel: the real-token counts of the samples other ranks compare before this
        # rank's first; the scatter's random draws for them are replayed at the first batch
        self._before = tuple(before)
        self._kept_before = 0
        self._tok: dict[str, list[np.ndarray]] = {"kl": [], "cosine": [], "top1": [], "top5": [],
                                                  "prob": []}
        self.per_sample: list[dict[str, Any]] = []
        self._err_sq = 0.0
        self._ref_sq = 0.0
        self._max_abs = 0.0
        self._nll = [0.0, 0.0]
        self._nll_count = 0
        self._correct = [0, 0]
        self._labelled = 0
        self._scatter: list[np.ndarray] = []
        # per sample, for the bootstrap (confidence.py): squared errors, NLL sums, labels
        self._sums: dict[str, list[float]] = {k: [] for k in (
            "err_sq", "ref_sq", "nll_reference", "nll_candidate", "nll_tokens", "labelled",
            "correct_reference", "correct_candidate")}
        self.vocab: int | None = None

    def add(self, ref_logits: np.ndarray, cand_logits: np.ndarray, *,
            attention_mask: np.ndarray | None = None, input_ids: np.ndarray | None = None,
            labels: np.ndarray | None = None, indices: tuple[int, ...] | None = None) -> None:
        """Add one batch: logits ``[B, T, V]`` (or ``[B, C]`` for classifiers)."""
        ref = torch.as_tensor(np.asarray(ref_logits, dtype=np.float32))
        cand = torch.as_tensor(np.asarray(cand_logits, dtype=np.float32))
        if ref.shape != cand.shape:
            raise Fp8ExportError(
                f"reference logits have shape {tuple(ref.shape)} but the candidate's have "
                f"{tuple(cand.shape)}: the two are not the same model (vocabulary or head size "
                "differ). Verify a candidate converted from this reference."
            )
        if ref.dim() == 2:  # classifier [B, C]: one position per sample
            ref, cand = ref.unsqueeze(1), cand.unsqueeze(1)
            mask = torch.ones(ref.shape[:2], dtype=torch.long)
        else:
            mask = (torch.ones(ref.shape[:2], dtype=torch.long) if attention_mask is None
                    else torch.as_tensor(np.asarray(attention_mask)).long())
        self.vocab = int(ref.shape[-1])
        if self._before:
            self._skip_scatter(self._before, self.vocab)
            self._before = ()
        b = ref.shape[0]
        indices = indices if indices is not None else tuple(
            range(len(self.per_sample), len(self.per_sample) + b))
        if self.causal and input_ids is not None and ref.shape[1] > 1:
            ids = torch.as_tensor(np.asarray(input_ids)).long()
            nll_r, cnt = next_token_nll(ref, ids, mask)
            nll_c, _ = next_token_nll(cand, ids, mask)
        else:
            nll_r = nll_c = cnt = None
        for i in range(b):
            valid = mask[i] > 0
            r, c = ref[i][valid], cand[i][valid]
            if r.shape[0] == 0:
                continue
            tm = token_metrics(r, c)
            for k, v in tm.items():
                self._tok[k].append(v.numpy())
            r64, c64 = r.to(torch.float64), c.to(torch.float64)
            err = c64 - r64
            esq, rsq = float((err * err).sum()), float((r64 * r64).sum())
            mabs = float(err.abs().max())
            self._err_sq += esq
            self._ref_sq += rsq
            self._max_abs = max(self._max_abs, mabs) if math.isfinite(mabs) else math.nan
            rn, cn = float(r64.norm()), float(c64.norm())
            cos = float((r64 * c64).sum()) / (rn * cn) if rn and cn else float(rn == cn)
            row = {"index": int(indices[i]), "tokens": int(valid.sum()),
                   "cosine": cos, "rel_l2": math.sqrt(esq / rsq) if rsq else math.inf,
                   "max_abs": mabs, "kl_mean": float(tm["kl"].mean()),
                   "top1_agreement": float(tm["top1"].mean()), **_divergence(r64, c64, tm["kl"])}
            sums = dict.fromkeys(self._sums, 0.0)
            sums.update(err_sq=esq, ref_sq=rsq)
            if nll_r is not None and int(cnt[i]) > 0:
                n = int(cnt[i])
                sums.update(nll_reference=float(nll_r[i]), nll_candidate=float(nll_c[i]),
                            nll_tokens=n)
                row["ppl_reference"] = math.exp(float(nll_r[i]) / n)
                row["ppl_candidate"] = math.exp(float(nll_c[i]) / n)
                self._nll[0] += float(nll_r[i])
                self._nll[1] += float(nll_c[i])
                self._nll_count += n
            if labels is not None and np.asarray(labels).ndim == 1:
                lab = int(np.asarray(labels)[i])
                pr, pc = int(r[-1].argmax()), int(c[-1].argmax())
                row.update(label=lab, pred_reference=pr, pred_candidate=pc)
                self._correct[0] += int(pr == lab)
                self._correct[1] += int(pc == lab)
                self._labelled += 1
                sums.update(labelled=1, correct_reference=int(pr == lab),
                            correct_candidate=int(pc == lab))
            for k, v in sums.items():
                self._sums[k].append(float(v))
            self.per_sample.append(row)
            self._keep_scatter(r, c)

    def _take(self, size: int) -> int:
        kept = self._kept_before + sum(len(s) for s in self._scatter)
        return min(SCATTER_POINTS - kept, max(1, SCATTER_POINTS // 16), size)

    def _skip_scatter(self, tokens: tuple[int, ...], vocab: int) -> None:
        """Draw (and drop) what adding samples of ``tokens`` real positions would have drawn."""
        for t in tokens:
            if t <= 0:
                continue
            take = self._take(t * vocab)
            if take <= 0:
                return
            self._rng.choice(t * vocab, size=take, replace=False)
            self._kept_before += take

    def _keep_scatter(self, r: torch.Tensor, c: torch.Tensor) -> None:
        kept = self._kept_before + sum(len(s) for s in self._scatter)
        room = SCATTER_POINTS - kept
        if room <= 0:
            return
        flat_r, flat_c = r.reshape(-1).numpy(), c.reshape(-1).numpy()
        take = min(room, max(1, SCATTER_POINTS // 16), flat_r.size)
        idx = self._rng.choice(flat_r.size, size=take, replace=False)
        self._scatter.append(np.stack([flat_r[idx], flat_c[idx]], axis=1))

    @property
    def samples(self) -> int:
        return len(self.per_sample)

    def to_bytes(self) -> bytes:
        """This comparison's samples as an ``.npz`` (JSON header and float arrays, nothing
        pickled), for :meth:`merged` on another process."""
        import io
        import json

        header = {"causal": self.causal, "per_sample": self.per_sample, "sums": self._sums,
                  "vocab": self.vocab, "lengths": [len(a) for a in self._tok["kl"]],
                  "scatter": [len(x) for x in self._scatter]}
        arrays = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self._tok.items()}
        arrays["scatter"] = (np.concatenate(self._scatter) if self._scatter
                             else np.zeros((0, 2), dtype=np.float32))
        buf = io.BytesIO()
        np.savez(buf, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
                 **arrays)
        return buf.getvalue()

    @classmethod
    def merged(cls, parts: list[bytes], seed: int = 0) -> Comparison:
        """The comparison of the samples of ``parts`` (:meth:`to_bytes` of consecutive shares,
        in order), equal to one comparison that added them all: the running sums are redone
        sample by sample in the same order."""
        import io
        import json

        out: Comparison | None = None
        for data in parts:
            z = np.load(io.BytesIO(data), allow_pickle=False)
            h = json.loads(bytes(z["header"]).decode())
            if out is None:
                out = cls(causal=h["causal"], seed=seed)
            at = 0
            for n in h["lengths"]:
                for k in out._tok:
                    out._tok[k].append(z[k][at:at + n])
                at += n
            at = 0
            for n in h["scatter"]:
                out._scatter.append(z["scatter"][at:at + n])
                at += n
            out.vocab = h["vocab"] if h["vocab"] is not None else out.vocab
            for row in h["per_sample"]:
                out.per_sample.append(row)
                mabs = row["max_abs"]
                out._max_abs = max(out._max_abs, mabs) if math.isfinite(mabs) else math.nan
            for i in range(len(h["per_sample"])):
                sums = {k: v[i] for k, v in h["sums"].items()}
                for k, v in sums.items():
                    out._sums[k].append(v)
                out._err_sq += sums["err_sq"]
                out._ref_sq += sums["ref_sq"]
                if sums["nll_tokens"] > 0:
                    out._nll[0] += sums["nll_reference"]
                    out._nll[1] += sums["nll_candidate"]
                    out._nll_count += int(sums["nll_tokens"])
                if sums["labelled"]:
                    out._correct[0] += int(sums["correct_reference"])
                    out._correct[1] += int(sums["correct_candidate"])
                    out._labelled += 1
        if out is None:
            raise Fp8ExportError("internal: no comparison to merge.")
        return out

    def sample_stats(self):
        """Per-sample statistics for the bootstrap (``confidence.SampleStats``)."""
        from fp8export.analysis.confidence import SampleStats

        tok = self._tok
        cols = {"tokens": [a.size for a in tok["kl"]], "kl_sum": [a.sum() for a in tok["kl"]],
                "top1_sum": [a.sum() for a in tok["top1"]],
                "top5_sum": [a.sum() for a in tok["top5"]],
                "cosine": [s["cosine"] for s in self.per_sample],
                "cosine_token_min": [a.min() for a in tok["cosine"]],
                "max_abs": [s["max_abs"] for s in self.per_sample],
                "kl_max": [a.max() for a in tok["kl"]],
                "prob_max": [a.max() for a in tok["prob"]], **self._sums}
        if not self._nll_count:
            for k in ("nll_reference", "nll_candidate", "nll_tokens"):
                cols.pop(k)
        if not self._labelled:
            for k in ("labelled", "correct_reference", "correct_candidate"):
                cols.pop(k)
        return SampleStats({k: np.asarray(v, dtype=np.float64) for k, v in cols.items()},
                           token_kl=list(tok["kl"]))

    def result(self) -> dict[str, Any]:
        """``{"metrics": {...}, "per_sample": [...], "distributions": {...}}`` (plain types)."""
        if not self.per_sample:
            raise Fp8ExportError("no sample had any real (unmasked) token, so there is nothing "
                                 "to compare. Give data with non-empty samples.")
        tok = {k: np.concatenate(v) for k, v in self._tok.items()}
        cos_s = np.array([s["cosine"] for s in self.per_sample])
        m: dict[str, Any] = {
            "cosine_mean": _f(cos_s.mean()), "cosine_min": _f(cos_s.min()),
            "cosine_token_min": _f(tok["cosine"].min()),
            "rel_l2": _f(math.sqrt(self._err_sq / self._ref_sq) if self._ref_sq else math.inf),
            "max_abs": _f(self._max_abs),
            "top1_agreement": _f(tok["top1"].mean()), "top5_overlap": _f(tok["top5"].mean()),
            "kl_mean": _f(tok["kl"].mean()), "kl_p99": _f(np.percentile(tok["kl"], 99)),
            "kl_max": _f(tok["kl"].max()), "prob_max_abs": _f(tok["prob"].max()),
            "tokens": int(tok["kl"].size),
        }
        if self._nll_count:
            pr = math.exp(self._nll[0] / self._nll_count)
            pc = math.exp(self._nll[1] / self._nll_count)
            m.update(ppl_reference=_f(pr), ppl_candidate=_f(pc), ppl_ratio=_f(pc / pr),
                     ppl_tokens=self._nll_count)
        if self._labelled:
            ar, ac = self._correct[0] / self._labelled, self._correct[1] / self._labelled
            # from the integer counts: 0.68 - 0.67 is 0.010000000000000009, which would fail
            # a bound of 0.01 that 136 - 134 correct of 200 (exactly 0.01) meets
            drop = (self._correct[0] - self._correct[1]) / self._labelled
            m.update(accuracy_reference=ar, accuracy_candidate=ac, accuracy_drop=drop)
        scatter = np.concatenate(self._scatter) if self._scatter else np.zeros((0, 2))
        return {
            "metrics": m,
            "per_sample": self.per_sample,
            "distributions": {"kl": _finite_list(tok["kl"]),
                              "scatter_reference": _finite_list(scatter[:, 0]),
                              "scatter_candidate": _finite_list(scatter[:, 1])},
        }


def _divergence(ref: torch.Tensor, cand: torch.Tensor, kl: torch.Tensor) -> dict[str, Any]:
    """Where one sample diverges most: the position of its largest KL (0-based among its real
    tokens) and each model's top-1 prediction there, with its probability."""
    pos = int(kl.argmax())
    p, q = torch.softmax(ref[pos], -1), torch.softmax(cand[pos], -1)
    return {"kl_max": float(kl[pos]), "kl_max_pos": pos,
            "reference_top1": int(p.argmax()), "reference_top1_p": float(p.max()),
            "candidate_top1": int(q.argmax()), "candidate_top1_p": float(q.max())}


def _f(x) -> float:
    return float(x)


def _finite_list(a: np.ndarray) -> list[float]:
    a = np.asarray(a, dtype=np.float64)
    return [float(v) for v in a[np.isfinite(a)]]
