"""Tiny random models of the families people quantize, built and saved by transformers itself.

``save_family(name, folder)`` builds the architecture with ``AutoConfig.for_model`` +
``from_config`` (random weights, seeded), saves it with ``save_pretrained`` in bf16 (so the
files on disk are what transformers 5 writes, e.g. per-expert MoE tensors) and copies the sample
tokenizer beside it. Sizes are the smallest that keep every quantized GEMM's K and N multiples of
16 (``torch._scaled_mm``): hidden 64, 2 layers, 4 heads of 16, 4 experts (top 2) for MoE.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "samples" / "tiny-llama" / "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB = 1962  # the sample tokenizer's
_IDS = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_DECODER = {**_IDS, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 256}
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}

FAMILIES: dict[str, tuple[str, str, dict]] = {
    # name: (model_type, architecture, config values)
    "llama": ("llama", "LlamaForCausalLM", {**_DECODER, "tie_word_embeddings": False}),
    "llama-tied": ("llama", "LlamaForCausalLM", {**_DECODER, "tie_word_embeddings": True}),
    "mistral": ("mistral", "MistralForCausalLM", {**_DECODER, "sliding_window": 64}),
    "mixtral": ("mixtral", "MixtralForCausalLM", {**_DECODER, **_MOE, "intermediate_size": 32}),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", _DECODER),  # q/k/v carry a bias
    "qwen3": ("qwen3", "Qwen3ForCausalLM", _DECODER),  # q/k RMSNorm
    "qwen3-moe": ("qwen3_moe", "Qwen3MoeForCausalLM",
                  {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "norm_topk_prob": True}),
    "gemma2": ("gemma2", "Gemma2ForCausalLM",
               {**_DECODER, "sliding_window": 64, "query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM",
               {**_DECODER, "sliding_window": 64, "query_pre_attn_scalar": 16}),
    "phi3": ("phi3", "Phi3ForCausalLM", {k: v for k, v in _DECODER.items() if k != "head_dim"}),
    "olmo2": ("olmo2", "Olmo2ForCausalLM", _DECODER),
    "granite": ("granite", "GraniteForCausalLM", _DECODER),
    "gpt2": ("gpt2", "GPT2LMHeadModel",
             {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256,
              "bos_token_id": 1, "eos_token_id": 2}),
}
MOE_FAMILIES = ("mixtral", "qwen3-moe")
ROUTER_GAIN = 16.0


def save_family(name: str, folder: Path, seed: int = 0) -> Path:
    """Build family ``name`` with random weights and save it (bf16) with the sample tokenizer."""
    import torch
    import transformers

    model_type, arch, values = FAMILIES[name]
    config = transformers.AutoConfig.for_model(model_type, **values)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.bfloat16).eval()
    # A trained router picks its experts by a margin; a random one ties them, so any rounding
    # would flip the routing and the accuracy checks would measure that noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") and p.shape[0] != config.hidden_size:
                p.mul_(ROUTER_GAIN)
    folder = Path(folder)
    model.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER / f, folder / f)
    return folder
