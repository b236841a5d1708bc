"""A sequence classifier with labels: task accuracy of both models, no perplexity."""

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification

    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    d = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, num_labels=3, max_position_embeddings=64)
    BertForSequenceClassification(cfg).to(torch.bfloat16).save_pretrained(d / "ref")
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", input_ids=rng.integers(0, 128, (24, 16)),
             labels=rng.integers(0, 3, (24,)))
    api.convert(ConvertConfig(checkpoint=d / "ref", output=d / "fp8", calib_data=d / "data.npz"))
    return d


def test_classifier_accuracy_is_reported(bert_pair, tmp_path):
    from fp8export.api import verify
    from fp8export.runners.torch_runner import TorchRunner
    from fp8export.verify.config import VerifyConfig

    d = bert_pair
    res = verify(VerifyConfig(reference=d / "ref", candidate=d / "fp8", data=d / "data.npz",
                              thresholds="loose", report_dir=tmp_path, per_layer=True))
    m = res.metrics
    assert res.task == "seq-cls" and "ppl_reference" not in m and m["tokens"] == 24
    data = np.load(d / "data.npz")
    with TorchRunner(d / "ref", device="cpu") as r:
        logits = r.infer({"input_ids": data["input_ids"],
                          "attention_mask": np.ones_like(data["input_ids"])})["logits"]
    expected = float((logits.argmax(-1) == data["labels"]).mean())
    assert m["accuracy_reference"] == pytest.approx(expected)
    assert m["accuracy_drop"] == pytest.approx(m["accuracy_reference"] - m["accuracy_candidate"])
    checks = {c["metric"]: c["status"] for c in res.checks}
    assert checks["ppl_ratio"] == "skipped" and checks["accuracy_drop"] in ("passed", "failed")
    assert res.per_layer and res.per_layer[0]["module"].startswith("bert.")
