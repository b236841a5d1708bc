"""Folders read as the engines named in their config read them (fp8dir/engines.py).

Each foreign folder is written here by its documented key names (foreign_folders.py), then
edited into what a careless or hostile tool would write: the reader must refuse, naming the
layer, every folder an engine would misread, and its loader label must name only the engines
that run it. Where a claim is about transformers, the real transformers (default
``from_pretrained``) is asked too, so the label cannot drift from what it does.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch
from foreign_folders import ct_folder, deepseek_folder, edit, is_linear, modelopt_folder
from safetensors.torch import load_file

from fp8export.errors import Fp8ExportError
from fp8export.fp8dir.reader import read_fp8_folder

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "tiny-llama"
Q_PROJ = "model.layers.0.self_attn.q_proj"
UP = "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    path = tmp_path_factory.mktemp("engines") / "src"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


_TRANSFORMERS_ERROR = """
import json, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
out = {}
for folder, src, module in json.loads(sys.argv[1]):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    mod = model.get_submodule(module)
    w = load_file(src + "/model.safetensors")[module + ".weight"].float()
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long))  # compressed-tensors decompresses here
        if isinstance(mod, torch.nn.Embedding):
            ids = torch.arange(w.shape[0])
            got, want = mod(ids).float(), w[ids]
        else:
            x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(2))
            got, want = mod(x.to(torch.bfloat16)).float(), x @ w.t()
    out[folder] = float((got - want).norm() / want.norm())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def transformers_error(src, tmp_path_factory):
    """rel-L2 of a module's output as transformers' default from_pretrained loads each folder
    below (whatever module class it builds) against the bf16 source weight's: one process for
    all of them (loading transformers costs more than the models)."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("truth")
    folders = {
        "fine-grained": (deepseek_folder(src, root / "ds", block=(32, 32)),
                         "model.layers.0.mlp.down_proj"),
        "fine-grained renamed": (edit(deepseek_folder(src, root / "ren", block=(32, 32)),
                                      _renamed), "model.layers.0.mlp.down_proj"),
        "ct": (ct_folder(src, root / "ct"), UP),
        "ct fp8 embedding": (ct_folder(src, root / "emb", strategy="channel", static=False,
                                       quantize=lambda n: is_linear(n)
                                       or n == "model.embed_tokens.weight"), "model.embed_tokens"),
        "ct fp8 lm_head": (ct_folder(src, root / "head", config={"ignore": []},
                                     quantize=lambda n: is_linear(n) or n == "lm_head.weight"),
                           "lm_head"),
    }
    args = json.dumps([[str(f), str(src), m] for f, m in folders.values()])
    run = subprocess.run([sys.executable, "-c", _TRANSFORMERS_ERROR, args],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    return {k: (f, errors[str(f)]) for k, (f, _) in folders.items()}


def _transformers_kl(folder: Path, src: Path) -> float:
    """KL(bf16 || the folder as transformers' default from_pretrained loads it)."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(folder)).float()(ids).logits.float()
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


# ------------------------------------------------------------------ scale names and semantics
def _renamed(t: dict) -> None:
    t.update({k.removesuffix("_inv"): t.pop(k) for k in list(t) if k.endswith("_inv")})


def test_fine_grained_folder_with_weight_scale_names_is_refused(src, tmp_path):
    good = deepseek_folder(src, tmp_path / "ds", block=(32, 32))
    bad = edit(deepseek_folder(src, tmp_path / "renamed", block=(32, 32)), _renamed)
    with read_fp8_folder(good):
        pass
    with pytest.raises(Fp8ExportError, match=(
            r"layer model.layers.0.mlp.down_proj: vllm and sglang and transformers "
            r"\(FineGrainedFP8\) read its weight scale from model.layers.0.mlp.down_proj"
            r".weight_scale_inv, which is missing \(the folder stores .*down_proj.weight_scale")):
        read_fp8_folder(bad)


@pytest.mark.parametrize("config,match", [
    ({"ignore": ["lm_head", UP]}, f"layer {UP} is stored in FP8, but the compressed-tensors "
                                  f"config leaves it in high precision \\(its ignore entry "
                                  f"'{UP}' names it\\)"),
    ({"ignore": ["lm_head", "re:.*mlp\\.up_proj$"]}, f"layer {UP} .*its ignore entry "
                                                      "'re:.\\*mlp"),
    ({"config_groups": {"group_0": {"targets": ["re:.*nothing.*"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
        "input_activations": None}}}, "no config group targets it"),
    ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [32, 32],
        "symmetric": True}, "input_activations": None}}},
     r"weight_scale has shape \[1\], but the compressed-tensors config declares block weight "
     r"scales .* as the \[\d, \d\] grid of 32x32 blocks"),
    ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        "input_activations": None}}}, r"weight_scale has shape \[1\], but .* declares channel"),
])
def test_compressed_tensors_config_that_disagrees_with_the_tensors(src, tmp_path, config, match):
    folder = ct_folder(src, tmp_path / "ct", static=False, config=config)
    with pytest.raises(Fp8ExportError, match=match):
        read_fp8_folder(folder)


