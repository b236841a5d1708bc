"""Tiny real checkpoints (saved by transformers' save_pretrained) and a dict-backed reader.

The fixtures in ``tests/conftest.py`` build them; the reader, selection, FP8-folder and convert
tests all use them."""

from __future__ import annotations

from pathlib import Path

import torch

from fp8export.checkpoint.source import Checkpoint, TensorInfo

_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
          torch.int64: "I64", torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3"}


class DictCheckpoint(Checkpoint):
    """A Checkpoint over an in-memory dict, for selection/writer unit tests."""

    def __init__(self, tensors: dict[str, torch.Tensor], config: dict | None = None,
                 file: str = "model.safetensors", path: Path = Path("mem"), state=None):
        super().__init__(path=path, kind="memory", config=config)
        self._t = tensors
        self._file = Path(file)
        self._state = state

    def training_state(self):
        return self._state

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(n, _DTYPE[t.dtype], tuple(t.shape), self._file)
                for n, t in self._t.items()]

    def load(self, name: str) -> torch.Tensor:
        return self._t[name].clone()


def save(model, path: Path, **kwargs) -> Path:
    model.to(torch.bfloat16).save_pretrained(path, **kwargs)
    return path


def tiny_llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    save(LlamaForCausalLM(cfg), path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return path


def tiny_llama_sharded(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama-sharded"
    return save(LlamaForCausalLM(cfg), path, max_shard_size="60KB")


def tiny_gpt2(tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    return save(GPT2LMHeadModel(cfg), tmp_path_factory.mktemp("ckpt") / "tiny-gpt2")


def tiny_bert(tmp_path_factory) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(3)
    cfg = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=256, max_position_embeddings=64)
    return save(BertForMaskedLM(cfg), tmp_path_factory.mktemp("ckpt") / "tiny-bert")
