"""Comparison of sentence embeddings: what an encoder or embedding model is used for.

The argmax over hidden-state dimensions means nothing for an encoder, so its outputs are
pooled into one embedding per sample (pooling.py) and compared as embeddings:

* ``cosine``: cosine similarity of a sample's reference and candidate embeddings;
  ``cosine_mean`` / ``cosine_min`` over samples.
* ``rel_l2`` = ‖ref − cand‖₂ / ‖ref‖₂ over all embeddings; ``max_abs`` = max |ref − cand|.
* ``neighbor_agreement``: the fraction of samples whose nearest neighbour among the other
  samples (by cosine) is the same sample for both models: what retrieval sees. Needs at
  least 3 samples.

Same interface as metrics.Comparison (``add`` batch by batch, then ``result``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fp8export.errors import Fp8ExportError
from fp8export.verify.pooling import Pooling, pool

MIN_NEIGHBOR_SAMPLES = 3  # with two samples each one's neighbour is the other, always
# The recipe for encoders: of the all-FP8 recipes measured on all-MiniLM-L6-v2 by
# bench/minilm.py, the only one whose mean pooled cosine reaches TARGET_COSINE on held-out
# sentences (weight error dominates an encoder's; GPTQ cuts it, per-token-group inputs cut the
# rest). verify recommends it when an encoder's folder misses the target with another recipe.
TARGET_COSINE = 0.999
ENCODER_RECIPE = "--weight-granularity block --weight-rounding gptq --calib-data FILE"


class EmbeddingComparison:
    """Accumulates pooled embeddings of two runners' hidden states over batches."""

    def __init__(self, pooling: Pooling, *, seed: int = 0):
        self.pooling = pooling
        self._rng = np.random.default_rng(seed)
        self._ref: list[np.ndarray] = []
        self._cand: list[np.ndarray] = []
        self.per_sample: list[dict[str, Any]] = []
        self._tokens = 0
        self.vocab = None

    def add(self, ref_hidden: np.ndarray, cand_hidden: np.ndarray, *,
            attention_mask: np.ndarray | None = None, input_ids: np.ndarray | None = None,
            labels: np.ndarray | None = None, indices: tuple[int, ...] | None = None) -> None:
        ref, cand = np.asarray(ref_hidden), np.asarray(cand_hidden)
        if ref.shape != cand.shape:
            raise Fp8ExportError(
                f"reference outputs have shape {ref.shape} but the candidate's have "
                f"{cand.shape}: the two are not the same model. Verify a candidate converted "
                "from this reference.")
        mask = np.ones(ref.shape[:2], dtype=np.int64) if attention_mask is None \
            else np.asarray(attention_mask)
        r, c = pool(ref, mask, self.pooling), pool(cand, mask, self.pooling)
        start = len(self.per_sample)
        indices = indices if indices is not None else tuple(range(start, start + len(r)))
        for i in range(len(r)):
            tokens = int((mask[i] > 0).sum())
            if tokens == 0:
                continue
            err = c[i] - r[i]
            rn, cn = float(np.linalg.norm(r[i])), float(np.linalg.norm(c[i]))
            cos = float(r[i] @ c[i]) / (rn * cn) if rn and cn else float(rn == cn)
            self.per_sample.append({
                "index": int(indices[i]), "tokens": tokens, "cosine": cos,
                "rel_l2": float(np.linalg.norm(err)) / rn if rn else math.inf,
                "max_abs": float(np.abs(err).max())})
            self._ref.append(r[i])
            self._cand.append(c[i])
            self._tokens += tokens

    @property
    def samples(self) -> int:
        return len(self.per_sample)

    def sample_stats(self):
        """Per-sample statistics for the bootstrap (``confidence.SampleStats``); the
        neighbour agreement compares samples with each other and is not resampled."""
        from fp8export.analysis.confidence import SampleStats

        r, c = np.stack(self._ref), np.stack(self._cand)
        cols = {"cosine": [s["cosine"] for s in self.per_sample],
                "max_abs": [s["max_abs"] for s in self.per_sample],
                "err_sq": ((c - r) ** 2).sum(1), "ref_sq": (r * r).sum(1)}
        return SampleStats({k: np.asarray(v, dtype=np.float64) for k, v in cols.items()})

    def result(self) -> dict[str, Any]:
        if not self.per_sample:
            raise Fp8ExportError("no sample had any real (unmasked) token, so there is nothing "
                                 "to compare. Give data with non-empty samples.")
        r, c = np.stack(self._ref), np.stack(self._cand)
        err = c - r
        cos = np.array([s["cosine"] for s in self.per_sample])
        ref_sq = float((r * r).sum())
        m: dict[str, Any] = {
            "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "rel_l2": math.sqrt(float((err * err).sum()) / ref_sq) if ref_sq else math.inf,
            "max_abs": float(np.abs(err).max()), "tokens": self._tokens,
            "embedding_dim": int(r.shape[1]),
        }
        if len(r) >= MIN_NEIGHBOR_SAMPLES:
            nr, nc = nearest_neighbors(r), nearest_neighbors(c)
            m["neighbor_agreement"] = float((nr == nc).mean())
            for s, a, b in zip(self.per_sample, nr, nc, strict=True):
                s.update(neighbor_reference=int(self.per_sample[a]["index"]),
                         neighbor_candidate=int(self.per_sample[b]["index"]))
        flat_r, flat_c = r.reshape(-1), c.reshape(-1)
        keep = self._rng.choice(flat_r.size, size=min(flat_r.size, 20000), replace=False)
        return {"metrics": m, "per_sample": self.per_sample,
                "distributions": {"kl": [], "scatter_reference": flat_r[keep].tolist(),
                                  "scatter_candidate": flat_c[keep].tolist()}}


def nearest_neighbors(emb: np.ndarray) -> np.ndarray:
    """For each row, the index of the most cosine-similar other row."""
    norm = np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-30, None)
    unit = emb / norm
    sim = unit @ unit.T
    np.fill_diagonal(sim, -np.inf)
    return sim.argmax(1)


def recipe_note(metrics: dict[str, Any], options: dict[str, Any] | None) -> str | None:
    """verify's recommendation for an encoder whose mean pooled cosine is under
    :data:`TARGET_COSINE`: :data:`ENCODER_RECIPE`, unless ``options`` (the FP8 folder's
    recorded convert options) say the folder was converted with it already."""
    cos = metrics.get("cosine_mean")
    if cos is None or cos >= TARGET_COSINE:
        return None
    opts = options or {}
    if str(opts.get("weight_granularity")) == "block" and \
            str(opts.get("weight_rounding", "")).startswith("gptq"):
        return None
    return (f"Mean pooled cosine {cos:.5f} is under {TARGET_COSINE}: for encoders convert with "
            f"`{ENCODER_RECIPE}` (a few hundred lines like the served text), the recipe that "
            "reaches it on all-MiniLM-L6-v2 (bench/results/minilm.md).")
