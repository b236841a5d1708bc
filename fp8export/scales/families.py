"""Module roles per model family: which weights are linear layers, which fuse, which are heads.

A family is recognised from ``config.json`` (``model_type``, else ``architectures``). Its
table names the leaf modules that are linear layers, the sibling projections that serving
stacks fuse into one GEMM (q/k/v, gate/up: they share scales, DESIGN.md), the layers stored
``[in, out]`` (GPT-2 ``Conv1D``), and the head modules that exist in the model even when their
weight is tied and not stored (they must appear in a compressed-tensors ``ignore`` list, or a
``"Linear"`` target would match them).

Checkpoints of unknown families (or without a config) use the fallback rule documented in
:func:`role_of`: every 2-D floating ``*.weight`` is a linear layer unless its module name says
embedding, norm, head or router.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Family:
    """What the selection needs to know about one model family."""

    name: str
    linear: frozenset[str]  # leaf module names of linear layers
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)  # group tag -> sibling leaves
    in_out: frozenset[str] = frozenset()  # leaves stored [in, out] (Conv1D)
    tied_heads: tuple[str, ...] = ()  # head modules that may be tied (absent from the weights)
    # fused groups of the projections under a parent of this leaf name, instead of ``fused``:
    # cross-attention reads q from the decoder and k/v from the encoder (vision, audio), so
    # serving stacks fuse k/v only (vLLM's QKVCrossParallelLinear)
    fused_under: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    # module-name components kept in high precision by default in this family, with the reason
    kept: dict[str, str] = field(default_factory=dict)


_LLAMA = Family(
    name="llama-like",
    linear=frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                      # already-fused projections (Phi-3) and Mixtral experts
                      "qkv_proj", "gate_up_proj", "w1", "w2", "w3"}),
    fused={"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"),
           "w1_w3": ("w1", "w3")},
    tied_heads=("lm_head",),
)
_GPT2 = Family(
    name="gpt2",
    # c_attn is q/k/v already fused into one Conv1D; attn.c_proj and mlp.c_proj share a leaf name.
    linear=frozenset({"c_attn", "c_proj", "c_fc", "q_attn"}),
    in_out=frozenset({"c_attn", "c_proj", "c_fc", "q_attn"}),
    tied_heads=("lm_head",),
)
_BERT = Family(
    name="bert-like",
    # attention.self.{query,key,value}, attention.output.dense, intermediate.dense, output.dense
    linear=frozenset({"query", "key", "value", "dense"}),
    fused={"qkv": ("query", "key", "value")},
    tied_heads=("cls.predictions.decoder", "lm_head.decoder"),
)
_T5 = Family(
    name="t5",
    linear=frozenset({"q", "k", "v", "o", "wi", "wo", "wi_0", "wi_1"}),
    fused={"qkv": ("q", "k", "v"), "wi": ("wi_0", "wi_1")},
    tied_heads=("lm_head",),
)

_CROSS_KV = {"cross_attn": {"kv": ("k_proj", "v_proj")},
             "encoder_attn": {"kv": ("k_proj", "v_proj")}}
# Language towers of vision-language models and the newer decoders: Llama's projections, the
# towers and projectors kept by the component rule of ``default_exclusion``. Mllama's
# cross-attention layers fuse k/v only.
_DECODER = replace(_LLAMA, name="decoder", fused_under=_CROSS_KV)
# DeepSeek-V2/V3 multi-head latent attention: q_a_proj and kv_a_proj_with_mqa read the same
# hidden states and vLLM loads them as one ``fused_qkv_a_proj``; q_b_proj / kv_b_proj read
# different low-rank activations (their norms, q_a_layernorm / kv_a_layernorm, stay as they are).
_MLA = replace(_LLAMA, name="deepseek (MLA)",
               linear=_LLAMA.linear | {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"},
               fused={**_LLAMA.fused, "qkv_a": ("q_a_proj", "kv_a_proj_with_mqa")})
# Hybrids: the recurrent mixers keep what is not a plain linear of the token stream.
_QWEN3_NEXT = replace(_LLAMA, name="qwen3-next", kept={
    "linear_attn": "Gated DeltaNet linear-attention layer (kept in high precision by default, "
                   "as llm-compressor's Qwen3-Next recipe does)"})
_JAMBA = replace(_LLAMA, name="jamba", linear=_LLAMA.linear | {"in_proj", "out_proj"}, kept={
    "x_proj": "Mamba SSM parameter projection (dt, B, C: kept in high precision)",
    "dt_proj": "Mamba SSM time-step projection (kept in high precision; transformers reads its "
               "weight directly)"})
_WHISPER = Family(
    name="whisper",
    # encoder and decoder: self_attn/encoder_attn q/k/v/out_proj, fc1/fc2 (llm-compressor's
    # and ModelOpt's Whisper recipes quantize both stacks and keep proj_out, the tied head)
    linear=frozenset({"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}),
    fused={"qkv": ("q_proj", "k_proj", "v_proj")},
    fused_under=_CROSS_KV,
    tied_heads=("proj_out",),
)

_BY_MODEL_TYPE = {
    **{t: _LLAMA for t in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                           "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi3", "olmo",
                           "olmo2", "granite", "starcoder2", "smollm3")},
    **{t: _DECODER for t in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3",
                             "mllama", "llava", "idefics3", "smolvlm", "llama4", "gpt_oss")},
    **{t: _MLA for t in ("deepseek_v2", "deepseek_v3")},
    "qwen3_next": _QWEN3_NEXT,
    "jamba": _JAMBA,
    "whisper": _WHISPER,
    "gpt2": _GPT2,
    **{t: _BERT for t in ("bert", "roberta", "xlm-roberta", "camembert", "electra")},
    **{t: _T5 for t in ("t5", "mt5", "umt5")},
}
_BY_ARCH_PREFIX = (("Llama", _LLAMA), ("Mistral", _LLAMA), ("Mixtral", _LLAMA), ("Qwen", _LLAMA),
                   ("Gemma", _LLAMA), ("Phi3", _LLAMA), ("GPT2", _GPT2), ("Bert", _BERT),
                   ("Roberta", _BERT), ("XLMRoberta", _BERT), ("T5", _T5), ("MT5", _T5))


def family_of(config: dict[str, Any] | None) -> Family | None:
    """The family table for ``config``, or None (then the fallback rule applies)."""
    if not config:
        return None
    fam = _BY_MODEL_TYPE.get(str(config.get("model_type", "")).lower())
    if fam is not None:
        return fam
    for arch in config.get("architectures") or []:
        for prefix, f in _BY_ARCH_PREFIX:
            if str(arch).startswith(prefix):
                return f
    return None


# --------------------------------------------------------------------------- default exclusions
# Heads and routers match any component of the module name (``cls.predictions.transform.dense``
# is part of the MLM head); embeddings and norms match the leaf only, because containers such as
# Transformer Engine's ``layernorm_mlp.fc1`` or ``embeddings.projection`` hold real linears.
# Lower-cased; the first match names the reason.
_ROUTER = r"(^|\.)(gate|router|shared_expert_gate)(\.|$)"
_COMPONENT_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), kind) for p, kind in (
        (r"(^|\.)(lm_head|output_layer|classifier|score|qa_outputs|pooler|cls|head)(\.|$)"
         r"|^output$", "head"),
        (_ROUTER, "router"),
        # what llm-compressor's and ModelOpt's VLM recipes leave in bf16 (ModelOpt's
        # default_disabled_quantizers: *visual*, *vision_tower*, *vision_model*,
        # *multi_modal_projector*, *embed_vision*); Idefics3's projector is ``connector``
        (r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector|embed_vision|"
         r"connector)(\.|$)", "vision"),
    ))
_LEAF_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), kind) for p, kind in (
        (r"embed|^(wte|wpe|shared|relative_attention_bias)$", "embedding"),
        # whole-leaf match: TE's ``layernorm_qkv`` / ``layernorm_mlp`` are linears, not norms
        (r"^(.*_)?(layer_?norm|rms_?norm|norm|ln(_?f|_\d+)?)$", "norm"),
    ))
_KIND_REASONS = {"head": "output head (kept in high precision by default)",
                 "router": "MoE router/gate (kept in high precision by default)",
                 "embedding": "embedding (kept in high precision by default)",
                 "norm": "normalization (kept in high precision)",
                 "vision": "vision tower or multimodal projector (kept in high precision by "
                           "default, as llm-compressor and ModelOpt do; --include GLOB puts it in "
                           "FP8)"}


def module_kind(module: str) -> str | None:
    """What ``module`` is when its name says it is not a plain linear layer: ``"head"``,
    ``"router"``, ``"embedding"``, ``"norm"`` or ``"vision"`` (a vision tower's or multimodal
    projector's linear); None otherwise."""
    low = module.lower()
    for pattern, kind in _COMPONENT_RULES:
        if pattern.search(low):
            return kind
    low_leaf = leaf(low)
    for pattern, kind in _LEAF_RULES:
        if pattern.search(low_leaf):
            return kind
    return None


def default_exclusion(module: str) -> str | None:
    """The reason ``module`` is left in high precision by default, or None."""
    kind = module_kind(module)
    return _KIND_REASONS[kind] if kind else None


def moe_routers(modules: Iterable[str], names: Iterable[str]) -> list[str]:
    """The ``modules`` that are MoE routers: named like one (``gate``, ``router``,
    ``shared_expert_gate``) beside an ``experts`` module in ``names`` (the checkpoint's tensor
    names). Engines build routers unquantized (vLLM's ``ReplicatedLinear(quant_config=None)``,
    transformers' router classes), so an FP8 router loads as raw codes or not at all."""
    blocks = {n.split(".experts.", 1)[0] for n in names if ".experts." in n}
    router = re.compile(_ROUTER)
    return [m for m in modules if parent(m) in blocks and router.search(leaf(m).lower())]


def leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def parent(module: str) -> str:
    return module.rsplit(".", 1)[0] if "." in module else ""


def role_of(module: str, family: Family | None) -> tuple[str, str | None]:
    """``("linear", None)`` or ``("other", reason)`` for the module owning a 2-D ``.weight``.

    Known family: a linear layer is a module whose leaf name is in the family's table and that
    no default exclusion names. Fallback (unknown family): any module no default exclusion
    names — i.e. every 2-D floating ``*.weight`` that is not an embedding, norm, head or router.
    """
    reason = default_exclusion(module)
    if reason is not None:
        return "other", reason
    if family is not None and family.kept:
        for part in module.split("."):
            if part in family.kept:
                return "other", family.kept[part]
    if family is None or leaf(module) in family.linear:
        return "linear", None
    return "other", f"not a linear layer of the {family.name} family (use --include to quantize)"


def fused_group_of(module: str, family: Family | None) -> tuple[str, tuple[str, ...]] | None:
    """``(group name, sibling module names)`` when ``module`` is one of a fused set, else None."""
    if family is None:
        return None
    name = leaf(module)
    base = parent(module)
    for tag, members in family.fused_under.get(leaf(base), family.fused).items():
        if name in members:
            prefix = f"{base}." if base else ""
            return f"{prefix}{tag}", tuple(f"{prefix}{m}" for m in members)
    return None
