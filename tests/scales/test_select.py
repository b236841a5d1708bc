"""Selection: which tensors become FP8, per family, with globs and fused groups."""

from __future__ import annotations

import pytest
import torch

from fp8export.checkpoint.source import open_checkpoint
from fp8export.errors import Fp8ExportError
from fp8export.scales.select import select_targets


def _select(path, **kw):
    with open_checkpoint(path) as ckpt:
        return select_targets(ckpt.tensors(), ckpt.config, **kw), ckpt.tensors()


def test_llama_gqa_targets_and_fused_groups(tiny_llama):
    sel, tensors = _select(tiny_llama)
    assert sel.family == "llama-like"
    leaves = sorted({t.module.rsplit(".", 1)[1] for t in sel.targets})
    assert leaves == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                      "v_proj"]
    assert len(sel.targets) == 14
    qkv = sorted(sel.groups["model.layers.0.self_attn.qkv"])
    assert qkv == ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj",
                   "model.layers.0.self_attn.v_proj"]
    by_mod = {t.module: t for t in sel.targets}
    # GQA: k/v are narrower than q, and still one group
    assert by_mod["model.layers.0.self_attn.k_proj"].shape == (32, 64)
    assert by_mod["model.layers.0.self_attn.q_proj"].shape == (64, 64)
    assert by_mod["model.layers.1.mlp.up_proj"].fused_group == "model.layers.1.mlp.gate_up"
    assert by_mod["model.layers.1.mlp.down_proj"].fused_group is None
    assert all(t.layout == "out_in" for t in sel.targets)
    assert "output head" in sel.excluded["lm_head.weight"]
    assert "embedding" in sel.excluded["model.embed_tokens.weight"]
    assert "lm_head" in sel.ignore and "model.embed_tokens" in sel.ignore
    # every tensor is either a target weight or excluded with a reason
    assert {t.weight for t in sel.targets} | set(sel.excluded) == {t.name for t in tensors}


