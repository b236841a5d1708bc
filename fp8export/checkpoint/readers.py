"""The built-in readers, registered on import (``open_checkpoint`` imports this module).

Order matters: the first reader whose ``can_open`` is true opens the path. Readers registered
with ``first=True`` (Keras here, Transformer Engine elsewhere) are consulted before the others.
The Keras reader needs h5py (the ``keras`` extra): it is recognised by file names alone and
imported only when a Keras input is opened, so a missing extra is one clear error for Keras
inputs and nothing for the rest.
"""

from __future__ import annotations

from pathlib import Path

from fp8export.checkpoint.hf_folder import (
    PT_INDEX,
    ST_INDEX,
    TORCH_SUFFIXES,
    has_weights,
    open_hf_folder,
    open_index_file,
    open_safetensors_file,
    open_torch_file,
)
from fp8export.checkpoint.keras_files import is_keras_checkpoint
from fp8export.checkpoint.source import Checkpoint, register_reader


def _is_hf_folder(p: Path) -> bool:
    return p.is_dir() and has_weights(p)


def _is_safetensors(p: Path) -> bool:
    return p.is_file() and p.suffix == ".safetensors"


def _is_index(p: Path) -> bool:
    return p.is_file() and p.name in (ST_INDEX, PT_INDEX)


def _is_torch(p: Path) -> bool:
    return p.is_file() and p.suffix in TORCH_SUFFIXES


def _open_keras(p: Path) -> Checkpoint:
    from fp8export._lazy import missing

    try:
        import h5py  # noqa: F401
    except ImportError as exc:
        raise missing("h5py", f"reading the Keras checkpoint {p}", exc) from exc
    from fp8export.checkpoint.keras_reader import open_keras

    return open_keras(p)


register_reader("keras", is_keras_checkpoint, _open_keras, first=True)
register_reader("hf-folder", _is_hf_folder, open_hf_folder)
register_reader("safetensors", _is_safetensors, open_safetensors_file)
register_reader("hf-index", _is_index, open_index_file)
register_reader("torch", _is_torch, open_torch_file)
