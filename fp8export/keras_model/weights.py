"""The tensors a rebuilt Keras model reads, from a ``.keras`` or ``.weights.h5`` file or FP8 folder.

Names are the Keras reader's (:mod:`fp8export.checkpoint.keras_reader`): the dotted layer-name
path, then the variable. Dense and EinsumDense kernels are ``[in, out]``; sublayers that the
reader cannot classify keep positional names (``vars.0``), so every lookup here lists the
names a variable may have. Every shape is checked against what the config implies before the
tensor is used, and anything left unread at the end is an error: the weights were not saved
from this architecture.

This module is the rebuild's only contact with the FP8 folder format (through
:func:`fp8export.fp8dir.reader.read_fp8_folder`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fp8export.errors import Fp8ExportError

_FP8_AUX = (".weight_scale", ".input_scale")


class Weights:
    """Named tensors of one Keras model, read on demand and checked against expected shapes.

    ``quantized`` maps each FP8 layer (module path) to its folder entry; their ``.weight`` reads
    as the dequantized E4M3 weight, in float32.
    """

    def __init__(self, where: str, shapes: Mapping[str, tuple[int, ...]],
                 load: Callable[[str], torch.Tensor], quantized: Mapping[str, Any] | None = None):
        self.where, self._shapes, self._load = where, dict(shapes), load
        self.quantized = dict(quantized or {})
        self.used: set[str] = set()

    def find(self, prefix: str, leaves: tuple[str, ...]) -> str | None:
        return next((f"{prefix}.{leaf}" for leaf in leaves if f"{prefix}.{leaf}" in self._shapes),
                    None)

    def has_prefix(self, prefix: str) -> bool:
        return any(name.startswith(prefix + ".") for name in self._shapes)

    def _take(self, prefix: str, leaves: tuple[str, ...], what: str) -> str:
        name = self.find(prefix, leaves)
        if name is None:
            raise Fp8ExportError(
                f"{self.where}: no tensor {prefix}.{leaves[0]} ({what}) — the weights were not "
                "saved from the architecture in config.json.")
        self.used.add(name)
        return name

    def tensor(self, prefix: str, leaves: tuple[str, ...], shape: tuple[int, ...],
               what: str) -> torch.Tensor:
        """The tensor ``prefix.<leaf>`` of exactly ``shape`` (a flat bias may be stored N-D)."""
        name = self._take(prefix, leaves, what)
        got = self._shapes[name]
        if got != shape and not (len(shape) == 1 and math.prod(got) == shape[0]):
            raise Fp8ExportError(f"{self.where}: {name} has shape {list(got)} but the config "
                                 f"makes {what} {list(shape)}.")
        return self._load(name).reshape(shape)

    def kernel(self, prefix: str, n_in: int, n_out: int, what: str) -> torch.Tensor:
        """A Dense/EinsumDense kernel as ``[in, out]``; N-D kernels split where sizes agree.

        EinsumDense stores ``[in, heads, head_dim]`` or ``[heads, head_dim, out]``; any split of
        the stored axes into a leading product ``n_in`` and a trailing product ``n_out`` is the
        same row-major matrix.
        """
        name = self._take(prefix, ("weight", "vars.0", "kernel"), what)
        got = self._shapes[name]
        if not any(math.prod(got[:k]) == n_in and math.prod(got[k:]) == n_out
                   for k in range(1, len(got))):
            raise Fp8ExportError(f"{self.where}: {name} has shape {list(got)} but the config "
                                 f"makes {what} a [{n_in}, {n_out}] kernel.")
        return self._load(name).reshape(n_in, n_out)

    def check_all_used(self) -> None:
        aux = {f"{m}{s}" for m in self.quantized for s in _FP8_AUX}
        left = sorted(set(self._shapes) - self.used - aux)
        if left:
            raise Fp8ExportError(
                f"{self.where}: {len(left)} tensor(s) match no layer of the model in "
                f"config.json, e.g. {', '.join(left[:3])}. The weights and the config are from "
                "different models.")
        unused = sorted(set(self.quantized) - {n.rpartition(".")[0] for n in self.used})
        if unused:
            raise Fp8ExportError(f"{self.where}: quantized layer(s) {', '.join(unused[:3])} match "
                                 "no linear of the model in config.json.")


@contextmanager
def keras_checkpoint_weights(path: Path):
    """``(config, Weights)`` of a ``.keras`` / ``.weights.h5`` file (needs h5py)."""
    from fp8export.checkpoint.source import open_checkpoint

    with open_checkpoint(path) as ckpt:
        if ckpt.kind != "keras":
            raise Fp8ExportError(f"{path}: not a Keras .keras / .weights.h5 file.")
        infos = {info.name: info.shape for info in ckpt.tensors()}
        yield ckpt.config, Weights(str(path), infos, lambda n: ckpt.load(n).float())


def read_folder(fp8_dir: str | Path):
    """The FP8 folder, through the project's one folder reader."""
    from fp8export.fp8dir.reader import read_fp8_folder

    return read_fp8_folder(fp8_dir)


def keras_float8_layers(manifest: Mapping[str, Any]) -> set[str]:
    """Quantized layers whose scales came from Keras float8 training state."""
    return {name for name, entry in (manifest.get("quantized") or {}).items()
            if isinstance(entry, dict)
            and (entry.get("input_details") or {}).get("framework") == "keras"}


def folder_weights(folder) -> tuple[dict, Weights]:
    """``(Keras config, Weights)`` of an FP8 folder (as :func:`read_folder` returns it).

    A Keras float8 layer adds its bias rounded to bfloat16 when it computes in float32
    (``keras/src/layers/core/dense.py`` and ``einsum_dense.py`` ``_float8_call``: a fusion
    workaround); it trained that way, so the biases of layers converted from Keras float8
    state read rounded the same way, and the FP8 model computes what Keras's float8 model did.
    """
    config = {k: v for k, v in folder.config.items() if k != "quantization_config"}
    layers = folder.layers
    fp8 = {f"{name}.weight": layer for name, layer in layers.items()}
    bf16_bias = {f"{name}.bias" for name in keras_float8_layers(folder.manifest)}
    shapes = {}
    for name, shape in folder.tensors.shapes().items():
        layer = fp8.get(name)
        # Keras kernels are [in, out]: an out_in FP8 weight is read transposed
        shapes[name] = shape[::-1] if layer is not None and layer.layout == "out_in" else shape

    def load(name: str) -> torch.Tensor:
        layer = fp8.get(name)
        if name in bf16_bias:
            return folder.tensors[name].to(torch.bfloat16).float()
        if layer is None:
            return folder.tensors[name].float()
        return layer.dequantized().t() if layer.layout == "out_in" else layer.dequantized()

    return config, Weights(str(folder.path), shapes, load, layers)
