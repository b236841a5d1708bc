"""llm-compressor 0.14 as the peer: its FP8_BLOCK output next to ours on the same model, and its
FP8_DYNAMIC, FP8_BLOCK and FP8 (static) outputs read, inspected and verified by fp8export.

llm-compressor pins transformers <= 5.17 and compressed-tensors 0.19, older than the dev venv's,
so it runs in a venv of its own (``scripts/peer_venv.sh`` -> ``.venv-peers``) as a subprocess
(``llmcompressor_run.py``). Without that venv these tests skip, naming the script.

Measured differences from our compressed-tensors block output, asserted as such:
* scale dtype: ours F32 (DESIGN.md), llm-compressor's the weight dtype (BF16); the values are
  equal, ragged edge blocks included (each from its own elements): ours are rounded to the
  model's BF16, the dtype transformers holds them in;
* codes: about 3% differ, because llm-compressor divides the BF16 weight by the BF16 scale in
  BF16 (the quotient rounded to 8 mantissa bits before the E4M3 cast); that division reproduces
  every one of its codes, and ours (float32 division, one rounding) are the nearest codes to
  ``w / scale``, with the higher weight SQNR;
* ``ignore``: ours also lists ``model.embed_tokens`` (every 2-D weight left in high precision);
* config keys llm-compressor adds that we leave to compressed-tensors' defaults: ``version``,
  ``sparsity_config``, ``transform_config``, per group ``format``, and per args ``observer``,
  ``observer_kwargs``, ``actorder``, ``group_size``/``block_structure`` null where unused,
  ``scale_dtype``, ``zp_dtype``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from peer_venv import PEER_PY, needs_peer  # noqa: F401  (a fixture, autouse)

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "tiny-llama"
RUN = Path(__file__).with_name("llmcompressor_run.py")


def _llmcompressor(scheme: str, model: Path, out: Path, *calib: str) -> Path:
    run = subprocess.run([str(PEER_PY), str(RUN), scheme, str(model), str(out), *calib],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def _tensors(folder: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()), f.get_tensor(k))
                for k in f.keys()}


@pytest.fixture(scope="module")
def block_pair(tmp_path_factory):
    """The same ragged tiny Llama (MLP 320 = 2.5 blocks) through both tools."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    root = tmp_path_factory.mktemp("peer-block")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "src")
    convert(ConvertConfig(checkpoint=root / "src", output=root / "ours",
                          weight_granularity="block"))
    return root / "src", root / "ours", _llmcompressor("FP8_BLOCK", root / "src",
                                                       root / "theirs")


def test_names_dtypes_shapes_and_scales(block_pair):
    _, ours, theirs = block_pair
    a, b = _tensors(ours), _tensors(theirs)
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    scales = [k for k in a if k.endswith(".weight_scale")]
    assert len(scales) == 14
    for name, (dtype, shape, value) in a.items():
        peer_dtype, peer_shape, peer_value = b[name]
        assert shape == peer_shape, name
        if name in scales:
            assert (dtype, peer_dtype) == ("F32", "BF16"), name
            # the same block amaxes, edge blocks included, rounded to BF16 alike
            assert torch.equal(value, peer_value.float()), name
        else:
            assert dtype == peer_dtype, name
    grids = {k: a[k][1] for k in scales if ".layers.0." in k}
    assert grids["model.layers.0.mlp.gate_proj.weight_scale"] == (3, 2)
    assert grids["model.layers.0.mlp.down_proj.weight_scale"] == (2, 3)


def test_codes_differ_by_the_peers_bf16_division(block_pair):
    from fp8export.numerics.block import expand_blocks
    from fp8export.numerics.metrics import sqnr_db

    src, ours, theirs = block_pair
    a, b = _tensors(ours), _tensors(theirs)
    source = {k: (d, s, v) for k, (d, s, v) in _tensors(src).items()}
    differ = total = 0
    err = {"ours": [], "theirs": []}
    for name in (k for k in a if a[k][0] == "F8_E4M3"):
        w = source[name][2]  # bf16
        scale = b[name.replace(".weight", ".weight_scale")][2]  # bf16, equal to ours
        grid = expand_blocks(scale, tuple(w.shape), (128, 128))
        bf16_division = (w / grid).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(bf16_division.view(torch.uint8), b[name][2].view(torch.uint8)), name
        differ += int((a[name][2].view(torch.uint8) != b[name][2].view(torch.uint8)).sum())
        total += w.numel()
        for who, q in (("ours", a[name][2]), ("theirs", b[name][2])):
            err[who].append(sqnr_db(w.float(), q.float() * grid.float()))
    assert 0.01 < differ / total < 0.06, differ / total
    assert all(o >= t for o, t in zip(err["ours"], err["theirs"])), err


