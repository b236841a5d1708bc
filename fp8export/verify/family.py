"""Which metrics judge a model: chosen by its head, once, from the reference's config and output.

* causal and masked LMs, and any model whose output is per-token scores over a vocabulary
  (``*ForCausalLM``, ``*ForMaskedLM``): ``logits`` — next-token / token distributions (KL,
  top-1 agreement, perplexity).
* sequence classifiers (``*ForSequenceClassification``, a Keras model with a class head, any
  output of shape ``[batch, classes]``): ``labels`` — class distributions; ``top1_agreement``
  is label agreement, and accuracy is scored when the data has labels.
* encoders and embedding models (a bare ``*Model`` whose output is hidden states
  ``[batch, tokens, hidden]``): ``embeddings`` — pooled sentence embeddings (embeddings.py).
"""

from __future__ import annotations

from pathlib import Path

from fp8export.config import StrEnum


class MetricFamily(StrEnum):
    LOGITS = "logits"
    LABELS = "labels"
    EMBEDDINGS = "embeddings"


DESCRIPTIONS = {
    MetricFamily.LOGITS: "token logits (a language-model head)",
    MetricFamily.LABELS: "class labels (a classification head)",
    MetricFamily.EMBEDDINGS: "pooled sentence embeddings (an encoder without a task head)",
}


def family_of(task: str, output_ndim: int) -> MetricFamily:
    """The family for ``models.task_of`` of the reference and the rank of its output."""
    if task in ("causal-lm", "masked-lm"):
        return MetricFamily.LOGITS
    if task == "seq-cls" or output_ndim == 2:
        return MetricFamily.LABELS
    return MetricFamily.EMBEDDINGS


def new_comparison(family: MetricFamily, task: str, reference: Path):
    """An empty comparison for ``family`` (``reference`` holds the pooling config, if any)."""
    if family is MetricFamily.EMBEDDINGS:
        from fp8export.verify.embeddings import EmbeddingComparison
        from fp8export.verify.pooling import read_pooling

        return EmbeddingComparison(read_pooling(Path(reference)))
    from fp8export.verify.metrics import Comparison

    return Comparison(causal=task == "causal-lm")
