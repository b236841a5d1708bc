"""Our folders of the newer families against llm-compressor's, on the same tiny models.

llm-compressor 0.14 runs its own example recipe per family in its venv
(``llmcompressor_examples.py``; skipped without the venv, as ``test_llmcompressor_peer.py``).
Ours: ``convert`` with the same scheme (FP8_DYNAMIC: ``--scales weights --weight-granularity
channel``; FP8_BLOCK: ``--weight-granularity block``). Compared: tensor names, dtypes and
shapes, the compressed-tensors fields, ``ignore``. Measured differences, asserted as such
(docs/families.md "Names against llm-compressor"):

* scale dtype: ours F32, llm-compressor's BF16; DeepSeek's ``e_score_correction_bias``: ours
  copied from the source, llm-compressor's upcast to F32 (transformers keeps it in fp32);
* ``ignore``: ours also lists ``model.embed_tokens``, and, for modules transformers renames
  when it loads a composite model, the name it matches as well (``model.visual.*`` beside
  ``visual.*``). llm-compressor lists checkpoint names only, so transformers loads its
  Qwen2.5-VL folder with the vision tower quantized from bf16 weights without scales;
* LLaVA: the example's ``re:vision_tower.*`` / ``re:multi_modal_projector.*`` match no module
  under transformers 5 (``model.vision_tower...``), so llm-compressor puts the CLIP tower and
  the projector in FP8; ours keeps them, as the example means to.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from peer_venv import PEER_PY, needs_peer  # noqa: F401  (a fixture, autouse)
from test_llmcompressor_peer import _tensors

OURS = {"qwen2.5-vl": {"scales": "weights", "weight_granularity": "channel"},
        "llava": {"scales": "weights", "weight_granularity": "channel"},
        "deepseek-v3": {"weight_granularity": "block"}}


@pytest.fixture(scope="module")
def folders(next_dir, tmp_path_factory):
    """``{family: (source, ours, llm-compressor's)}``."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    root = tmp_path_factory.mktemp("peer-next")
    run = subprocess.run([str(PEER_PY), str(Path(__file__).with_name("llmcompressor_examples.py")),
                          str(root / "llmcompressor"),
                          *(f"{f}={next_dir(f)}" for f in OURS)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for family, options in OURS.items():
        convert(ConvertConfig(checkpoint=next_dir(family), output=root / "ours" / family,
                              **options))
        out[family] = (next_dir(family), root / "ours" / family, root / "llmcompressor" / family)
    return out


def _qc(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("family", list(OURS))
def test_names_dtypes_shapes(folders, family):
    _src, ours, theirs = folders[family]
    a, b = _tensors(ours), _tensors(theirs)
    extra = set(b) - set(a)
    if family == "llava":  # their example's regexes match nothing: tower and projector in FP8
        assert extra and all(k.startswith(("vision_tower.", "multi_modal_projector."))
                             and k.endswith(".weight_scale") for k in extra), sorted(extra)[:5]
    else:
        assert not extra, sorted(extra)[:5]
    assert set(a) <= set(b), sorted(set(a) - set(b))[:5]
    for name, (dtype, shape) in a.items():
        peer_dtype, peer_shape = b[name]
        assert shape == peer_shape, (name, shape, peer_shape)
        if name.endswith(("weight_scale", "input_scale")):
            assert (dtype, peer_dtype) == ("F32", "BF16"), name
        elif name.removesuffix(".weight") in {k.removesuffix(".weight_scale") for k in extra}:
            assert (dtype, peer_dtype) == ("BF16", "F8_E4M3"), name
        elif name.endswith(".e_score_correction_bias"):
            # transformers keeps it in fp32 (_keep_in_fp32_modules_strict) and llm-compressor
            # saves what it loaded; ours copies the source's bytes (this tiny source: bf16;
            # DeepSeek-V3's own checkpoint stores it in F32, so there both are F32)
            assert (dtype, peer_dtype) == ("BF16", "F32"), name
        else:
            assert dtype == peer_dtype, name
    assert any(d == "F8_E4M3" for d, _ in a.values())


@pytest.mark.parametrize("family", list(OURS))
def test_config_and_ignore(folders, family):
    _src, ours, theirs = folders[family]
    qa, qb = _qc(ours), _qc(theirs)
    for key in ("quant_method", "format", "quantization_status", "kv_cache_scheme"):
        assert qa[key] == qb[key], key
    ga, gb = qa["config_groups"]["group_0"], qb["config_groups"]["group_0"]
    assert ga["targets"] == gb["targets"] == ["Linear"]
    for part in ("weights", "input_activations"):
        for key, value in ga[part].items():  # every field we write, llm-compressor writes too
            assert gb[part][key] == value, (family, part, key)
    ignore_a, ignore_b = set(qa["ignore"]), set(qb["ignore"])
    if family == "llava":
        assert ignore_b == {"language_model.lm_head"}
        assert {"vision_tower.encoder.layers.0.mlp.fc1", "multi_modal_projector.linear_1",
                "model.vision_tower.encoder.layers.0.mlp.fc1"} <= ignore_a
        return
    assert ignore_b <= ignore_a
    added = ignore_a - ignore_b - {"model.embed_tokens"}
    if family == "qwen2.5-vl":  # the names transformers' loader matches, beside the checkpoint's
        assert added == {f"model.{m}" for m in ignore_b if m.startswith("visual.")}
    else:
        assert not added, sorted(added)


def test_transformers_reads_their_vision_tower_without_scales(folders):
    """Why ours lists both names: from_pretrained of llm-compressor's Qwen2.5-VL folder misses
    the vision tower's scales (it quantizes modules that hold bf16 weights); ours loads clean."""
    import transformers

    _src, ours, theirs = folders["qwen2.5-vl"]
    missing = {}
    for name, folder in (("ours", ours), ("theirs", theirs)):
        _model, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            folder, output_loading_info=True)
        missing[name] = info["missing_keys"]
    assert not missing["ours"]
    assert missing["theirs"] and all(k.startswith("model.visual.") for k in missing["theirs"])
