"""export-onnx of a folder converted from Keras: the model rebuilt from config.json, no Keras.

The shipped look-alike sample (``samples/keras-float8``): convert --scales history, export,
then check the graph against the folder (every float8 layer an FP8 GEMM, scales equal to the
folder's) and run it against the torch FP8 runtime and the eval labels.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "keras-float8"


@pytest.fixture(scope="module")
def exported(keras_float8_folder, onnx_keras_float8):
    return onnx_keras_float8[0], keras_float8_folder


def _eval(n: int = 256):
    data = np.load(SAMPLE / "data" / "eval.npz")
    return data["input_ids"][:n].astype(np.int64), data["labels"][:n]


def _session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path))  # as users run it: onnxruntime's default level


def test_every_float8_layer_is_an_fp8_gemm(exported):
    import onnx

    result, fp8 = exported
    manifest = json.loads((fp8 / "fp8export.json").read_text())
    assert result.dtype == "fp32" and result.opset == 21 and result.output_name == "probabilities"
    assert sorted(result.fp8_gemms) == sorted(manifest["quantized"]) and len(result.fp8_gemms) == 8
    assert result.check["ok"] and not result.sixteen_bit
    graph = onnx.load(str(result.output)).graph
    assert [i.name for i in graph.input] == ["input_ids"]
    assert "Einsum" not in {n.op_type for n in graph.node}


def test_graph_scales_are_the_folder_scales(exported):
    import onnx
    from onnx import numpy_helper

    result, fp8 = exported
    manifest = json.loads((fp8 / "fp8export.json").read_text())
    graph = onnx.load(str(result.output)).graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    for module, entry in manifest["quantized"].items():
        w_dq = next(n for n in graph.node if n.op_type == "DequantizeLinear"
                    and n.input[0] == f"{module}.weight")
        gemm = next(n for n in graph.node if n.op_type in ("MatMul", "Gemm")
                    and w_dq.output[0] in n.input)
        act_dq = producer[gemm.input[0]]
        assert act_dq.op_type == "DequantizeLinear"
        assert float(numpy_helper.to_array(inits[act_dq.input[1]])) == pytest.approx(
            entry["input_scale"], rel=1e-7)
        assert float(numpy_helper.to_array(inits[w_dq.input[1]])) == pytest.approx(
            entry["weight_scale"], rel=1e-7)
        assert inits[w_dq.input[0]].data_type == onnx.TensorProto.FLOAT8E4M3FN


def test_graph_matches_the_torch_fp8_runtime_and_the_labels(exported):
    from fp8export.runtime.fp8_model import load_fp8_model

    result, fp8 = exported
    sess = _session(result.output)
    ids, labels = _eval()
    assert sess.run(None, {"input_ids": ids[:3, :40]})[0].shape == (3, 1)  # dynamic sequence
    onnx_p = sess.run(None, {"input_ids": ids})[0]
    model, _, _, info = load_fp8_model(fp8, dtype=torch.float32, mode="emulate")
    assert info["quantized_layers"] == 8
    with torch.no_grad():
        torch_p = model(torch.as_tensor(ids)).numpy()
    assert np.abs(onnx_p - torch_p).max() < 1e-5
    assert ((onnx_p[:, 0] > 0.5) == labels).mean() > 0.6  # the model learned the task


def test_folder_of_another_architecture_is_refused(exported, tmp_path, run_cli):
    _, fp8 = exported
    folder = tmp_path / "fp8"
    shutil.copytree(fp8, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["config"]["layers"][-1]["config"]["name"] = "renamed_head"  # dense_1 → renamed_head
    cfg["config"]["output_layers"] = ["renamed_head", 0, 0]
    (folder / "config.json").write_text(json.dumps(cfg))
    res = run_cli("export-onnx", folder, "-o", tmp_path / "m.onnx")
    assert res.exit_code == 1 and "renamed_head" in res.output
    assert not (tmp_path / "m.onnx").exists()


def test_unknown_layer_in_the_folder_config_is_one_clear_error(exported, tmp_path, run_cli):
    _, fp8 = exported
    folder = tmp_path / "fp8"
    shutil.copytree(fp8, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["config"]["layers"][3]["registered_name"] = "evil_pkg>TransformerDecoder"
    (folder / "config.json").write_text(json.dumps(cfg))
    res = run_cli("export-onnx", folder, "-o", tmp_path / "m.onnx")
    assert res.exit_code == 1 and "Traceback" not in res.output
    error = next(line for line in res.output.splitlines() if line.startswith("Error:"))
    assert "evil_pkg>TransformerDecoder" in error and "keras_hub.layers.TransformerDecoder" in error
    assert res.output.rstrip().splitlines()[-1].startswith("FAILED | export-onnx")
