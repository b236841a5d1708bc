"""The reader's description of an FP8 folder that fp8export did not write.

``reader.read_fp8_folder`` calls :func:`foreign_manifest` when a folder has no fp8export.json
but declares FP8 in a dialect the serving stacks load (``reference/fp8_checkpoint_formats.md``):

- **compressed-tensors** (llm-compressor): ``config_groups`` with 8-bit float weights of
  strategy ``tensor`` (``weight_scale [1]``), ``channel`` (``[out, 1]``) or ``block``
  (``block_structure``, ``[ceil(out/bn), ceil(in/bk)]``); inputs static (``input_scale``),
  dynamic per ``tensor``/``token``/``group`` (``group_size``), or absent (weight-only);
  ``kv_cache_scheme`` with ``<attn>.k_scale``/``v_scale``.
- **quant_method fp8**: per tensor (AutoFP8, vLLM: ``weight_scale``, ``input_scale`` when
  ``activation_scheme`` is static), or fine-grained with ``weight_block_size`` (DeepSeek-V3,
  Qwen3-FP8: ``weight_scale_inv`` grids, dynamic per-token-group activations); transformers'
  static ``activation_scale`` is read as the input scale.
- **ModelOpt** ``quant_algo: FP8`` (``hf_quant_config.json``, or ``quant_method: modelopt`` in
  config.json): per-tensor 0-dim scales, static inputs, KV scales on ``k_proj``/``v_proj``.

It returns the structure of fp8export.json (``quantized`` entries with the tensor names, the
granularity, the block size and the activation mode of every FP8 linear, ``kv_cache``,
``notes``) built from the config and the tensor headers only: no code from the folder runs, the
JSON files come through the guarded opener, and the reader then validates every scale tensor
(shape against the weight, positive and finite) exactly as it does for its own folders. What a
layer does is decided by the tensors on disk where they say it (a stored ``input_scale`` means
static inputs; a scale's shape means per-tensor, per-channel or a block grid) and by the config
where they cannot (how dynamic inputs are scaled); where the two disagree, the folder is refused
with the layer named. Config ``targets`` given as regular expressions are never evaluated.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8export.errors import Fp8ExportError

if TYPE_CHECKING:
    from fp8export.fp8dir.reader import FolderTensors

HF_QUANT_CONFIG = "hf_quant_config.json"
_SCALE_NAMES = ("weight_scale", "weight_scale_inv")
_INPUT_NAMES = ("input_scale", "activation_scale")
_SUPPORTED = ("compressed-tensors with 8-bit float weights (llm-compressor's FP8, FP8_DYNAMIC, "
              "FP8_BLOCK), quant_method fp8 (AutoFP8, DeepSeek-V3/Qwen3 fine-grained "
              "weight_block_size), ModelOpt quant_algo FP8")


def _hf_quant_config(folder: Path) -> dict[str, Any] | None:
    path = folder / HF_QUANT_CONFIG
    if not path.is_file():
        return None
    from fp8export.io.guarded import CONFIG, read_json_object

    return read_json_object(path, CONFIG, root=folder, what="ModelOpt quantization config")


def _modelopt(qc: dict[str, Any] | None, hf: dict[str, Any] | None) -> dict[str, Any] | None:
    """ModelOpt's facts (``quant_algo``, ``kv_cache_quant_algo``, ``producer``) from either
    file, or None when neither declares ModelOpt."""
    if isinstance(hf, dict) and isinstance(hf.get("quantization"), dict):
        return {**hf["quantization"], "producer": hf.get("producer")}
    if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "modelopt":
        kv = qc.get("kv_cache_scheme")
        return {"quant_algo": qc.get("quant_algo"), "producer": qc.get("producer"),
                "kv_cache_quant_algo": "FP8" if isinstance(kv, dict) else None}
    return None


def _ct_fp8_groups(qc: dict[str, Any]) -> list[dict[str, Any]]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict):
        return []
    out = []
    for g in groups.values():
        w = g.get("weights") if isinstance(g, dict) else None
        if isinstance(w, dict) and w.get("type") == "float" and w.get("num_bits") == 8:
            out.append(g)
    return out


def declared_fp8(folder: Path) -> bool:
    """Whether ``folder``'s config.json or hf_quant_config.json declares FP8 weights in a
    dialect :func:`foreign_manifest` reads."""
    from fp8export.checkpoint.model_config import read_model_config

    config = read_model_config(folder) or {}
    qc = config.get("quantization_config")
    mo = _modelopt(qc if isinstance(qc, dict) else None, _hf_quant_config(folder))
    if mo is not None:
        return str(mo.get("quant_algo", "")).upper() == "FP8"
    if not isinstance(qc, dict):
        return False
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return True
    return method == "compressed-tensors" and bool(_ct_fp8_groups(qc))


def _bad(folder: Path, what: str) -> Fp8ExportError:
    return Fp8ExportError(f"{folder}: {what}")


def foreign_manifest(folder: Path, config: dict[str, Any], tensors: FolderTensors
                     ) -> dict[str, Any]:
    """The fp8export.json structure for a folder another tool wrote (see the module
    docstring). Raises naming the tensor or the config key when the folder is not one the
    reader can describe."""
    qc = config.get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    mo = _modelopt(qc or None, _hf_quant_config(folder))
    if mo is not None:
        if str(mo.get("quant_algo", "")).upper() != "FP8":
            raise _bad(folder, f"ModelOpt quant_algo {str(mo.get('quant_algo'))[:30]!r} is not "
                               f"FP8; fp8export reads {_SUPPORTED}.")
        rules = _Rules("modelopt", _producer(mo.get("producer"), "modelopt"), static_only=True,
                       kv=str(mo.get("kv_cache_quant_algo") or "").upper() == "FP8")
    else:
        method = str(qc.get("quant_method", "")).lower()
        if method == "fp8":
            rules = _fp8_rules(folder, qc)
        elif method == "compressed-tensors" and _ct_fp8_groups(qc):
            rules = _ct_rules(folder, qc)
        else:
            raise _bad(folder, f"quantization_config quant_method {method or None!r} is not an FP8 "
                               f"dialect fp8export reads ({_SUPPORTED}).")
    return rules.manifest(folder, tensors, qc, config)


def _producer(value: Any, default: str) -> str:
    if isinstance(value, dict):
        name = str(value.get("name") or default)[:40]
        version = str(value.get("version") or "")[:20]
        return f"{name} {version}".strip()
    return default


class _Rules:
    """How one dialect turns tensors into layers: block sizes it declares, how its dynamic
    inputs are scaled (by target name, then by weight granularity), whether inputs must be
    static, and whether it declares an FP8 KV cache."""

    def __init__(self, dialect: str, producer: str, *, blocks: list[tuple[int, int]] = (),
                 dynamic: list[tuple[list[str], str | None, str, int | None]] = (),
                 static_only: bool = False, static_declared: bool = True, kv: bool = False):
        self.dialect, self.producer = dialect, producer
        self.blocks = list(blocks)
        # (exact target names, weight strategy or None, input mode, group size)
        self.dynamic = list(dynamic)
        self.static_only, self.static_declared, self.kv = static_only, static_declared, kv

    def dynamic_mode(self, folder: Path, name: str, granularity: str
                     ) -> tuple[str, int | None]:
        if self.static_only or not self.dynamic:
            raise _bad(folder, f"layer {name} has no input scale, but the {self.dialect} "
                               "config declares static activations. The folder is incomplete.")
        picks = [d for d in self.dynamic if name in d[0]] or \
            [d for d in self.dynamic if d[1] in (None, granularity)] or self.dynamic
        modes = {(d[2], d[3]) for d in picks}
        if len(modes) != 1:
            raise _bad(folder, f"layer {name}: the config declares several dynamic input schemes "
                               f"({sorted(m for m, _ in modes)}) and none names this layer; "
                               "fp8export cannot tell which one it runs.")
        return modes.pop()

    def manifest(self, folder: Path, tensors: FolderTensors, qc: dict[str, Any],
                 config: dict[str, Any]) -> dict[str, Any]:
        from fp8export.numerics.block import grid_shape, infer_block

        infos = tensors.infos
        fp8 = sorted(n for n, i in infos.items() if i.dtype.startswith("F8"))
        odd = [n for n in fp8 if infos[n].dtype != "F8_E4M3" or not n.endswith(".weight")
               or len(infos[n].shape) != 2]
        if odd:
            i = infos[odd[0]]
            raise _bad(folder, f"{odd[0]} is {i.dtype} {list(i.shape)}; fp8export reads FP8 "
                               "(E4M3) linear weights stored 2-D as <module>.weight "
                               f"({len(odd)} tensor(s) are not).")
        if not fp8:
            raise _bad(folder, f"the {self.dialect} config declares FP8, but no tensor is "
                               "F8_E4M3. The folder is incomplete or holds unquantized weights.")
        quantized: dict[str, Any] = {}
        for wname in fp8:
            name = wname[: -len(".weight")]
            shape = tuple(infos[wname].shape)
            scales = [f"{name}.{s}" for s in _SCALE_NAMES if f"{name}.{s}" in infos]
            inputs = [f"{name}.{s}" for s in _INPUT_NAMES if f"{name}.{s}" in infos]
            if len(scales) != 1 or len(inputs) > 1:
                found = scales if len(scales) != 1 else inputs
                raise _bad(folder, f"layer {name}: {len(found)} of "
                                   f"{_SCALE_NAMES if len(scales) != 1 else _INPUT_NAMES} are "
                                   "stored; exactly one weight scale and at most one input "
                                   "scale are expected.")
            sshape = tuple(infos[scales[0]].shape)
            numel = 1
            for d in sshape:
                numel *= d
            block = None
            if numel == 1:
                granularity = "tensor"
            elif sshape in ((shape[0],), (shape[0], 1)):
                granularity = "channel"
            elif len(sshape) == 2:
                granularity = "block"
                # the config's block sizes are what every loader uses; only a config that
                # declares none lets the grid's shape name the block
                fits = [b for b in self.blocks if grid_shape(shape, b) == sshape]
                block = fits[0] if fits else None if self.blocks else infer_block(sshape, shape)
                if block is None:
                    raise _bad(folder, f"{scales[0]} is {list(sshape)}: not a scale grid of the "
                                       f"{list(shape)} weight for any declared block size "
                                       f"{[list(b) for b in self.blocks]}.")
            else:
                raise _bad(folder, f"{scales[0]} has shape {list(sshape)}: neither one scale, "
                                   f"one per output channel nor a block grid of {list(shape)}.")
            if inputs:
                if not self.static_declared:
                    raise _bad(folder, f"layer {name} stores {inputs[0]}, but the config declares "
                                       "dynamic activations only; the folder is inconsistent.")
                mode, group = "tensor", None
            else:
                mode, group = self.dynamic_mode(folder, name, granularity)
            quantized[name] = {
                "weight": wname, "layout": "out_in", "shape": list(shape),
                "granularity": granularity, "weight_scale_tensor": scales[0],
                "input_scale_tensor": inputs[0] if inputs else None,
                "block_size": list(block) if block else None,
                "dynamic": mode, "group_size": group, "fused_group": None}
        static = [m for m, e in quantized.items() if e["input_scale_tensor"]]
        scheme = "mixed" if 0 < len(static) < len(quantized) else (
            "static" if static else "dynamic")
        modes = sorted({e["dynamic"] for e in quantized.values() if not e["input_scale_tensor"]})
        kinds = sorted({e["granularity"] for e in quantized.values()})
        excluded = {n: "not FP8 in the folder" for n in infos
                    if n not in fp8 and not any(n == e["weight_scale_tensor"]
                                                or n == e["input_scale_tensor"]
                                                for e in quantized.values())}
        out = {
            "format_version": 1, "foreign": True, "producer": self.producer,
            "output_format": self.dialect, "activation_scheme": scheme,
            "weight_granularity": kinds[0] if len(kinds) == 1 else "mixed",
            "dynamic_activations": modes[0] if len(modes) == 1 else ("mixed" if modes else
                                                                     "tensor"),
            "quantization_config": qc, "quantized": quantized, "excluded": excluded,
            "notes": [f"written by {self.producer}, not by fp8export: layers, scales and "
                      "activation modes read from its config and tensors"],
            "source": None,
        }
        if "none" in modes:
            out["notes"].append("some layers quantize weights only (no input quantization): "
                                "they run with 16-bit activations")
        out["notes"].extend(_fused_groups(quantized, tensors, config))
        kv = self._kv(folder, infos) if self.kv else None
        if kv:
            out["kv_cache"] = kv
        return out

    def _kv(self, folder: Path, infos: dict) -> dict[str, Any] | None:
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


def _block_of(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16 for v in value):
        return int(value[0]), int(value[1])
    return None


def _fp8_rules(folder: Path, qc: dict[str, Any]) -> _Rules:
    scheme = str(qc.get("activation_scheme", "")).lower()
    if scheme not in ("static", "dynamic"):
        raise _bad(folder, f"quantization_config activation_scheme is {scheme or None!r}; quant_"
                           "method fp8 needs 'static' or 'dynamic'.")
    raw = qc.get("weight_block_size")
    block = _block_of(raw)
    if raw is not None and block is None:
        raise _bad(folder, f"quantization_config weight_block_size is {str(raw)[:40]!r}, not two "
                           "positive integers.")
    if block is not None:
        if scheme != "dynamic":
            raise _bad(folder, "weight_block_size needs activation_scheme dynamic (vLLM and "
                               "transformers run block-scaled FP8 with dynamic activations).")
        return _Rules("vllm", "quant_method fp8, fine-grained (DeepSeek-V3 style)",
                      blocks=[block], dynamic=[([], "block", "group", block[1])],
                      static_declared=False, kv=qc.get("kv_cache_scheme") is not None)
    return _Rules("vllm", "quant_method fp8 (AutoFP8 / vLLM)",
                  dynamic=[([], None, "tensor", None)] if scheme == "dynamic" else [],
                  static_only=scheme == "static", static_declared=scheme == "static",
                  kv=qc.get("kv_cache_scheme") is not None)


def _ct_rules(folder: Path, qc: dict[str, Any]) -> _Rules:
    blocks: list[tuple[int, int]] = []
    dynamic: list[tuple[list[str], str | None, str, int | None]] = []
    static = False
    for g in _ct_fp8_groups(qc):
        w = g["weights"]
        strategy = str(w.get("strategy", "tensor"))
        if strategy not in ("tensor", "channel", "block"):
            raise _bad(folder, f"compressed-tensors weight strategy {strategy[:20]!r} is not one "
                               "fp8export reads (tensor, channel, block).")
        if strategy == "block":
            block = _block_of(w.get("block_structure"))
            if block is None:
                raise _bad(folder, "compressed-tensors block strategy without a valid "
                                   "block_structure.")
            blocks.append(block)
        targets = [t for t in g.get("targets") or [] if isinstance(t, str)]
        names = [t for t in targets if not t.startswith("re:")]
        inp = g.get("input_activations")
        if inp is None:
            dynamic.append((names, strategy, "none", None))
            continue
        if not isinstance(inp, dict) or inp.get("type") != "float" or inp.get("num_bits") != 8:
            raise _bad(folder, "compressed-tensors input activations that are not 8-bit float; "
                               "fp8export reads FP8 (W8A8) and weight-only FP8.")
        if not inp.get("dynamic"):
            static = True
            continue
        mode = str(inp.get("strategy", "tensor"))
        size = inp.get("group_size")
        if mode not in ("tensor", "token", "group") or (
                mode == "group" and not (isinstance(size, int) and 0 < size <= 1 << 16)):
            raise _bad(folder, f"compressed-tensors dynamic input strategy {mode[:20]!r} "
                               f"(group_size {size!r}) is not one fp8export runs (tensor, "
                               "token, group with a group_size).")
        dynamic.append((names, strategy, mode, size if mode == "group" else None))
    producer = f"compressed-tensors {str(qc.get('version') or '')[:20]}".strip()
    return _Rules("compressed-tensors", producer, blocks=blocks, dynamic=dynamic,
                  static_declared=static, kv=isinstance(qc.get("kv_cache_scheme"), dict))
