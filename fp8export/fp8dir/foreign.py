"""The reader's description of an FP8 folder that fp8export did not write.

``reader.read_fp8_folder`` calls :func:`foreign_manifest` when a folder has no fp8export.json
but declares FP8 in a dialect the serving stacks load (``reference/fp8_checkpoint_formats.md``):

- **compressed-tensors** (llm-compressor): ``config_groups`` with 8-bit float weights of
  strategy ``tensor`` (``weight_scale [1]``), ``channel`` (``[out, 1]``) or ``block``
  (``block_structure``, ``[ceil(out/bn), ceil(in/bk)]``); inputs static (``input_scale``),
  dynamic per ``tensor``/``token``/``group`` (``group_size``), or absent (weight-only);
  ``kv_cache_scheme`` with ``<attn>.k_scale``/``v_scale``.
- **quant_method fp8**: per tensor (AutoFP8, vLLM: ``weight_scale``, ``input_scale`` when
  ``activation_scheme`` is static; transformers' own per-tensor form, ``weight_block_size:
  null`` with ``weight_scale_inv`` / ``activation_scale``), or fine-grained with
  ``weight_block_size`` (DeepSeek-V3, Qwen3-FP8: ``weight_scale_inv`` grids, dynamic
  per-token-group activations).
- **ModelOpt** ``quant_algo: FP8`` (``hf_quant_config.json``, or ``quant_method: modelopt`` in
  config.json): per-tensor 0-dim scales, static inputs, KV scales on ``k_proj``/``v_proj``.

It returns the structure of fp8export.json (``quantized`` entries with the tensor names, the
granularity, the block size and the activation mode of every FP8 linear, ``kv_cache``,
``loaded_by``, ``notes``) built from the config and the tensor headers only: no code from the
folder runs, the JSON files come through the guarded opener, and the reader then validates
every scale tensor (positive and finite) exactly as it does for its own folders. **The config
decides** what each layer is, as it does for every engine that loads the folder
(:mod:`fp8export.fp8dir.engines`): which modules are FP8, the strategy and block size of their
weight scales, static or dynamic inputs and the tensor names. The tensors must agree with it;
where they do not (a grid under a ``tensor`` strategy, a per-tensor scale under a declared
block size, a layer the ``ignore`` list names, a scale under another dialect's name), the
folder is refused with the layer named, because an engine would misread it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.errors import Fp8ExportError

if TYPE_CHECKING:
    from fp8export.fp8dir.reader import FolderTensors

HF_QUANT_CONFIG = "hf_quant_config.json"


def hf_quant_config(folder: Path) -> dict[str, Any] | None:
    """ModelOpt's ``hf_quant_config.json`` of ``folder`` (guarded), or None."""
    path = folder / HF_QUANT_CONFIG
    if not path.is_file():
        return None
    from fp8export.io.guarded import CONFIG, read_json_object

    return read_json_object(path, CONFIG, root=folder, what="ModelOpt quantization config")


def declared_fp8(folder: Path) -> bool:
    """Whether ``folder``'s config.json or hf_quant_config.json declares FP8 weights in a
    dialect :func:`foreign_manifest` reads."""
    from fp8export.checkpoint.model_config import read_model_config
    from fp8export.fp8dir.engines import ct_fp8_groups, modelopt_facts

    config = read_model_config(folder) or {}
    qc = config.get("quantization_config")
    mo = modelopt_facts(qc if isinstance(qc, dict) else None, hf_quant_config(folder))
    if mo is not None:
        return str(mo.get("quant_algo", "")).upper() == "FP8"
    if not isinstance(qc, dict):
        return False
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return True
    return method == "compressed-tensors" and bool(ct_fp8_groups(qc))


def _bad(folder: Path, what: str) -> Fp8ExportError:
    return Fp8ExportError(f"{folder}: {what}")


def folder_reading(folder: Path, config: dict[str, Any], infos: dict[str, Any]):
    """The folder's :class:`~fp8export.fp8dir.engines.Reading`: how the engines its config
    names read it (``infos``: its tensors)."""
    from fp8export.fp8dir.engines import reading_of

    qc = config.get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    fp8 = [n[: -len(".weight")] for n, i in infos.items()
           if i.dtype == "F8_E4M3" and n.endswith(".weight")]
    suffixes = {s for m in fp8 for s in ("weight_scale", "weight_scale_inv")
                if f"{m}.{s}" in infos}
    return reading_of(folder, qc, hf_quant_config(folder), suffixes)


