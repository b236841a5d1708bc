"""Sentence embeddings from an encoder's hidden states, pooled the way the model says.

A sentence-transformers folder names its pipeline in ``modules.json`` (Transformer → Pooling →
Normalize, …); the Pooling module's ``config.json`` gives the modes (``pooling_mode`` as a name
or a list, or the older ``pooling_mode_*_tokens`` flags), concatenated in the order
sentence-transformers uses. A folder without them is mean-pooled, the common default. Modules
after pooling other than Normalize (Dense layers) are not applied: verify compares what the
converted transformer produces, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import CONFIG, read_json
from fp8export.io.paths import contained

MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
           "pooling_mode_mean_tokens": "mean",
           "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
           "pooling_mode_weightedmean_tokens": "weightedmean",
           "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True)
class Pooling:
    """How hidden states ``[B, T, H]`` become one embedding per sample."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    source: str = "default (mean pooling; no sentence-transformers Pooling config)"
    skipped: tuple[str, ...] = ()  # modules after pooling that verify does not apply

    def describe(self) -> str:
        text = "+".join(self.modes) + (" then L2-normalised" if self.normalize else "")
        return f"{text} ({self.source})"


def read_pooling(folder: Path) -> Pooling:
    """The pooling of the model in ``folder`` (a sentence-transformers folder or any other)."""
    modules = folder / "modules.json"
    if not folder.is_dir() or not modules.is_file():
        return Pooling()
    entries = read_json(modules, CONFIG, root=folder)
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise Fp8ExportError(f"{modules}: not a sentence-transformers modules.json (a list of "
                             "{idx, name, path, type} objects). Restore the original file.")
    modes: tuple[str, ...] | None = None
    normalize, skipped = False, []
    for entry in entries:
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            path = entry.get("path")
            if not isinstance(path, str):
                raise Fp8ExportError(f"{modules}: module path {path!r} is not a string.")
            cfg_file = contained(folder, path, named_by=modules) / "config.json"
            modes = _modes(read_json(cfg_file, CONFIG, root=folder) if cfg_file.is_file()
                           else {}, cfg_file)
        elif kind == "Normalize" and modes is not None:
            normalize = True
        elif modes is not None:
            skipped.append(kind or "?")
    if modes is None:
        return Pooling()
    return Pooling(modes, normalize, "sentence-transformers modules.json", tuple(skipped))


def _modes(cfg: object, where: Path) -> tuple[str, ...]:
    if not isinstance(cfg, dict):
        raise Fp8ExportError(f"{where}: a Pooling config must be a JSON object.")
    mode = cfg.get("pooling_mode")
    if mode is None:
        chosen = [m for k, m in _LEGACY.items() if cfg.get(k) is True]
        found = tuple(m for m in MODES if m in chosen) or ("mean",)
    else:
        found = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, list) \
            else ()
    bad = [m for m in found if m not in MODES]
    if not found or bad:
        raise Fp8ExportError(f"{where}: pooling mode {(bad or [mode])!r} is not one of "
                             f"{', '.join(MODES)}. Restore the model's Pooling config.")
    return found


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: Pooling) -> np.ndarray:
    """``[B, D]`` float64 embeddings of ``hidden`` ``[B, T, H]`` under ``mask`` ``[B, T]``."""
    h = np.asarray(hidden, dtype=np.float64)
    m = (np.asarray(mask) > 0).astype(np.float64)
    if h.ndim != 3 or m.shape != h.shape[:2]:
        raise Fp8ExportError(f"hidden states of shape {h.shape} cannot be pooled with a mask "
                             f"of shape {m.shape}; the encoder's output must be [batch, "
                             "tokens, hidden].")
    count = np.clip(m.sum(1, keepdims=True), 1e-9, None)
    mean_sum = (h * m[..., None]).sum(1)
    parts = []
    for mode in pooling.modes:
        if mode == "cls":
            parts.append(h[np.arange(len(h)), m.argmax(1)])
        elif mode == "max":
            parts.append(np.where(m[..., None] > 0, h, -np.inf).max(1))
        elif mode == "mean":
            parts.append(mean_sum / count)
        elif mode == "mean_sqrt_len_tokens":
            parts.append(mean_sum / np.sqrt(count))
        elif mode == "weightedmean":
            first = m.argmax(1)[:, None]
            w = m * (np.arange(1, h.shape[1] + 1)[None, :] - first)
            parts.append((h * w[..., None]).sum(1) / np.clip(w.sum(1, keepdims=True), 1e-9, None))
        else:  # lasttoken: the last real token
            last = h.shape[1] - 1 - m[:, ::-1].argmax(1)
            parts.append(h[np.arange(len(h)), last])
    emb = np.concatenate(parts, axis=-1)
    if pooling.normalize:
        emb = emb / np.clip(np.linalg.norm(emb, axis=-1, keepdims=True), 1e-12, None)
    return emb