def test_config_fields(block_pair):
    _, ours, theirs = block_pair
    qa = json.loads((ours / "config.json").read_text())["quantization_config"]
    qb = json.loads((theirs / "config.json").read_text())["quantization_config"]
    for key in ("quant_method", "format", "quantization_status", "kv_cache_scheme"):
        assert qa[key] == qb[key], key
    ga, gb = qa["config_groups"]["group_0"], qb["config_groups"]["group_0"]
    assert ga["targets"] == gb["targets"] == ["Linear"]
    for part in ("weights", "input_activations"):
        for key, value in ga[part].items():  # every field we write, llm-compressor writes too
            assert gb[part][key] == value, (part, key)
        extra = {k for k, v in gb[part].items() if k not in ga[part] and v not in (None, {})}
        assert extra <= {"observer"}, extra  # weights: "memoryless_minmax"
    assert gb["input_activations"]["strategy"] == "group"
    assert gb["input_activations"]["group_size"] == 128
    assert gb["weights"]["block_structure"] == [128, 128]
    assert qb["ignore"] == ["lm_head"] and qa["ignore"] == ["lm_head", "model.embed_tokens"]


def test_our_runtime_runs_both_alike(block_pair):
    """Same format, same model, through the one reader and the FP8 runtime: both folders are
    the same distance from the bf16 model (their codes differ where BF16 and F32 scales round
    differently, so the two FP8 models differ by about as much as each differs from bf16)."""
    from transformers import AutoModelForCausalLM

    from fp8export.numerics.metrics import rel_l2
    from fp8export.runtime.fp8_model import load_fp8_model

    src, ours, theirs = block_pair
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        base = ref(input_ids=ids).logits
    errors = []
    for folder in (ours, theirs):
        model, _, _, info = load_fp8_model(folder, dtype=torch.float32, mode="emulate")
        assert info["weight_granularity"] == "block" and info["dynamic_activations"] == "group"
        with torch.no_grad():
            errors.append(rel_l2(base, model(input_ids=ids).logits))
    assert max(errors) <= 0.15 and abs(errors[0] - errors[1]) <= 0.25 * errors[0], errors


@pytest.fixture(scope="module")
def sample_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer-sample")
    model = SAMPLE / "model"
    return {"FP8_DYNAMIC": _llmcompressor("FP8_DYNAMIC", model, root / "dyn"),
            "FP8_BLOCK": _llmcompressor("FP8_BLOCK", model, root / "block"),
            "FP8": _llmcompressor("FP8", model, root / "static",
                                  str(SAMPLE / "data" / "calib.txt"), "16")}


@pytest.mark.parametrize("scheme,weights,activations", [
    ("FP8_DYNAMIC", "channel scales", "dynamic per token"),
    ("FP8_BLOCK", "block scales, 128x128 blocks", "dynamic per token group of 128"),
    ("FP8", "tensor scales", "static (42 static input scales)")])
def test_inspect_names_producer_format_and_granularity(sample_folders, run_cli, scheme, weights,
                                                       activations):
    r = run_cli("inspect", sample_folders[scheme])
    assert r.exit_code == 0, r.output
    assert "written by    compressed-tensors 0.19.0" in r.stdout
    assert f"weights       {weights}" in r.stdout
    assert f"activations   {activations}" in r.stdout
    assert "format        compressed-tensors" in r.stdout


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8_BLOCK", "FP8"])
def test_verify_bf16_against_the_llmcompressor_folder(sample_folders, tmp_path, run_cli, scheme):
    rd = tmp_path / "rep"
    r = run_cli("verify", SAMPLE / "model", sample_folders[scheme], "--data",
                SAMPLE / "data" / "eval.txt", "--samples", "8", "--report-dir", rd)
    assert r.exit_code == 0, r.output
    rep = json.loads((rd / "report.json").read_text())
    assert rep["passed"] and rep["metrics"]["top1_agreement"] > 0.97
    assert any(n.startswith("candidate FP8 folder: compressed-tensors") for n in rep["notes"])
    assert rep["metrics"]["kl_mean"] < 1e-3
