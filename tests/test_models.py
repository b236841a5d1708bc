"""Building models from untrusted configs: no custom code, shapes checked before allocation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp8export.errors import Fp8ExportError
from fp8export.models import empty_model, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent / "corrupt"))
from corpus_files import LLAMA_CONFIG, llama_tensors  # noqa: E402


def _folder(tmp_path: Path, config: dict, tensors=None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors if tensors is not None else llama_tensors(),
              str(tmp_path / "model.safetensors"))
    return tmp_path


def _peak_after_load(folder: Path) -> tuple[str, int]:
    """``load_model(folder)`` in a fresh process: (outcome, peak RSS in bytes)."""
    import subprocess

    code = ("import resource\n"
            "from fp8export.errors import Fp8ExportError\n"
            "from fp8export.models import load_model\n"
            "try:\n"
            f"    load_model({str(folder)!r}); print('loaded')\n"
            "except Fp8ExportError as exc:\n"
            "    print('refused:', exc)\n"
            "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "peak" in r.stdout, r.stdout + r.stderr
    return r.stdout.rsplit("peak", 1)[0], int(r.stdout.rsplit("peak", 1)[1])


def test_config_larger_than_the_weights_allocates_nothing(tmp_path):
    """2^24 vocabulary rows over 64-row weights: 1 GiB of embeddings if the model were built
    before the shapes were compared. Against a baseline measured the same way: loading the
    honest checkpoint in a fresh process."""
    honest, baseline = _peak_after_load(_folder(tmp_path / "honest", LLAMA_CONFIG))
    assert honest.startswith("loaded"), honest
    outcome, peak = _peak_after_load(_folder(tmp_path / "lying",
                                             {**LLAMA_CONFIG, "vocab_size": 1 << 24}))
    assert outcome.startswith("refused:") and "shape" in outcome, outcome
    assert peak - baseline < 200 << 20, (
        f"peak RSS {peak >> 20} MiB against {baseline >> 20} MiB: the model was allocated")


def test_layer_count_beyond_the_weights_is_refused_before_building(tmp_path):
    folder = _folder(tmp_path, {**LLAMA_CONFIG, "num_hidden_layers": 1000})
    with pytest.raises(Fp8ExportError, match="num_hidden_layers.*0..0"):
        load_model(folder)


def test_missing_weights_are_found_on_the_meta_device(tmp_path):
    tensors = llama_tensors()
    del tensors["model.layers.0.mlp.down_proj.weight"]
    folder = _folder(tmp_path, LLAMA_CONFIG, tensors)
    with pytest.raises(Fp8ExportError, match="missing.*down_proj"):
        load_model(folder)


@pytest.mark.parametrize("change, match", [
    ({"hidden_act": "no_such_activation"}, "no_such_activation"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"intermediate_size": -1}, "intermediate_size"),
])
def test_bad_config_values_are_one_error(tmp_path, change, match):
    folder = _folder(tmp_path, {**LLAMA_CONFIG, **change})
    with pytest.raises(Fp8ExportError, match=match):
        load_model(folder)


def test_attention_kernel_from_the_config_is_ignored(tmp_path):
    folder = _folder(tmp_path, {**LLAMA_CONFIG, "_attn_implementation": "flash_attention_3",
                                "attn_implementation": "flash_attention_3"})
    model, _ = load_model(folder)
    assert model.config._attn_implementation in ("sdpa", "eager")


def test_custom_code_that_is_needed_is_refused_naming_the_entry(tmp_path):
    marker = tmp_path / "PWNED"
    folder = _folder(tmp_path / "ckpt", {
        **LLAMA_CONFIG, "model_type": "vit", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "evil.EvilModel"},
        "_name_or_path": str(tmp_path / "ckpt")})
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(Fp8ExportError) as err:
        load_model(folder)
    assert "'auto_map' entry 'AutoModelForCausalLM'" in str(err.value)
    assert "evil.EvilModel" in str(err.value) and "config.json" in str(err.value)
    assert not marker.exists()


def test_auto_map_covered_by_a_builtin_class_is_ignored(tmp_path, capfd):
    # DeepSeek/Phi-3 style: auto_map left in a config transformers now implements itself
    folder = _folder(tmp_path, {**LLAMA_CONFIG, "auto_map": {
        "AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}})
    model, _ = load_model(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert "auto_map' ignored" in capfd.readouterr().err


def test_tied_parameters_count_as_present(tmp_path):
    """BERT's decoder.bias is the same parameter as predictions.bias (saved once)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    BertForMaskedLM(cfg).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, dtype=torch.float32)
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias


def test_empty_model_without_shapes_still_refuses_code(tmp_path):
    cfg = {**LLAMA_CONFIG, "model_type": "vit", "architectures": ["EvilForCausalLM"],
           "auto_map": {"AutoModelForCausalLM": "evil.EvilModel"}}
    with pytest.raises(Fp8ExportError, match="auto_map"):
        empty_model(cfg, tmp_path)
