"""Fixtures: a tiny Llama folder (random weights, a word-level tokenizer) built in a tmp dir."""

from __future__ import annotations

from pathlib import Path

import pytest

WORDS = ("the cat sat on a mat and dog ran far away from big red house with small blue "
         "door under old tree near river bank").split()


def build_tiny_llama(folder: Path, *, seed: int = 0, max_positions: int = 64) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=2,
                      eos_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture()
def calib_txt(tmp_path) -> Path:
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(24)]
    p = tmp_path / "calib.txt"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p