def foreign_manifest(folder: Path, config: dict[str, Any], tensors: FolderTensors
                     ) -> dict[str, Any]:
    """The fp8export.json structure for a folder another tool wrote (see the module
    docstring). Raises naming the tensor or the config key when the folder is not one the
    reader can describe, or one its engines would misread."""
    from fp8export.fp8dir.engines import judge_layers, loaders

    infos = tensors.infos
    reading = folder_reading(folder, config, infos)
    layers = judge_layers(folder, reading, infos, config)
    if not layers:
        raise _bad(folder, f"the {reading.dialect} config declares FP8, but no tensor is "
                           "F8_E4M3. The folder is incomplete or holds unquantized weights.")
    quantized: dict[str, Any] = {}
    for name, lr in layers.items():
        scheme = lr.scheme
        static = lr.input_scale_tensor is not None
        quantized[name] = {
            "weight": f"{name}.weight", "layout": "out_in", "shape": list(lr.shape),
            "granularity": scheme.strategy, "weight_scale_tensor": lr.weight_scale_tensor,
            "input_scale_tensor": lr.input_scale_tensor,
            "block_size": list(scheme.block) if scheme.block else None,
            "dynamic": "tensor" if static else scheme.inputs,
            "group_size": None if static else scheme.group_size, "fused_group": None}
    static = [m for m, e in quantized.items() if e["input_scale_tensor"]]
    scheme = "mixed" if 0 < len(static) < len(quantized) else (
        "static" if static else "dynamic")
    modes = sorted({e["dynamic"] for e in quantized.values() if not e["input_scale_tensor"]})
    kinds = sorted({e["granularity"] for e in quantized.values()})
    used = {t for e in quantized.values() for t in (e["weight_scale_tensor"],
                                                     e["input_scale_tensor"]) if t}
    excluded = {n: "not FP8 in the folder" for n in infos
                if n not in used and not (infos[n].dtype == "F8_E4M3"
                                          and n[: -len(".weight")] in quantized)}
    scale_dtypes = {e["weight_scale_tensor"]: infos[e["weight_scale_tensor"]].dtype
                    for e in quantized.values()}
    found = loaders(reading, layers, config, scale_dtypes)
    qc = config.get("quantization_config")
    out = {
        "format_version": 1, "foreign": True, "producer": reading.producer,
        "output_format": reading.dialect, "activation_scheme": scheme,
        "weight_granularity": kinds[0] if len(kinds) == 1 else "mixed",
        "dynamic_activations": modes[0] if len(modes) == 1 else ("mixed" if modes else
                                                                 "tensor"),
        "quantization_config": qc if isinstance(qc, dict) else {},
        "quantized": quantized, "excluded": excluded, "loaded_by": list(found.ok),
        "not_loaded_by": dict(found.not_ok),
        "notes": [f"written by {reading.producer}, not by fp8export: layers, scales and "
                  "activation modes read from its config and tensors"],
        "source": None,
    }
    if "none" in modes:
        out["notes"].append("some layers quantize weights only (no input quantization): "
                            "they run with 16-bit activations")
    out["notes"].extend(_fused_groups(quantized, tensors, config))
    kv = _kv(folder, infos) if reading.kv else None
    if kv:
        out["kv_cache"] = kv
    return out


def _kv(folder: Path, infos: dict) -> dict[str, Any] | None:
    """KV-cache scales the config declares: ``<attn>.k_scale``/``v_scale`` or ModelOpt's
    ``<attn>.k_proj.k_scale``/``<attn>.v_proj.v_scale``, one value each."""
    layers: dict[str, Any] = {}
    for name in infos:
        for k_suffix, v_suffix in ((".k_scale", ".v_scale"),
                                   (".k_proj.k_scale", ".v_proj.v_scale")):
            if not name.endswith(k_suffix):
                continue
            attn = name[: -len(k_suffix)]
            v_name = attn + v_suffix
            if v_name not in infos or (attn in layers):
                continue
            for t in (name, v_name):
                n = 1
                for d in infos[t].shape:
                    n *= d
                if n != 1:
                    raise _bad(folder, f"{t} has shape {list(infos[t].shape)}: per-head KV "
                                       "cache scales are not supported (one per layer is).")
            layers[attn] = {"k_scale_tensor": name, "v_scale_tensor": v_name}
    if not layers:
        return None
    return {"dtype": "float8_e4m3fn", "granularity": "tensor", "layers": layers}


def _fused_groups(quantized: dict[str, Any], tensors: FolderTensors, config: dict[str, Any]
                  ) -> list[str]:
    """Name each per-tensor layer's fused group (q/k/v, gate/up) in its entry, so the runtime
    runs a group whose scales are equal as one GEMM; a note where they differ, because vLLM
    re-quantizes such a group to its largest scale while the runtime keeps each member's."""
    from fp8export.scales.families import family_of, fused_group_of

    family = family_of(config)
    groups: dict[str, list[str]] = {}
    for name, entry in quantized.items():
        found = fused_group_of(name, family) if entry["granularity"] == "tensor" else None
        if found is not None:
            groups.setdefault(found[0], []).append(name)
    differ = []
    for group, members in groups.items():
        if len(members) < 2:
            continue
        scales = {float(tensors[quantized[m]["weight_scale_tensor"]].float().reshape(-1)[0])
                  for m in members}
        if len(scales) > 1:
            differ.append(group)
            continue
        for m in members:
            quantized[m]["fused_group"] = group
    if not differ:
        return []
    return [f"{len(differ)} fused group(s) (q/k/v, gate/up) have per-tensor weight scales that "
            "differ between members, e.g. " + ", ".join(differ[:3]) + ": vLLM re-quantizes each "
            "such group to its largest scale when it loads it; verify runs every member with "
            "its own scale, as transformers does"]
