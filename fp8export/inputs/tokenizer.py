"""The checkpoint's tokenizer, loaded from a private copy made through the guarded reader.

``AutoTokenizer.from_pretrained(folder)`` would read whatever the folder holds, however it is
linked, and follow names inside ``tokenizer_config.json`` (``auto_map`` to import code,
``tokenizer_file`` / ``vocab_file`` to read any path). So transformers never sees the user's
folder: the known tokenizer files are copied into a fresh private temporary folder through
:func:`fp8export.io.guarded.copy_input` (regular files inside the checkpoint, size
capped, JSON depth- and integer-checked), ``tokenizer_config.json`` is rewritten without the
keys that name code or files, ``config.json`` is reduced to its ``model_type``, and the
tokenizer is loaded from there with ``trust_remote_code=False`` and ``local_files_only=True``.

``tokenizer.json`` is checked against what real tokenizers use
(:mod:`fp8export.inputs.tokenizer_rules`), and the tokenizer runs in a child process with memory
and CPU-time limits (:mod:`fp8export.inputs.tokenizer_process`): it is native code fed by the
checkpoint, and once it runs our own limits and error handling would not apply.

A tokenizer that exists only as custom code (``auto_map`` names ``AutoTokenizer`` and
``tokenizer_class`` is not a class transformers ships) is refused, naming the entry.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fp8export.checkpoint.model_config import read_model_config, remote_code_entries
from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import CONFIG, TOKENIZER, copy_input, parse_json, read_input

TOKENIZER_CONFIG = "tokenizer_config.json"
# The files transformers' tokenizers read (besides tokenizer_config.json); nothing else is copied.
TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt", "merges.txt")
# Files that alone make a tokenizer (tokenizer_config.json alone does not).
VOCABULARIES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                "vocab.json", "vocab.txt")
# tokenizer_config.json keys that name code to import or files to open.
_UNSAFE_KEYS = ("auto_map", "name_or_path", "_name_or_path")


def _present(folder: Path, names) -> list[Path]:
    return [folder / n for n in names if os.path.lexists(folder / n)]


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer's vocabulary (names only; nothing is read)."""
    return folder.is_dir() and bool(_present(folder, VOCABULARIES))


def _safe_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items()
            if k not in _UNSAFE_KEYS and not k.endswith(("_file", "_files"))}


def _builtin_class(name: Any) -> bool:
    if not isinstance(name, str) or not name:
        return False
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    for candidate in (name, name.removesuffix("Fast"), name + "Fast"):
        cls = tokenizer_class_from_name(candidate)
        if cls is not None and cls.__module__.startswith("transformers."):
            return True
    return False


def _model_facts(folder: Path) -> tuple[str | None, list[str]]:
    """The model_type transformers knows (for picking a tokenizer class) and the config.json
    ``auto_map`` entries naming a tokenizer."""
    config = read_model_config(folder)
    if not config:
        return None, []
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    remote = [rc.describe() for rc in remote_code_entries(config, folder / "config.json")
              if rc.entry == "AutoTokenizer"]
    model_type = config.get("model_type")
    return (model_type if model_type in CONFIG_MAPPING_NAMES else None), remote


def open_tokenizer(folder: Path, *, for_file: Path | None = None,
                   memory_bytes: int | None = None, seconds: float | None = None):
    """The tokenizer of the checkpoint folder ``folder``, running in a child process with
    limits (:class:`~fp8export.inputs.tokenizer_process.TokenizerProcess`; see the module
    docstring). Close it, or use it as a context manager."""
    from fp8export.inputs.tokenizer_process import REQUEST_SECONDS, TokenizerProcess

    folder = Path(folder)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix="fp8export-tokenizer-"))
        name = private_copy(folder, tmp, for_file=for_file)
        # the child has read everything it needs once loaded: the process removes the copy
        # then (it loads in the background, while the caller goes on)
        return TokenizerProcess(tmp, name, memory_bytes=memory_bytes,
                                seconds=seconds or REQUEST_SECONDS, owns_private=True)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, OSError):  # a full or unwritable TMPDIR, a refused fork: below
            raise
        raise Fp8ExportError(
            f"{folder}: cannot prepare the tokenizer ({exc.strerror or exc}; it is loaded from "
            f"a private copy in {tempfile.gettempdir()}). Free space there, or point TMPDIR "
            "elsewhere.") from exc


def private_copy(folder: Path, private: Path, *, for_file: Path | None = None) -> str:
    """Copy the tokenizer of ``folder`` into the empty folder ``private`` (the module
    docstring: checked, keys naming code or files dropped); returns the name to show for it.
    The model's processor is loaded from such a copy too (:mod:`fp8export.inputs.media`)."""
    vocab = _present(folder, VOCABULARIES)
    if not vocab:
        raise Fp8ExportError(
            f"{for_file or folder}: text data needs the checkpoint's tokenizer, but {folder} has "
            "no tokenizer files (tokenizer.json / tokenizer.model / vocab). Save the tokenizer "
            "into the checkpoint folder (tokenizer.save_pretrained), or give pre-tokenised "
            ".npz / .safetensors data with 'input_ids'.")
    tok_cfg: dict[str, Any] = {}
    tok_cfg_path = folder / TOKENIZER_CONFIG
    if os.path.lexists(tok_cfg_path):
        raw = parse_json(read_input(tok_cfg_path, CONFIG, root=folder), tok_cfg_path,
                         TOKENIZER_CONFIG)
        if not isinstance(raw, dict):
            raise Fp8ExportError(f"{tok_cfg_path}: must hold a JSON object. Restore the "
                                 "tokenizer files (tokenizer.save_pretrained).")
        tok_cfg = raw
    model_type, remote = _model_facts(folder)
    remote[:0] = [rc.describe() for rc in remote_code_entries(tok_cfg, tok_cfg_path)
                  if rc.entry == "AutoTokenizer"]
    if remote and not _builtin_class(tok_cfg.get("tokenizer_class")):
        raise Fp8ExportError(
            f"{remote[0]}: the tokenizer exists only as custom code in the checkpoint, and "
            "fp8export never runs code from a checkpoint (trust_remote_code=False). Save a "
            "tokenizer of a class transformers ships (tokenizer.json), or give pre-tokenised "
            ".npz / .safetensors data with 'input_ids'.")
    _private_copy(folder, private, tok_cfg, model_type)
    return str(folder / "tokenizer.json") if (folder / "tokenizer.json") in vocab \
        else f"{folder} (its tokenizer)"


def _private_copy(folder: Path, private: Path, tok_cfg: dict[str, Any],
                  model_type: str | None) -> None:
    """The tokenizer files transformers may read, copied through the guarded opener and
    checked (JSON limits; tokenizer.json against :mod:`~fp8export.inputs.tokenizer_rules`)."""
    from fp8export.inputs.tokenizer_rules import check_tokenizer_json

    for src in _present(folder, TOKENIZER_FILES):
        dest = copy_input(src, private / src.name, TOKENIZER, root=folder)
        if dest.suffix == ".json":
            doc = parse_json(dest.read_bytes(), src, src.name)  # depth/integer limits
            if src.name == "tokenizer.json":
                check_tokenizer_json(doc, src)
    (private / TOKENIZER_CONFIG).write_text(json.dumps(_safe_tokenizer_config(tok_cfg)),
                                            encoding="utf-8")
    if model_type:
        (private / "config.json").write_text(json.dumps({"model_type": model_type}),
                                             encoding="utf-8")
