"""Write a small FP8 folder per docs/fp8-folder.md from a random tiny Llama (test helper).

Independent of ``fp8export convert`` on purpose: these tests pin the export contract to the
documented folder format. The scales follow DESIGN.md (amax / 448; fused q/k/v and gate/up share
one weight scale and one input scale); input amaxes come from a forward pass over random tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3, tensor_amax

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
          "up_proj": "gate_up"}


def tiny_llama(seed: int = 0, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**TINY, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # less uniform weights than the init, so layers differ in range
        for p in model.parameters():
            p.mul_(1.0 + torch.rand_like(p))
    return model.to(dtype)


def _group_key(name: str) -> str:
    parent, leaf = name.rsplit(".", 1)
    return f"{parent}.{GROUPS[leaf]}" if leaf in GROUPS else name


def make_fp8_folder(out: Path, *, seed: int = 0, dynamic: tuple[str, ...] = (),
                    manifest: bool = True) -> Path:
    """Write the folder; layers whose name ends with one of ``dynamic`` get no input_scale."""
    model = tiny_llama(seed)
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    amax_in: dict[str, float] = {}

    def hook(name):
        def fn(_mod, args):
            amax_in[name] = max(amax_in.get(name, 0.0), tensor_amax(args[0]))
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model(input_ids=torch.randint(0, TINY["vocab_size"], (4, 16), generator=gen))
    for h in handles:
        h.remove()
    w_amax: dict[str, float] = {}
    i_amax: dict[str, float] = {}
    for n, m in linears.items():
        g = _group_key(n)
        w_amax[g] = max(w_amax.get(g, 0.0), tensor_amax(m.weight))
        i_amax[g] = max(i_amax.get(g, 0.0), amax_in[n])
    tensors: dict[str, torch.Tensor] = {}
    quantized = {}
    for name, t in model.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if mod in linears and name.endswith(".weight"):
            g = _group_key(mod)
            ws = amax_to_scale(w_amax[g], name)
            tensors[name] = quantize_e4m3(t, ws)
            tensors[f"{mod}.weight_scale"] = torch.tensor([float(ws)], dtype=torch.float32)
            entry = {"weight": name, "shape": list(t.shape), "layout": "out_in",
                     "source_dtype": "BF16", "fused_group": g if g != mod else None,
                     "weight_amax": w_amax[g], "weight_scale": float(ws),
                     "weight_scale_source": "weights", "input_amax": None, "input_scale": None,
                     "input_scale_source": None}
            if not any(mod.endswith(d) for d in dynamic):
                s = amax_to_scale(i_amax[g], mod)
                tensors[f"{mod}.input_scale"] = torch.tensor([float(s)], dtype=torch.float32)
                entry.update(input_amax=i_amax[g], input_scale=float(s),
                             input_scale_source="calibration")
            quantized[mod] = entry
        else:
            tensors[name] = t.contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"))
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    if manifest:
        doc = {"format_version": 1, "tool": {"name": "fp8export", "version": "test"},
               "activation_scheme": "mixed" if dynamic else "static",
               "quantized": quantized, "excluded": {"lm_head": "output head"}, "notes": []}
        (out / "fp8export.json").write_text(json.dumps(doc, indent=2))
    return out
