"""``config.json`` read once, through the guarded reader, and validated before anyone uses it.

A config is a stranger's promise about the weights. Every value fp8export or transformers turns
into a size (an allocation, a loop count) is checked here for type and range, so a
``"vocab_size": 10**12`` or ``"num_hidden_layers": "many"`` ends in one message naming the file
and the key, not in gigabytes allocated or a traceback deep inside transformers. Whether the
sizes agree with the weights is checked later, on the meta device (:mod:`fp8export.models`).

``auto_map`` (custom code the checkpoint wants transformers to import) is recorded as
:class:`RemoteCode` entries; nothing here or anywhere in fp8export runs them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import CONFIG, read_json_object

# Upper bounds far above every released model (Llama 4: 10M positions, 202k vocab; DeepSeek-V3:
# 256 experts, 61 layers; Gemma 3: 262k vocab) and far below what would exhaust a machine.
SIZE_LIMITS = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17, "n_embd": 1 << 17, "d_model": 1 << 17,
    "intermediate_size": 1 << 20, "n_inner": 1 << 20, "ffn_dim": 1 << 20,
    "moe_intermediate_size": 1 << 20, "shared_expert_intermediate_size": 1 << 20,
    "num_hidden_layers": 1024, "n_layer": 1024, "num_layers": 1024,
    "num_attention_heads": 4096, "n_head": 4096, "num_key_value_heads": 4096,
    "head_dim": 1 << 14,
    "max_position_embeddings": 1 << 25, "n_positions": 1 << 25, "n_ctx": 1 << 25,
    "num_experts": 1024, "num_local_experts": 1024, "n_routed_experts": 1024,
    "num_experts_per_tok": 1024, "n_group": 1024, "topk_group": 1024,
    "num_labels": 1 << 20, "type_vocab_size": 1 << 16,
}
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# Sizes that may legitimately be 0 (no shared experts, no token types).
MAY_BE_ZERO = frozenset({"type_vocab_size", "shared_expert_intermediate_size", "n_inner"})
FLOAT_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta",
              "initializer_range")
STR_KEYS = ("model_type", "hidden_act", "activation_function", "torch_dtype", "dtype")
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")
NESTED = ("text_config",)  # multimodal configs keep the language model's sizes here


@dataclass(frozen=True)
class RemoteCode:
    """One ``auto_map`` entry: transformers would import ``reference`` from the checkpoint."""

    file: Path  # the JSON file that names it
    entry: str  # e.g. "AutoModelForCausalLM"
    reference: str  # e.g. "modeling_evil.EvilForCausalLM"

    def describe(self) -> str:
        return f"{self.file}: 'auto_map' entry {self.entry!r} → {self.reference!r}"


def _bad(path: Path, key: str, value: Any, expected: str) -> Fp8ExportError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return Fp8ExportError(f"{path}: {key!r} is {shown}; expected {expected}. Restore the "
                          "model's config.json.")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_keras_config(config: Any) -> bool:
    """A Keras model config (``class_name`` + ``config``) rather than a transformers one."""
    return (isinstance(config, dict) and "class_name" in config and "config" in config
            and "model_type" not in config)


def validate_config(config: Any, path: Path, *, where: str = "") -> dict[str, Any]:
    """Check the types and ranges of the keys listed in this module; return ``config``.

    Keys this module does not know are left alone (configs carry dozens of model-specific
    ones), and a Keras config (no ``model_type``) only needs to be an object.
    """
    if not isinstance(config, dict):
        raise Fp8ExportError(f"{path}: config.json must hold a JSON object, not "
                             f"{type(config).__name__}. Restore the model's config.json.")
    if "class_name" in config and "model_type" not in config:
        return config  # a Keras model config: the Keras reader validates its own structure
    for key, limit in SIZE_LIMITS.items():
        v = config.get(key)
        if v is None:
            continue
        low = 0 if key in MAY_BE_ZERO else 1
        if not _is_int(v) or not low <= v <= limit:
            raise _bad(path, where + key, v, f"an integer from {low} to {limit}")
    for key in FLOAT_KEYS:
        v = config.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                              or not math.isfinite(v) or v < 0):
            raise _bad(path, where + key, v, "a finite number >= 0")
    for key in STR_KEYS:
        v = config.get(key)
        if v is not None and not isinstance(v, str):
            raise _bad(path, where + key, v, "a string")
    for key in TOKEN_ID_KEYS:
        v = config.get(key)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(_is_int(i) and abs(i) < (1 << 31) for i in ids):
            raise _bad(path, where + key, v, "a token id (an integer) or a list of them")
    vocab, pad = config.get("vocab_size"), config.get("pad_token_id")
    if _is_int(vocab) and _is_int(pad) and not -vocab <= pad < vocab:
        raise _bad(path, where + "pad_token_id", pad,
                   f"a token id of the vocabulary (0 .. {vocab - 1}), or null: transformers builds "
                   "the embedding with it as padding_idx and refuses one beyond vocab_size")
    archs = config.get("architectures")
    if archs is not None and (not isinstance(archs, list)
                              or not all(isinstance(a, str) for a in archs)):
        raise _bad(path, where + "architectures", archs, "a list of class names")
    for key in ("tie_word_embeddings", "is_encoder_decoder", "use_cache"):
        v = config.get(key)
        if v is not None and not isinstance(v, bool):
            raise _bad(path, where + key, v, "true or false")
    for key in ("label2id", "id2label", "quantization_config", "rope_scaling", "auto_map"):
        v = config.get(key)
        if v is not None and not isinstance(v, dict):
            raise _bad(path, where + key, v, "a JSON object")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise _bad(path, where + "num_key_value_heads", kv,
                   f"a divisor of num_attention_heads ({heads}): each key/value head serves a "
                   "whole group of query heads")
    _check_routing(config, path, where)
    label2id = config.get("label2id") or {}
    if not all(_is_int(i) and 0 <= i < SIZE_LIMITS["num_labels"] for i in label2id.values()):
        raise _bad(path, where + "label2id", label2id, "label names mapped to class indices")
    remote_code_entries(config, path)  # validates the auto_map shape
    for key in NESTED:
        if isinstance(config.get(key), dict):
            validate_config(config[key], path, where=f"{where}{key}.")
    return config


def _check_routing(config: dict[str, Any], path: Path, where: str) -> None:
    """MoE counts that bound one another: a token picks ``num_experts_per_tok`` distinct experts
    (``torch.topk`` over the experts fails beyond their count), DeepSeek's ``topk_group`` of
    ``n_group`` groups that split the experts evenly."""
    key = next((k for k in EXPERT_COUNT_KEYS if _is_int(config.get(k))), None)
    experts = config.get(key) if key else None
    topk, groups, topk_group = (config.get(k) for k in ("num_experts_per_tok", "n_group",
                                                         "topk_group"))
    if experts is not None and _is_int(topk) and topk > experts:
        raise _bad(path, where + "num_experts_per_tok", topk,
                   f"at most {key} ({experts}): each token is routed to that many distinct "
                   "experts")
    if _is_int(groups) and experts is not None and experts % groups:
        raise _bad(path, where + "n_group", groups,
                   f"a divisor of {key} ({experts}): the experts are split into equal groups")
    if _is_int(groups) and _is_int(topk_group) and topk_group > groups:
        raise _bad(path, where + "topk_group", topk_group,
                   f"at most n_group ({groups}): tokens pick their experts from that many groups")
    if (_is_int(groups) and _is_int(topk_group) and _is_int(topk) and experts is not None
            and topk > topk_group * (experts // groups)):
        raise _bad(path, where + "num_experts_per_tok", topk,
                   f"at most topk_group x experts per group ({topk_group} x "
                   f"{experts // groups}): the experts a token can reach")


_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<index>\d+)\.(?P<part>.+)$")


def check_experts(config: dict[str, Any] | None, names: Iterable[str], where: Path) -> None:
    """Every MoE layer stored one tensor per expert (``<layer>.experts.<i>.<part>``) holds every
    part of every expert: experts ``0 .. E-1`` with ``E`` the config's expert count (without
    one, the layer's highest index + 1). A checkpoint missing an expert cannot be loaded by
    transformers or vLLM (they stack ``E`` experts), so it is refused naming the layer."""
    layers: dict[str, dict[str, set[int]]] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            layers.setdefault(m["layer"], {}).setdefault(m["part"], set()).add(int(m["index"]))
    if not layers:
        return
    key = next((k for k in EXPERT_COUNT_KEYS if _is_int((config or {}).get(k))), None)
    for layer, parts in sorted(layers.items()):
        count = config[key] if key else max(max(have) for have in parts.values()) + 1
        for part, have in sorted(parts.items()):
            missing = sorted(set(range(count)) - have)
            extra = sorted(i for i in have if i >= count)
            if not missing and not extra:
                continue
            said = f"config.json's {key} is {count}" if key else \
                f"its experts are numbered up to {count - 1}"
            shown = ", ".join(map(str, (missing or extra)[:8])) + \
                (" ..." if len(missing or extra) > 8 else "")
            problem = f"expert(s) {shown} have no {part}" if missing else \
                f"expert(s) {shown} are beyond that count"
            raise Fp8ExportError(
                f"{where}: {layer}: {said}, but {problem} ({len(have)} of {count} stored). "
                "Engines stack every expert of a layer, so no loader accepts such a checkpoint; "
                "restore the missing expert weights (or the config's expert count).")


def remote_code_entries(config: dict[str, Any], path: Path) -> list[RemoteCode]:
    """The ``auto_map`` entries of a config or tokenizer config (validated, never imported)."""
    amap = config.get("auto_map")
    if amap is None:
        return []
    if isinstance(amap, list):  # legacy tokenizer form: [slow class, fast class]
        amap = {"AutoTokenizer": amap}
    if not isinstance(amap, dict):
        raise _bad(path, "auto_map", amap, "a JSON object of class references")
    out = []
    for entry, ref in amap.items():
        refs = ref if isinstance(ref, list) else [ref]
        if not all(r is None or isinstance(r, str) for r in refs):
            raise _bad(path, f"auto_map.{entry}", ref, "a class reference string")
        shown = " / ".join(r for r in refs if r)
        if shown:
            out.append(RemoteCode(path, str(entry), shown))
    return out


def read_model_config(folder: Path) -> dict[str, Any] | None:
    """``folder/config.json`` read through the guarded reader and validated; None if absent."""
    path = folder / "config.json"
    if not os.path.lexists(path):
        return None
    return validate_config(read_json_object(path, CONFIG, root=folder, what="config.json"), path)
