"""Test-only builders: a tiny Llama HF folder, and FP8 folders made from it.

``make_fp8_folder`` uses the real ``fp8export.api.convert``; ``write_fp8_folder`` is a small
independent writer that follows docs/fp8-folder.md (per-tensor E4M3 weights, static input
scales, fused q/k/v and gate/up scales) and keeps the folder contract honest from the
reader's side.
``damage_scale`` multiplies one layer's weight_scale (a "damaged candidate" the gate must fail).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
DAMAGED = "model.layers.1.mlp.up_proj"  # the layer the damaged candidate breaks
GROUPS = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
          "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up"}


def markov_tokens(vocab: int, n: int, length: int, seed: int) -> torch.Tensor:
    """Sequences from a sparse Markov chain: 4 successors a token, p = .55/.25/.12/.08."""
    g = torch.Generator().manual_seed(1234)  # the chain itself is fixed
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.12, 0.08])
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, length):
        k = torch.multinomial(probs.expand(n, 4), 1, generator=g).squeeze(1)
        out[:, t] = succ[out[:, t - 1], k]
    return out


def make_tiny_llama(path: Path, *, vocab: int = 256, hidden: int = 64, layers: int = 2,
                    seed: int = 0, train_steps: int = 60) -> Path:
    """A small Llama trained briefly on a Markov chain, saved as a bf16 HF folder.

    Training gives it peaked, text-like next-token distributions (a random-init model has
    nearly flat logits, on which top-1 agreement means nothing).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(train_steps):
        ids = markov_tokens(vocab, 16, 32, seed=step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model = model.to(torch.bfloat16).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _calibrate_inputs(model, names, vocab: int, seed: int = 1) -> dict[str, float]:
    amax: dict[str, float] = {}
    hooks = []
    for n in names:
        def hook(mod, inp, out, n=n):
            amax[n] = max(amax.get(n, 0.0), float(inp[0].detach().float().abs().max()))
        hooks.append(model.get_submodule(n).register_forward_hook(hook))
    with torch.inference_mode():
        model(input_ids=markov_tokens(vocab, 16, 32, seed=10_000 + seed))
    for h in hooks:
        h.remove()
    return amax


def write_fp8_folder(src: Path, out: Path, *, static: bool = True) -> Path:
    """Independent writer of an FP8 folder per docs/fp8-folder.md (compressed-tensors style)."""
    from safetensors.torch import load_file, save_file

    from fp8export.models import load_model
    from fp8export.numerics.fp8 import amax_to_scale, quantize_e4m3
    from fp8export.numerics.metrics import sqnr_db

    model, config = load_model(src, dtype=torch.float32)
    state = load_file(str(src / "model.safetensors"))
    names = [f"model.layers.{i}.{lin}" for i in range(config["num_hidden_layers"])
             for lin in LINEARS]
    in_amax = _calibrate_inputs(model, names, config["vocab_size"]) if static else {}
    w_amax = {n: float(state[f"{n}.weight"].float().abs().max()) for n in names}

    def group_of(n):
        layer, _, lin = n.partition(".layers.")[2].partition(".")
        g = GROUPS.get(lin)
        return None if g is None else f"model.layers.{layer}.{g}"

    groups: dict[str, list[str]] = {}
    for n in names:
        if group_of(n):
            groups.setdefault(group_of(n), []).append(n)
    for members in groups.values():
        for table in (w_amax, in_amax):
            if table:
                m = max(table[x] for x in members)
                for x in members:
                    table[x] = m
    tensors = dict(state)
    quantized = {}
    for n in names:
        w = state[f"{n}.weight"]
        ws = amax_to_scale(w_amax[n], n)
        q = quantize_e4m3(w, ws)
        tensors[f"{n}.weight"] = q
        tensors[f"{n}.weight_scale"] = torch.tensor([float(ws)], dtype=torch.float32)
        entry = {"weight": f"{n}.weight", "shape": list(w.shape), "layout": "out_in",
                 "source_dtype": "BF16", "fused_group": group_of(n),
                 "weight_amax": w_amax[n], "weight_scale": float(ws),
                 "weight_scale_source": "weights",
                 "weight_sqnr_db": sqnr_db(w.float(), q.float() * float(ws))}
        if static:
            s = amax_to_scale(in_amax[n], n)
            tensors[f"{n}.input_scale"] = torch.tensor([float(s)], dtype=torch.float32)
            entry.update(input_amax=in_amax[n], input_scale=float(s),
                         input_scale_source="calibration")
        quantized[n] = entry
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = dict(config)
    # compressed-tensors' FP8 scheme as docs/fp8-folder.md spells it: E4M3 weights per tensor,
    # static per-tensor inputs, every Linear but the head
    args = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
            "dynamic": False}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                      "input_activations": dict(args) if static else None}},
        "ignore": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    manifest = {"format_version": 1, "tool": {"name": "fp8export", "version": "test"},
                "activation_scheme": "static" if static else "dynamic",
                "quantized": quantized, "excluded": {"lm_head": "output head"}, "notes": []}
    (out / "fp8export.json").write_text(json.dumps(manifest, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def make_fp8_folder(src: Path, out: Path, *, static: bool = True) -> Path:
    """The real ``fp8export convert`` (static input scales calibrated on Markov-chain text)."""
    import numpy as np

    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    calib = None
    if static:
        calib = out.parent / "calib.npz"
        np.savez(calib, input_ids=markov_tokens(256, 16, 32, seed=5).numpy())
    api.convert(ConvertConfig(checkpoint=src, output=out, calib_data=calib))
    return out


def damage_scale(fp8_dir: Path, module: str, factor: float = 8.0,
                 name: str = "weight_scale") -> None:
    """Multiply ``<module>.<name>`` (``weight_scale_inv``: a block grid as vLLM names it) by
    ``factor`` in place, and the scale the manifest records with it: a consistent folder with
    one wrong scale, as a converter bug would write it (an edit that leaves the manifest behind
    is refused before verify measures anything). The benchmarks use it too."""
    from safetensors.torch import load_file, save_file

    key = f"{module}.{name}"
    for f in sorted(fp8_dir.glob("*.safetensors")):
        tensors = load_file(str(f))
        if key in tensors:
            tensors[key] = tensors[key] * factor
            save_file(tensors, str(f))
            manifest_path = fp8_dir / "fp8export.json"
            if manifest_path.is_file():
                manifest = json.loads(manifest_path.read_text())
                entry = (manifest.get("quantized") or {}).get(module) or {}
                if name == "weight_scale":
                    if isinstance(entry.get("weight_scale"), (int, float)):
                        entry["weight_scale"] = float(tensors[key].float().max())
                else:  # a grid: the manifest records its largest scale
                    for k in ("weight_scale", "weight_scale_max"):
                        if isinstance(entry.get(k), (int, float)):
                            entry[k] *= factor
                manifest_path.write_text(json.dumps(manifest, indent=2))
            return
    raise KeyError(key)


def one_torch_thread():
    """These models are tiny: one thread is faster, and far faster on a busy 2-core machine
    (two spinning intra-op threads under load made training ~30x slower). A generator for a
    session fixture: the thread count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
