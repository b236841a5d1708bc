"""Builders of tiny checkpoints for the calibration tests (imported by conftest)."""

from __future__ import annotations

from pathlib import Path

WORDS = ("the cat sat on a mat and dog ran far away from big red house with small blue "
         "door under old tree near river bank").split()


def build_tokenizer(folder: Path, *, drop: str | None = None):
    """A word-level tokenizer that adds <s> like Llama's; ``drop``: characters normalised away."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if drop:
        tok.normalizer = normalizers.Replace(Regex(f"[{drop}]"), "")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return fast, vocab


def build_tiny_llama(folder: Path, *, seed: int = 0, max_positions: int = 64) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast, vocab = build_tokenizer(folder)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=2,
                      eos_token_id=3, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
