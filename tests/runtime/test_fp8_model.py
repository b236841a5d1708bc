"""load_fp8_model on the real convert output: Llama (out_in) and GPT-2 Conv1D (in_out) layouts."""

import json

import numpy as np
import pytest
import torch

from fp8export.errors import Fp8ExportError
from fp8export.numerics.metrics import rel_l2
from fp8export.runners.torch_fp8_runner import TorchFp8Runner
from fp8export.runners.torch_runner import TorchRunner
from fp8export.runtime.fp8_linear import Fp8Linear
from fp8export.runtime.fp8_model import fp8_modules, load_fp8_model


@pytest.fixture(scope="module")
def gpt2_pair(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gpt2")
    cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(cfg).to(torch.bfloat16).save_pretrained(root / "ref")
    api.convert(ConvertConfig(checkpoint=root / "ref", output=root / "fp8"))
    return root / "ref", root / "fp8"


def test_gpt2_conv1d_in_out_layout(gpt2_pair):
    ref, fp8 = gpt2_pair
    manifest = json.loads((fp8 / "fp8export.json").read_text())
    layouts = {e["layout"] for e in manifest["quantized"].values()}
    assert layouts == {"in_out"}
    model, _, _, info = load_fp8_model(fp8, mode="emulate")
    mods = fp8_modules(model)
    assert set(mods) == set(manifest["quantized"]) and info["mode"] == "emulate"
    c_attn = mods["transformer.h.0.attn.c_attn"]
    assert (c_attn.out_features, c_attn.in_features) == (96, 32)
    feed = {"input_ids": np.random.default_rng(0).integers(0, 128, (2, 16)),
            "attention_mask": np.ones((2, 16), dtype=np.int64)}
    with TorchRunner(ref, device="cpu") as r, TorchFp8Runner(fp8, device="cpu") as c:
        a, b = r.infer(feed)["logits"], c.infer(feed)["logits"]
    assert a.shape == b.shape == (2, 16, 128)
    # values, not cosine: a wrong scale would move the logits' size (measured rel-L2 0.020)
    assert rel_l2(torch.from_numpy(a), torch.from_numpy(b)) < 0.04


def test_layer_matches_its_dequantized_weight(gpt2_pair):
    """The swapped layer computes x @ (q * scale)^T + b with the stored E4M3 codes."""
    _, fp8 = gpt2_pair
    from safetensors.torch import load_file

    t = load_file(str(next(fp8.glob("*.safetensors"))))
    model, *_ = load_fp8_model(fp8, mode="emulate", dtype=torch.float32)
    layer: Fp8Linear = model.get_submodule("transformer.h.1.mlp.c_fc")
    w = t["transformer.h.1.mlp.c_fc.weight"].float() * t["transformer.h.1.mlp.c_fc.weight_scale"]
    torch.testing.assert_close(layer.weight.float() * layer.weight_scale, w.T)


def test_broken_folder_messages(gpt2_pair, tmp_path):
    import shutil

    _, fp8 = gpt2_pair
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    m = json.loads((bad / "fp8export.json").read_text())
    m["quantized"]["transformer.h.9.attn.c_attn"] = m["quantized"]["transformer.h.0.attn.c_attn"]
    (bad / "fp8export.json").write_text(json.dumps(m))
    # the entry names a module the folder has no scale for (and the architecture lacks)
    with pytest.raises(Fp8ExportError, match="transformer.h.9.attn.c_attn"):
        load_fp8_model(bad)
    with pytest.raises(Fp8ExportError, match="not an FP8 folder"):
        load_fp8_model(tmp_path)