def test_gpt2_conv1d_is_in_out_and_tied_head_ignored(tiny_gpt2):
    sel, _ = _select(tiny_gpt2)
    assert sel.family == "gpt2"
    mods = {t.module for t in sel.targets}
    assert mods == {f"transformer.h.{i}.{m}" for i in range(2)
                    for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    by_mod = {t.module: t for t in sel.targets}
    assert by_mod["transformer.h.0.attn.c_attn"].shape == (64, 192)  # [in, out]
    assert by_mod["transformer.h.0.mlp.c_fc"].layout == "in_out"
    assert sel.groups == {}  # c_attn is already fused
    assert "embedding" in sel.excluded["transformer.wte.weight"]
    assert "lm_head" in sel.ignore  # tied: not stored, but a Linear in the model


def test_bert_qkv_group_and_heads_excluded(tiny_bert):
    sel, _ = _select(tiny_bert)
    assert sel.family == "bert-like"
    mods = {t.module for t in sel.targets}
    assert "bert.encoder.layer.0.attention.self.query" in mods
    assert "bert.encoder.layer.1.output.dense" in mods
    assert "bert.encoder.layer.0.intermediate.dense" in mods
    assert len(mods) == 12
    assert sorted(sel.groups["bert.encoder.layer.0.attention.self.qkv"]) == [
        "bert.encoder.layer.0.attention.self.key", "bert.encoder.layer.0.attention.self.query",
        "bert.encoder.layer.0.attention.self.value"]
    assert "output head" in sel.excluded["cls.predictions.transform.dense.weight"]
    assert "embedding" in sel.excluded["bert.embeddings.word_embeddings.weight"]
    assert "cls.predictions.decoder" in sel.ignore


def test_globs_exclude_wins_over_include(tiny_llama):
    sel, _ = _select(tiny_llama, exclude=("model.layers.0.*",), include=("lm_head",))
    mods = {t.module for t in sel.targets}
    assert not any(m.startswith("model.layers.0.") for m in mods)
    assert "lm_head" in mods and "lm_head" not in sel.ignore
    assert "--exclude" in sel.excluded["model.layers.0.mlp.down_proj.weight"]
    assert "model.layers.0.mlp.down_proj" in sel.ignore
    both, _ = _select(tiny_llama, exclude=("lm_head",), include=("lm_head",))
    assert "lm_head" not in {t.module for t in both.targets}


def test_partial_fused_group_is_reported(tiny_llama):
    sel, _ = _select(tiny_llama, exclude=("*.layers.0.self_attn.k_proj",))
    assert sorted(sel.groups["model.layers.0.self_attn.qkv"]) == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    assert any("k_proj" in n and "fused" in n for n in sel.notes)


def test_no_fuse_scales_records_no_groups(tiny_llama):
    sel, _ = _select(tiny_llama, fuse_scales=False)
    assert sel.groups == {} and all(t.fused_group is None for t in sel.targets)


def test_unmatched_glob_is_a_note(tiny_llama):
    sel, _ = _select(tiny_llama, exclude=("no.such.*",))
    assert any("no.such.*" in n for n in sel.notes)


def test_fallback_rule_without_config(dict_ckpt):
    t = {"tok_embeddings.weight": torch.zeros(10, 4), "blocks.0.fc1.weight": torch.ones(8, 4),
         "blocks.0.fc1.bias": torch.ones(8), "blocks.0.norm.weight": torch.ones(4),
         "blocks.0.router.weight": torch.ones(2, 4), "conv.weight": torch.ones(4, 3, 3, 3),
         "head.weight": torch.ones(10, 4)}
    ckpt = dict_ckpt(t)
    sel = select_targets(ckpt.tensors(), None)
    assert sel.family is None
    assert [x.module for x in sel.targets] == ["blocks.0.fc1"]
    assert "router" in sel.excluded["blocks.0.router.weight"]
    assert "3 input channels" in sel.excluded["conv.weight"]
    assert "bias" in sel.excluded["blocks.0.fc1.bias"]
    assert "output head" in sel.excluded["head.weight"]
    assert {"lm_head", "head", "blocks.0.router", "tok_embeddings"} <= set(sel.ignore)


def test_integer_and_fp8_weights_are_one_error_naming_each(dict_ckpt):
    t = {"a.q_proj.weight": torch.ones(4, 4, dtype=torch.int32),
         "b.q_proj.weight": torch.ones(4, 4).to(torch.float8_e4m3fn),
         "c.q_proj.weight": torch.ones(4, 4)}
    ckpt = dict_ckpt(t, config={"model_type": "llama"})
    with pytest.raises(Fp8ExportError) as err:
        select_targets(ckpt.tensors(), ckpt.config)
    msg = str(err.value)
    assert "2 tensor(s)" in msg and "a.q_proj.weight" in msg and "I32" in msg
    assert "b.q_proj.weight" in msg and "already F8_E4M3" in msg and "--exclude" in msg


def test_an_fp8_checkpoint_is_one_short_error_saying_what_to_do(dict_ckpt):
    t = {f"model.layers.{i}.self_attn.{p}.weight": torch.ones(4, 4).to(torch.float8_e4m3fn)
         for i in range(6) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    t["model.embed_tokens.weight"] = torch.ones(8, 4)
    ckpt = dict_ckpt(t, config={"model_type": "llama"})
    with pytest.raises(Fp8ExportError) as err:
        select_targets(ckpt.tensors(), ckpt.config)
    msg = str(err.value)
    assert msg.startswith("24 linear weight(s) are already F8_E4M3 (e.g. ")
    assert "already quantized to FP8" in msg and "fp8export verify" in msg
    assert "bf16/fp16/fp32 original" in msg
    assert "--exclude" not in msg  # excluding every layer would not help
    assert msg.count("F8_E4M3") == 1 and len(msg) < 400


def test_te_layernorm_linears_are_linears_not_norms(dict_ckpt):
    # Transformer Engine's LayerNormLinear/LayerNormMLP hold real GEMM weights under
    # "layernorm_*" containers; only whole-leaf norm names are norms.
    t = {"layers.0.self_attention.layernorm_qkv.weight": torch.ones(12, 4),
         "layers.0.self_attention.layernorm_qkv.layer_norm_weight": torch.ones(4),
         "layers.0.layernorm_mlp.fc1.weight": torch.ones(16, 4),
         "layers.0.layernorm_mlp.fc2.weight": torch.ones(4, 16),
         "layers.0.final_layer_norm.weight": torch.ones(4, 4)}
    sel = select_targets(dict_ckpt(t).tensors(), None)
    assert [x.module for x in sel.targets] == ["layers.0.self_attention.layernorm_qkv",
                                               "layers.0.layernorm_mlp.fc1",
                                               "layers.0.layernorm_mlp.fc2"]
    assert "normalization" in sel.excluded["layers.0.final_layer_norm.weight"]


def test_t5_family_table(dict_ckpt):
    names = ["shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight",
             "encoder.block.0.layer.0.SelfAttention.k.weight",
             "encoder.block.0.layer.0.SelfAttention.v.weight",
             "encoder.block.0.layer.0.SelfAttention.o.weight",
             "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
             "encoder.block.0.layer.1.DenseReluDense.wi_0.weight",
             "encoder.block.0.layer.1.DenseReluDense.wi_1.weight",
             "encoder.block.0.layer.1.DenseReluDense.wo.weight",
             "encoder.final_layer_norm.weight", "lm_head.weight"]
    t = {n: torch.ones(8) if n.endswith("norm.weight") else torch.ones(8, 8) for n in names}
    sel = select_targets(dict_ckpt(t, config={"model_type": "t5"}).tensors(),
                         {"model_type": "t5"})
    assert sel.family == "t5"
    assert len(sel.targets) == 7
    assert sorted(sel.groups) == ["encoder.block.0.layer.0.SelfAttention.qkv",
                                  "encoder.block.0.layer.1.DenseReluDense.wi"]
    assert "embedding" in sel.excluded[
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    assert "embedding" in sel.excluded["shared.weight"]
