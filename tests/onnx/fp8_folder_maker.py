"""Tiny Llama sources and FP8 folders for the export tests, through the real ``convert``.

``make_source`` writes a random tiny Llama as a Hugging Face folder (bf16 safetensors);
``make_fp8_folder`` runs ``fp8export.api.convert`` on it, with calibrated static input scales
(``scales="calibrate"``) or weight scales only (``scales="weights"``: dynamic activations).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)


def tiny_llama(seed: int = 0, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # less uniform than the init, so layers differ in range
        for p in model.parameters():
            p.mul_(1.0 + torch.rand_like(p))
    return model.to(dtype)


def make_source(out: Path, seed: int = 0) -> Path:
    tiny_llama(seed).save_pretrained(str(out))
    return Path(out)


def make_fp8_folder(out: Path, *, scales: str = "calibrate", seed: int = 0, **options) -> Path:
    """Source + calibration tokens + ``convert`` -> the FP8 folder at ``out`` (``options``: more
    ConvertConfig fields, e.g. ``weight_granularity="channel"``)."""
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    out = Path(out)
    src = make_source(out.parent / f"{out.name}-src", seed)
    calib = None
    if scales == "calibrate":
        calib = out.parent / f"{out.name}-calib.npz"
        ids = np.random.RandomState(seed + 1).randint(0, TINY["vocab_size"], (8, 16))
        np.savez(calib, input_ids=ids.astype(np.int64))
    api.convert(ConvertConfig(checkpoint=src, output=out, scales=scales, calib_data=calib,
                              **options))
    return out


def token_feed(batch: int, seq: int, seed: int = 0, vocab: int = 256) -> dict:
    """Random token ids and an all-ones mask, as numpy int64 arrays."""
    import numpy as np

    rng = np.random.RandomState(seed)
    ids = rng.randint(0, vocab, (batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}
