"""Which file of a path is a Keras 3 checkpoint: names only, no h5py.

Recognising a Keras input must work without the ``keras`` extra, so that a user without it
gets one message naming the extra instead of "no weights found". Reading the file is
:mod:`fp8export.checkpoint.keras_reader`'s job (it needs h5py).

A folder is a Keras checkpoint when it holds no Hugging Face weights and at least one
``.keras`` archive or ``.weights.h5`` file. One ``.keras`` archive is read (it carries its own
config, so it is unambiguous even beside ``.weights.h5`` files, which need a config.json
whose pairing a folder of several cannot tell); without one, a single ``.weights.h5`` is read
with the folder's config.json. Anything else is ambiguous and refused, naming the files.
"""

from __future__ import annotations

from pathlib import Path

from fp8export.errors import Fp8ExportError

KERAS_SUFFIX = ".keras"
WEIGHTS_SUFFIX = ".weights.h5"


def is_keras_file(path: Path) -> bool:
    return path.is_file() and (path.suffix == KERAS_SUFFIX or path.name.endswith(WEIGHTS_SUFFIX))


def _candidates(folder: Path) -> tuple[list[Path], list[Path]]:
    files = sorted(p for p in folder.iterdir() if is_keras_file(p))
    return ([p for p in files if p.suffix == KERAS_SUFFIX],
            [p for p in files if p.name.endswith(WEIGHTS_SUFFIX)])


def is_keras_checkpoint(path: Path) -> bool:
    """A ``.keras`` / ``.weights.h5`` file, or a folder holding one and no HF weights."""
    if path.is_file():
        return is_keras_file(path)
    if not path.is_dir():
        return False
    from fp8export.checkpoint.hf_folder import has_weights

    archives, weights = _candidates(path)
    return bool(archives or weights) and not has_weights(path)


def keras_file(path: Path) -> tuple[Path, list[str]]:
    """The Keras file to read for ``path`` and a note saying which one and why (folders)."""
    if path.is_file():
        return path, []
    archives, weights = _candidates(path)
    if len(archives) == 1:
        others = [p.name for p in weights]
        note = f"{path.name}: read the Keras archive {archives[0].name}"
        if others:
            note += f" (it carries its own config; ignored: {', '.join(others)})"
        return archives[0], [note]
    if not archives and len(weights) == 1:
        return weights[0], [f"{path.name}: read {weights[0].name} with the folder's config.json"]
    found = ", ".join(p.name for p in archives or weights)
    raise Fp8ExportError(
        f"{path}: holds several Keras checkpoints ({found}); which one to convert is ambiguous. "
        f"Give the file itself, e.g. `fp8export convert {path / (archives or weights)[0].name}`.")
