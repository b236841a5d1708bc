"""verify with a Keras reference: the rebuilt model, probabilities compared as class logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.verify.metrics import Comparison, class_logits

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "keras-float8"


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_class_logits_give_back_the_probabilities():
    p = np.array([[0.0], [0.2], [0.5], [0.9], [1.0]], dtype=np.float32)
    logits = class_logits(p, "sigmoid")
    assert logits.shape == (5, 2) and np.isfinite(logits).all()
    np.testing.assert_allclose(_softmax(logits)[:, 1], p[:, 0], atol=1e-12)
    assert list(logits.argmax(-1)) == [0, 0, 0, 1, 1]  # Keras's binary accuracy: p > 0.5
    q = np.array([[0.1, 0.7, 0.2]])
    np.testing.assert_allclose(_softmax(class_logits(q, "softmax")), q, atol=1e-12)
    raw = np.array([[1.0, -2.0]])
    assert class_logits(raw, "linear") is raw


def test_prob_max_abs_is_the_largest_probability_change():
    ref = class_logits(np.array([[0.30], [0.80]]), "sigmoid")
    cand = class_logits(np.array([[0.31], [0.75]]), "sigmoid")
    cmp = Comparison(causal=False)
    cmp.add(ref, cand, labels=np.array([0, 1]))
    m = cmp.result()["metrics"]
    assert m["prob_max_abs"] == pytest.approx(0.05, abs=1e-6)  # logits are compared in fp32
    assert m["accuracy_reference"] == m["accuracy_candidate"] == 1.0 and m["tokens"] == 2


@pytest.fixture()
def fp8_folder(keras_float8_folder):
    return keras_float8_folder


def test_accuracy_from_the_data_labels(fp8_folder, tmp_path):
    from fp8export.api import verify
    from fp8export.keras_model.build import load_keras_model
    from fp8export.verify.config import VerifyConfig

    res = verify(VerifyConfig(reference=SAMPLE / "model" / "float8_model.keras",
                              candidate=fp8_folder, data=SAMPLE / "data" / "eval.npz",
                              samples=120, batch_size=40, reference_dtype="fp32",
                              report_dir=tmp_path))
    data = np.load(SAMPLE / "data" / "eval.npz")
    ids, labels = data["input_ids"][:120], data["labels"][:120]
    with torch.no_grad():
        p = load_keras_model(SAMPLE / "model" / "float8_model.keras")(torch.as_tensor(ids))
    m = res.metrics
    assert m["accuracy_reference"] == pytest.approx(float(((p[:, 0] > 0.5).numpy() == labels)
                                                          .mean()))
    assert m["tokens"] == 120 and "ppl_reference" not in m and res.passed
    assert 0 < m["prob_max_abs"] < 0.1 and m["kl_mean"] < 1e-3
    assert res.reference["output_activation"] == "sigmoid"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["metrics"]["prob_max_abs"] == m["prob_max_abs"]


def test_a_candidate_from_another_keras_model_is_refused(fp8_folder, tmp_path):
    from fp8export.api import verify
    from fp8export.verify.config import VerifyConfig

    other = tmp_path / "fp8"
    shutil.copytree(fp8_folder, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["config"]["layers"][6]["config"]["activation"] = "gelu"  # dense: same weights
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Fp8ExportError, match="different Keras models"):
        verify(VerifyConfig(reference=SAMPLE / "model" / "float8_model.keras", candidate=other,
                            data=SAMPLE / "data" / "eval.npz", samples=8,
                            report_dir=tmp_path / "r"))


def test_token_ids_outside_the_vocabulary_are_one_clear_error(fp8_folder, tmp_path):
    from fp8export.api import verify
    from fp8export.verify.config import VerifyConfig

    np.savez(tmp_path / "bad.npz", input_ids=np.full((2, 8), 5000), labels=np.array([0, 1]))
    with pytest.raises(Fp8ExportError, match="outside the model's vocabulary"):
        verify(VerifyConfig(reference=SAMPLE / "model" / "float8_model.keras",
                            candidate=fp8_folder,
                            data=tmp_path / "bad.npz", report_dir=tmp_path / "r"))


def test_the_console_line_shows_a_classifiers_accuracy(fp8_folder, tmp_path, run_cli):
    r = run_cli("verify", SAMPLE / "model" / "float8_model.keras", fp8_folder, "--data",
                SAMPLE / "data" / "eval.npz", "--samples", "40", "--batch-size", "40",
                "--reference-dtype", "fp32", "--report-dir", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "rep" / "report.json").read_text())["metrics"]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("PASSED: 40 samples"))
    assert (f"accuracy={m['accuracy_candidate']:.4g} (reference "
            f"{m['accuracy_reference']:.4g})") in line, line
