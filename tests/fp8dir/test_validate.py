"""The FP8-folder checks (fp8export/fp8dir/validate.py): a folder convert wrote passes, every
edit the third review made to one is refused naming the layer or tensor and the rule."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corrupt"))
from corpus_files import fp8_folder  # noqa: E402

from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.validate import check_config, check_scale, validate_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return fp8_folder(tmp_path_factory.mktemp("validate"), "fp8")


def _parts(folder: Path):
    from safetensors import safe_open

    from fp8export.checkpoint.safetensors_reader import SafetensorsFile

    sf = SafetensorsFile(folder / "model.safetensors")
    tensors = {t.name: (t.dtype, tuple(t.shape)) for t in sf.tensors}
    sf.close()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        values = {n: f.get_tensor(n).float().numpy() for n in tensors if n.endswith("_scale")}
    manifest = json.loads((folder / "fp8export.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    return manifest, config, tensors, values


def _run(folder, manifest, config, tensors, values):
    validate_folder(folder, manifest, config, tensors, lambda n: values[n])


def test_a_folder_convert_wrote_passes(folder):
    _run(folder, *_parts(folder))


LAYER = "model.layers.0.self_attn.o_proj"
OTHER = "model.layers.0.mlp.down_proj"


def _drop_layer(m, c, t, v):
    del m["quantized"][LAYER]


def _other_weight(m, c, t, v):
    m["quantized"][LAYER]["weight"] = f"{OTHER}.weight"


def _stray_input_scale(m, c, t, v):
    t[f"{LAYER}.input_scale"] = ("F32", (1,))
    v[f"{LAYER}.input_scale"] = [1e-30]


def _bool_scale(m, c, t, v):
    t[f"{LAYER}.weight_scale"] = ("BOOL", (1,))


def _huge_scale(m, c, t, v):
    v[f"{LAYER}.weight_scale"] = [3e38]


def _e5m2_embedding(m, c, t, v):
    t["model.embed_tokens.weight"] = ("F8_E5M2", t["model.embed_tokens.weight"][1])


def _scale_not_the_manifests(m, c, t, v):
    v[f"{LAYER}.weight_scale"] = [v[f"{LAYER}.weight_scale"][0] * 1000]


def _no_quantization_config(m, c, t, v):
    del c["quantization_config"]


def _ignore_everything(m, c, t, v):
    c["quantization_config"]["ignore"] = ["re:.*"]


@pytest.mark.parametrize("edit, match", [
    (_drop_layer, "belong to no layer of the manifest .*o_proj.weight.*unscaled"),
    (_other_weight, f"layer {LAYER}: the manifest points it at {OTHER}.weight"),
    (_stray_input_scale, "input_scale is stored but the manifest says .* dynamic"),
    (_bool_scale, "o_proj.weight_scale is BOOL; a scale is a float"),
    (_huge_scale, "o_proj.weight_scale is 3e\\+38, outside"),
    (_e5m2_embedding, "belong to no layer .*embed_tokens.weight"),
    (_scale_not_the_manifests, "but the manifest records"),
    (_no_quantization_config, "config.json has no quantization_config"),
    (_ignore_everything, "differs from the one the manifest recorded \\(at ignore\\)"),
], ids=lambda x: getattr(x, "__name__", "")[1:])
def test_each_edit_is_refused_naming_the_rule(folder, edit, match):
    parts = copy.deepcopy(_parts(folder))
    edit(*parts)
    with pytest.raises(Fp8ExportError, match=match):
        _run(folder, *parts)


def test_scale_range_and_config_of_a_manifest_without_one(folder):
    check_scale(folder, "x.input_scale", "F32", [0.5])
    with pytest.raises(Fp8ExportError, match="1e-30, outside"):
        check_scale(folder, "x.input_scale", "F32", [1e-30])
    with pytest.raises(Fp8ExportError, match="positive finite"):
        check_scale(folder, "x.input_scale", "F16", [float("nan")])
    check_config(folder, {}, {"quantized": {}})  # a source without config.json: nothing to agree