def test_tensor_strategy_over_block_grids_is_refused(src, tmp_path):
    """The config decides what every loader allocates (compressed-tensors: one value for the
    tensor strategy), so a grid under it is refused, not read by its shape."""
    folder = ct_folder(src, tmp_path / "ct", strategy="block", static=False, config={
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": True}}}})
    with pytest.raises(Fp8ExportError, match=r"weight_scale has shape \[\d, \d\], but the "
                                             r"compressed-tensors config declares tensor weight"):
        read_fp8_folder(folder)


def test_modelopt_exclude_modules_naming_fp8_layers(src, tmp_path):
    folder = modelopt_folder(src, tmp_path / "mo")
    hf = json.loads((folder / "hf_quant_config.json").read_text())
    hf["quantization"]["exclude_modules"] = ["lm_head", "*down_proj*"]
    (folder / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(Fp8ExportError, match=r"layer model.layers.0.mlp.down_proj is stored in "
                                             r"FP8, but the modelopt config leaves it in high "
                                             r"precision \(its exclude_modules entry "
                                             r"'\*down_proj\*' names it\)"):
        read_fp8_folder(folder)


def test_declared_block_size_over_per_tensor_scales(src, tmp_path):
    """quant_method fp8 with weight_block_size [32, 32] over one scale per layer."""
    def per_tensor(t):
        for k in [k for k in t if k.endswith("weight_scale_inv")]:
            w = t[k.removesuffix("_scale_inv")]
            t[k] = torch.tensor([float(t[k].max())])
            del w
    folder = edit(deepseek_folder(src, tmp_path / "ds", block=(32, 32)), per_tensor)
    with pytest.raises(Fp8ExportError, match=r"weight_scale_inv has shape \[1\], but the vllm "
                                             r"config declares block weight scales"):
        read_fp8_folder(folder)


# ----------------------------------------------------------------------- our own folders
@pytest.fixture(scope="module")
def vllm_block(src, tmp_path_factory):
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    out = tmp_path_factory.mktemp("ours") / "vb"
    convert(ConvertConfig(checkpoint=src, output=out, weight_granularity="block",
                          block_size=(32, 32), format="vllm"))
    return out


def test_our_block_folder_with_a_second_weight_scale(vllm_block, tmp_path, run_cli):
    import shutil

    folder = tmp_path / "vb"
    shutil.copytree(vllm_block, folder)
    t = load_file(str(folder / "model.safetensors"))
    t[f"{UP}.weight_scale"] = t[f"{UP}.weight_scale_inv"] * 2  # the one vLLM never reads
    from safetensors.torch import save_file

    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(Fp8ExportError, match=f"layer {UP}: {UP}.weight_scale is stored beside "
                                             f"{UP}.weight_scale_inv"):
        read_fp8_folder(folder)
    r = run_cli("export-onnx", folder, "-o", tmp_path / "m.onnx")
    assert r.exit_code == 1 and "Error:" in r.stderr and UP in r.stderr
    assert not (tmp_path / "m.onnx").exists()


def test_inspect_reads_a_one_column_block_grid_as_blocks(src, tmp_path, run_cli):
    """--block-size 64 on a 64-wide model: every grid has one column (it is not per-channel)."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    out = tmp_path / "b64"
    convert(ConvertConfig(checkpoint=src, output=out, weight_granularity="block",
                          block_size=(64, 64)))
    r = run_cli("inspect", out, "--json")
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.stdout)["tensors"]}
    weights = load_file(str(src / "model.safetensors"))
    row = rows[f"{UP}.weight"]  # [96, 64]: a 2x1 grid
    assert row["note"].startswith("block scales, grid 2x1")
    assert row["amax"] == pytest.approx(float(weights[f"{UP}.weight"].float().abs().max()),
                                        rel=0.07)


# --------------------------------------------------------------------------- size bombs
def test_a_block_size_far_larger_than_the_weights_costs_their_size(src, tmp_path):
    from fp8export.numerics.block import expand_blocks
    from fp8export.runtime.fp8_model import load_fp8_model

    assert tuple(expand_blocks(torch.ones(1, 1), (64, 96), (1 << 16, 1 << 16)).shape) == (64, 96)
    # one 1x1 grid per weight: what a 65536x65536 block is for every weight here
    folder = edit(deepseek_folder(src, tmp_path / "big", block=(128, 128)), lambda t: None)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [1 << 16, 1 << 16]
    (folder / "config.json").write_text(json.dumps(cfg))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with read_fp8_folder(folder) as f:
        layer = f.layers[UP]
        assert layer.block == (96, 64) and tuple(layer.weight_scale.shape) == (1, 1)
        raw = load_file(str(src / "model.safetensors"))[f"{UP}.weight"].float()
        assert float((layer.dequantized() - raw).norm() / raw.norm()) < 0.05
    model = load_fp8_model(folder, dtype=torch.float32, mode="emulate")[0]
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (2, 16)))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    assert grown < 512 * 1024, f"reading and running the folder grew RSS by {grown} KiB"


# ----------------------------------------------------------------- modules that are no linears
def test_fp8_embedding_is_refused_by_name(src, tmp_path, run_cli):
    """model_free_ptq with only lm_head ignored stores embed_tokens in FP8 under a config whose
    groups target Linear layers: transformers loads the codes unscaled (below)."""
    folder = ct_folder(src, tmp_path / "emb", strategy="channel", static=False,
                       quantize=lambda n: is_linear(n) or n == "model.embed_tokens.weight")
    with pytest.raises(Fp8ExportError, match=r"model.embed_tokens.weight is FP8, but "
                                             r"model.embed_tokens is an embedding"):
        read_fp8_folder(folder)
    r = run_cli("inspect", folder)
    assert r.exit_code == 0
    assert "format        compressed-tensors (no engine loads it as written" in r.stdout
    r = run_cli("export-onnx", folder, "-o", tmp_path / "m.onnx")
    assert r.exit_code == 1 and "model.embed_tokens is an embedding" in r.stderr


def test_fp8_router_is_an_error_not_a_crash(tmp_path, run_cli):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "families"))
    from model_families import save_family

    src = save_family("qwen3-moe", tmp_path / "src")
    folder = ct_folder(src, tmp_path / "router", static=False,
                       quantize=lambda n: n.endswith(".weight") and ".mlp." in n
                       and load_file(str(src / "model.safetensors"))[n].dim() == 2)
    router = "model.layers.0.mlp.gate"
    with pytest.raises(Fp8ExportError, match=f"{router}.weight is FP8, but {router} is an MoE "
                                             "router"):
        read_fp8_folder(folder)
    r = run_cli("verify", src, folder, "--data", SAMPLE / "data" / "eval.txt", "--samples", "2",
                "--report-dir", tmp_path / "rep")
    assert r.exit_code == 1 and "Error:" in r.stderr and f"{router} is an MoE router" in r.stderr


def test_mixtral_experts_under_llm_compressor_names_are_refused(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "families"))
    from model_families import save_family

    src = save_family("mixtral", tmp_path / "src")
    leaves = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}

    def rename(t):
        for k in list(t):
            for a, b in leaves.items():
                if ".experts." in k and a in k:
                    t[k.replace(a, b)] = t.pop(k)
    folder = edit(ct_folder(src, tmp_path / "lc", static=False,
                            quantize=lambda n: ".experts." in n), rename)
    with pytest.raises(Fp8ExportError, match=r"names its experts gate_proj/up_proj/down_proj, "
                                             r"but mixtral's loaders read experts.N.w1/w3/w2"):
        read_fp8_folder(folder)


# ------------------------------------------------------------------------------- labels
def test_partial_blocks_are_not_promised_to_transformers(src, tmp_path, run_cli):
    """96 is 1.5 blocks of 64, 32 half of one: transformers fails at the first forward."""
    folder = ct_folder(src, tmp_path / "ct", strategy="block", block=(64, 64), static=False)
    with pytest.raises(Exception):
        _transformers_kl(folder, src)
    with read_fp8_folder(folder) as f:  # k/v and gate/up rows are not whole blocks either
        assert f.loaders.ok == ()
        assert "validate_fp8_block_shape" in f.loaders.not_ok["vllm"]
    r = run_cli("inspect", folder)
    assert "(no engine loads it as written" in r.stdout
    assert "transformers (with compressed-tensors) does not load it as written: 10 layer(s) " \
           "have partial edge blocks" in r.stdout


def test_moe_expert_input_scales_transformers_drops_are_said(tmp_path, run_cli):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "families"))
    from model_families import save_family
    from transformers import AutoModelForCausalLM

    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    src = save_family("qwen3-moe", tmp_path / "src")
    out = tmp_path / "fp8"
    convert(ConvertConfig(checkpoint=src, output=out, scales="calibrate",
                          calib_data=SAMPLE / "data" / "calib.txt", calib_samples=8))
    _, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    dropped = sorted(info["unexpected_keys"])
    assert len(dropped) == 24 and all(k.endswith("input_scale") and ".experts." in k
                                      for k in dropped)
    r = run_cli("inspect", out)
    assert ("transformers (with compressed-tensors; it drops the 24 expert input_scale tensors "
            "as UNEXPECTED and runs the experts without static input quantization)") in r.stdout


def test_gpt2_conv1d_folders_are_promised_to_vllm_only(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "families"))
    from model_families import save_family

    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    src = save_family("gpt2", tmp_path / "src")
    convert(ConvertConfig(checkpoint=src, output=tmp_path / "fp8"))
    with read_fp8_folder(tmp_path / "fp8") as f:
        assert f.loaders.ok == ("vllm",)
        assert "Conv1D" in f.loaders.not_ok["transformers (with compressed-tensors)"]


def test_lm_head_in_fp8_is_not_promised_to_vllm(src, tmp_path):
    folder = ct_folder(src, tmp_path / "head", config={"ignore": []},
                       quantize=lambda n: is_linear(n) or n == "lm_head.weight")
    with read_fp8_folder(folder) as f:
        assert f.loaders.ok == ("transformers (with compressed-tensors)",)
        assert "ParallelLMHead" in f.loaders.not_ok["vllm"]


def test_hand_written_folder_reads_as_written(src, tmp_path):
    """The ct helper itself: its per-tensor static folder reads as static tensor FP8 with
    every engine (a guard on the fixtures the refusals above edit)."""
    with read_fp8_folder(ct_folder(src, tmp_path / "ok")) as f:
        assert (f.format.granularity, f.format.activations) == ("tensor", "static")
        assert f.loaders.ok == ("vllm", "transformers (with compressed-tensors)")


@pytest.mark.slow
def test_transformers_loads_what_the_reader_says_it_loads(transformers_error):
    """The real transformers on the folders above: it reads the fine-grained folder, the
    compressed-tensors one and its FP8 lm_head right, and uses the codes of the renamed
    fine-grained scales and of the FP8 embedding unscaled (the reader refuses those two)."""
    errors = {k: e for k, (_, e) in transformers_error.items()}
    assert errors["fine-grained"] < 0.05 and errors["ct"] < 0.05, errors
    assert errors["ct fp8 lm_head"] < 0.05, errors
    assert errors["fine-grained renamed"] > 10 and errors["ct fp8 embedding"] > 10, errors


_HELD_SCALES = """
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder)
stored = load_file(folder + "/model.safetensors")
held = {n + ".weight_scale": m.weight_scale.detach() for n, m in model.named_modules()
        if isinstance(getattr(m, "weight_scale", None), torch.Tensor)}
assert held, "no weight_scale parameters"
bad = [n for n, v in held.items() if not torch.equal(v.float().reshape(-1),
                                                      stored[n].float().reshape(-1))]
print(len(held), len(bad))
"""


@pytest.mark.slow
def test_transformers_holds_exactly_the_scales_convert_wrote(src, tmp_path):
    """compressed-tensors' loader allocates the scales in the model's BF16: convert's scales are
    BF16 values, so the parameter it loads equals the tensor on disk (and the codes were
    quantized with it)."""
    import subprocess
    import sys

    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    out = tmp_path / "ct"
    convert(ConvertConfig(checkpoint=src, output=out, weight_granularity="channel"))
    run = subprocess.run([sys.executable, "-c", _HELD_SCALES, str(out)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    held, bad = map(int, run.stdout.split()[-2:])
    assert held == 14 and bad == 0
