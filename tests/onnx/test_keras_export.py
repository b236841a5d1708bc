"""Keras float8 sample → convert --scales history → ONNX Q/DQ graph bound by content (issue 5.4)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "keras-float8"


def _sample_module(name: str):
    """Import a sample module by path (registers the sample's custom Keras layers)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SAMPLE / f"{name.split('_', 1)[1]}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if os.environ["KERAS_BACKEND"] != "torch":
        pytest.skip("runs Keras on the torch backend")
    pytest.importorskip("keras")
    from fp8export.api import convert
    from fp8export.config import ConvertConfig
    from fp8export.onnx.keras_export import export_keras_onnx

    _sample_module("kerasf8_model")
    tmp = tmp_path_factory.mktemp("keras-onnx")
    convert(ConvertConfig(checkpoint=SAMPLE / "model" / "float8_model.keras", output=tmp / "fp8",
                          scales="history"))
    # the architecture from the folder's own config.json (what `export-onnx FP8DIR` has)
    result = export_keras_onnx(None, tmp / "fp8", tmp / "model.onnx")
    return result, tmp


def _eval_ids(n: int = 200):
    data_gen = _sample_module("kerasf8_data_gen")
    vocab = json.loads((SAMPLE / "data" / "vocab.json").read_text())
    rows = [json.loads(line) for line in (SAMPLE / "data" / "eval.jsonl").read_text().splitlines()]
    ids = data_gen.encode([r["text"] for r in rows[:n]], vocab["vocab"], vocab["sequence_length"])
    return ids, np.array([r["label"] for r in rows[:n]])


def test_every_float8_layer_is_an_fp8_gemm_bound_by_content(exported):
    result, tmp = exported
    manifest = json.loads((tmp / "fp8" / "fp8export.json").read_text())
    assert set(result.bound) == set(manifest["quantized"]) and len(result.bound) == 8
    assert set(result.bound.values()) == {"content"}
    assert sorted(result.fp8_gemms) == sorted(manifest["quantized"])
    assert result.check["ok"] and result.check["sixteen_bit_gemm_count"] == 0
    assert result.einsums_rewritten == 4  # query, key, value, attention output


def test_graph_scales_are_the_folder_scales(exported):
    import onnx
    from onnx import numpy_helper

    result, tmp = exported
    manifest = json.loads((tmp / "fp8" / "fp8export.json").read_text())
    graph = onnx.load(str(result.output)).graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    gemms = {n.name: n for n in graph.node if n.op_type == "MatMul"}
    for module, entry in manifest["quantized"].items():
        gemm = gemms[f"{module}/MatMul"]
        act_dq, w_dq = producer[gemm.input[0]], producer[gemm.input[1]]
        assert act_dq.op_type == w_dq.op_type == "DequantizeLinear"
        # q/k/v share one activation Q/DQ (same input, one fused scale): read it from the DQ
        got = float(numpy_helper.to_array(inits[act_dq.input[1]]))
        assert got == pytest.approx(entry["input_scale"], rel=1e-7), module
        assert inits[w_dq.input[0]].data_type == onnx.TensorProto.FLOAT8E4M3FN


def test_runs_at_two_shapes_and_matches_keras_float8(exported):
    import keras
    import onnxruntime as ort

    result, _ = exported
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(str(result.output), so)
    ids, labels = _eval_ids()
    assert sess.run(None, {"input_ids": ids[:3, :40]})[0].shape == (3, 1)  # dynamic seq
    onnx_p = sess.run(None, {"input_ids": ids})[0][:, 0]
    # Keras's own float8 inference of the same checkpoint (stored, lagging scales)
    mod = _sample_module("kerasf8_model")
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        cfg = json.loads((SAMPLE / "results.json").read_text())
        model = mod.build_model(vocabulary_size=cfg["vocabulary_size"], **cfg["model"])
        model.quantize("float8")
        model.load_weights(SAMPLE / "model" / "float8_model.weights.h5")
        keras_p = np.asarray(model.predict(ids, verbose=0), dtype=np.float32)[:, 0]
    finally:
        keras.config.set_dtype_policy("float32")
    # different scales (history max vs Keras's lagging stored scale; weight scale from the
    # final weights) and bf16 vs fp32 compute: close, not identical
    assert np.abs(onnx_p - keras_p).max() < 0.05
    assert ((onnx_p > 0.5) == (keras_p > 0.5)).mean() >= 0.97
    assert ((onnx_p > 0.5) == labels).mean() > 0.55  # the model learned something


def test_source_checkpoint_config_gives_the_same_graph(exported):
    import onnx

    from fp8export.onnx.keras_export import export_keras_onnx

    result, tmp = exported
    again = export_keras_onnx(SAMPLE / "model" / "float8_model.keras", tmp / "fp8",
                              tmp / "again.onnx")
    a, b = onnx.load(str(result.output)), onnx.load(str(again.output))
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    assert again.bound == result.bound


def test_folder_from_another_architecture_is_refused(exported, tmp_path):
    import shutil

    from fp8export.errors import Fp8ExportError
    from fp8export.onnx.keras_export import export_keras_onnx

    _, tmp = exported
    folder = tmp_path / "fp8"
    shutil.copytree(tmp / "fp8", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["config"]["layers"][-1]["config"]["name"] = "renamed_head"  # dense_1 → renamed_head
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Fp8ExportError, match="renamed_head"):
        export_keras_onnx(None, folder, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_config_with_code_is_refused(tmp_path):
    from fp8export.errors import Fp8ExportError
    from fp8export.onnx.keras_export import refuse_code

    cfg = {"class_name": "Functional", "config": {"layers": [
        {"module": "keras.layers", "class_name": "Lambda", "config": {"name": "evil"}}]}}
    with pytest.raises(Fp8ExportError, match="Lambda"):
        refuse_code(cfg, "m.keras", set())
    cfg["config"]["layers"][0] = {"module": "os", "class_name": "system", "config": {},
                                  "registered_name": None}
    with pytest.raises(Fp8ExportError, match="not registered"):
        refuse_code(cfg, "m.keras", set())
