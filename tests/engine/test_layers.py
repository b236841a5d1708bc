"""Engine-inspector JSON parsing for both schemas and FP8-vs-fallback GEMM attribution.

The JSON documents below follow the layouts documented for IEngineInspector (TensorRT 10.x:
"Format/Datatype" + "Bindings"; 11.x: "Datatype"/"Format" + "I/O Tensors"; see
reference/tensorrt_fp8_onnx.md §3.5). They are hand-written in those schemas, not captured from
a real engine (TensorRT cannot run here).
"""

import json

from fp8export.engine.layers import attribute_gemms, parse_engine_information, tensor_dtype


def _layer10(name, onnx_node, tactic, dtype):
    return {
        "Name": name, "LayerType": "CaskGemmMatrixMultiply",
        "Inputs": [{"Name": "a", "Dimensions": [-1, 64],
                    "Format/Datatype": f"Row major linear {dtype}"}],
        "Outputs": [{"Name": "b", "Dimensions": [-1, 64],
                     "Format/Datatype": "Row major linear BF16"}],
        "TacticName": tactic, "Metadata": f"[ONNX Layer: {onnx_node}]",
    }


def _layer11(name, onnx_node, tactic, dtype):
    return {
        "Name": name, "LayerType": "gemm",
        "Inputs": [{"Name": "a", "Dimensions": [-1, 64], "Datatype": dtype,
                    "Format": "Row major linear"}],
        "Outputs": [{"Name": "b", "Dimensions": [-1, 64], "Datatype": "BFloat16",
                     "Format": "Row major linear"}],
        "TacticName": tactic, "Metadata": f"[ONNX Layer: {onnx_node}]",
    }


def test_tensor_dtype_normalisation():
    assert tensor_dtype({"Format/Datatype": "Row major linear FP8 format"}) == "FP8"
    assert tensor_dtype({"Datatype": "FLOAT8E4M3"}) == "FP8"
    assert tensor_dtype({"Format/Datatype": "Row major linear Half format"}) == "FP16"
    assert tensor_dtype({"Datatype": "BFloat16"}) == "BF16"
    assert tensor_dtype({"Format/Datatype": "Row major linear FP32"}) == "FP32"
    assert tensor_dtype({}) == "unknown"


def test_schema_10x_fp8_and_fallback():
    info = {"Layers": [
        _layer10("q", "/q_proj/MatMul", "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n", "FP8"),
        _layer10("up", "/up_proj/MatMul", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "BF16"),
    ], "Bindings": ["input_ids", "logits"]}
    schema, layers = parse_engine_information(json.dumps(info))
    assert schema == "10.x" and layers[0].is_fp8 and not layers[1].is_fp8
    rep = attribute_gemms(info, ["/q_proj/MatMul", "/up_proj/MatMul", "/down_proj/MatMul"])
    assert rep.fp8_gemms == ["/q_proj/MatMul"]
    assert rep.fallback_gemms == ["/up_proj/MatMul"]
    assert rep.unattributed == ["/down_proj/MatMul"]
    assert any("fell back" in n for n in rep.notes)


def test_schema_11x():
    info = {"Layers": [_layer11("q", "/q_proj/MatMul", "sm90_gemm_e4m3", "FP8")],
            "I/O Tensors": ["x"]}
    rep = attribute_gemms(info, ["/q_proj/MatMul"])
    assert rep.schema == "11.x" and rep.fp8_gemms == ["/q_proj/MatMul"] and not rep.fallback_gemms
    assert rep.to_dict()["precision_histogram"] == {"FP8": 1}


def test_names_only_engine_says_unknown():
    rep = attribute_gemms({"Layers": ["a", "b"]}, ["/q_proj/MatMul"])
    assert rep.schema == "names-only"
    assert rep.unattributed == ["/q_proj/MatMul"] and not rep.fp8_gemms
    assert "DETAILED" in rep.notes[0]
