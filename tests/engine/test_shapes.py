"""--shapes parsing and default optimization profiles from a real ONNX graph's dynamic axes."""

import onnx
import pytest
from onnx import TensorProto, helper

from fp8export.engine.shapes import (
    ShapeRange,
    default_profile,
    graph_inputs,
    parse_shape_spec,
    read_graph,
)
from fp8export.errors import Fp8ExportError


@pytest.fixture()
def lm_graph(tmp_path):
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])
    fixed = helper.make_tensor_value_info("pos", TensorProto.INT64, [1, 4])
    out = helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", "seq"])
    node = helper.make_node("Add", ["input_ids", "attention_mask"], ["y"])
    graph = helper.make_graph([node], "g", [ids, mask, fixed], [out])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def test_parse_shape_spec():
    r = parse_shape_spec("input_ids:1x1,2x128,8x512")
    assert r == ShapeRange("input_ids", (1, 1), (2, 128), (8, 512))


@pytest.mark.parametrize("bad", ["input_ids", "input_ids:1x1,2x2", "x:1xa,1x1,1x1", "x:2,1,3",
                                 "x:1x1,1x1,1"])
def test_bad_shape_specs(bad):
    with pytest.raises(Fp8ExportError, match="--shapes"):
        parse_shape_spec(bad)


def test_defaults_from_dynamic_axes(lm_graph):
    inputs = graph_inputs(lm_graph)
    assert [i.name for i in inputs] == ["input_ids", "attention_mask", "pos"]
    prof = {r.name: r for r in default_profile(inputs)}
    assert set(prof) == {"input_ids", "attention_mask"}  # the static input needs no profile
    assert prof["input_ids"].min == (1, 1) and prof["input_ids"].opt == (1, 128)
    assert prof["input_ids"].max == (8, 512)


def test_given_shapes_override_and_typos_are_errors(lm_graph):
    inputs = graph_inputs(lm_graph)
    given = [parse_shape_spec("input_ids:1x8,4x64,16x256")]
    prof = {r.name: r for r in default_profile(inputs, given)}
    assert prof["input_ids"].max == (16, 256)
    assert prof["attention_mask"].max == (8, 512)
    with pytest.raises(Fp8ExportError, match="input_idz"):
        default_profile(inputs, [parse_shape_spec("input_idz:1x1,1x1,1x1")])
    with pytest.raises(Fp8ExportError, match="rank"):
        default_profile(inputs, [parse_shape_spec("input_ids:1,1,1")])


@pytest.mark.parametrize(("positions", "opt", "top"), [(256, 128, 256), (64, 64, 64),
                                                     (4096, 128, 512)])
def test_the_default_sequence_stays_within_the_models_positions(lm_graph, positions, opt, top):
    from fp8export.onnx.export import MAX_POSITIONS_KEY

    model = onnx.load(str(lm_graph))
    onnx.helper.set_model_props(model, {MAX_POSITIONS_KEY: str(positions)})
    onnx.save(model, str(lm_graph))
    inputs, longest = read_graph(lm_graph)
    assert longest == positions
    prof = {r.name: r for r in default_profile(inputs, max_positions=longest)}
    for name in ("input_ids", "attention_mask"):
        assert prof[name].min == (1, 1) and prof[name].opt == (1, opt)
        assert prof[name].max == (8, top)
    with pytest.raises(Fp8ExportError, match=f"positions end at {positions}"):
        default_profile(inputs, [parse_shape_spec(f"input_ids:1x1,1x8,1x{positions + 1}")],
                        max_positions=longest)
    assert read_graph(lm_graph)[1] is not None
    model.ClearField("metadata_props")  # a graph from elsewhere: the plain defaults
    onnx.save(model, str(lm_graph))
    assert read_graph(lm_graph)[1] is None


def test_unreadable_graph(tmp_path):
    p = tmp_path / "bad.onnx"
    p.write_bytes(b"\x00not a protobuf at all" * 10)
    with pytest.raises(Fp8ExportError, match="bad.onnx"):
        graph_inputs(p)
