"""The files besides the weights that loaders read, so convert carries them into the FP8 folder.

- transformers: tokenizer files, ``generation_config.json``, chat templates (``chat_template.*``
  and the ``additional_chat_templates/`` folder), processor configs.
- sentence-transformers: ``modules.json`` lists the pipeline (Transformer → Pooling →
  Normalize, Dense, …), each module's settings live in the folder it names (``1_Pooling/``,
  ``2_Normalize/``), and ``config_sentence_transformers.json`` / ``sentence_*_config.json``
  hold the model's own settings. Without them ``SentenceTransformer(folder)`` silently builds a
  default mean-pooling model with no normalisation.

All of these are untrusted: ``modules.json`` names folders, and a name that leaves the
checkpoint folder (``..``, an absolute path, a symlink out) is refused. Only regular files
are taken (no devices, FIFOs or sockets), at most :data:`MAX_DEPTH` levels into a module
folder, hidden files skipped. A module folder that exists but is empty (``2_Normalize/`` as
sentence-transformers saves it) is listed as the folder itself, for convert to create.
"""

from __future__ import annotations

from pathlib import Path

from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import CONFIG, read_json
from fp8export.io.paths import check_symlink, contained

# Top-level files, as glob patterns.
PATTERNS = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.*", "merges.txt", "spiece.model", "sentencepiece*.model",
    "*.tiktoken", "generation_config.json", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json",
    "modules.json", "config_sentence_transformers.json", "sentence_*_config.json",
)
FOLDERS = ("additional_chat_templates",)  # transformers' extra named chat templates
MODULES_JSON = "modules.json"
MAX_DEPTH = 2  # module folders are flat; allow one level of nesting, no more
SENTENCE_TRANSFORMERS_NOTE = (
    "sentence-transformers model: modules.json and its module folders were carried over. "
    "SentenceTransformer calls the model's forward() directly, which skips compressed-tensors' "
    "decompress-on-first-forward hook; load with model_kwargs={'quantization_config': "
    "transformers.CompressedTensorsConfig(dequantize=True)}.")


def loader_files(folder: Path) -> list[Path]:
    """Every loader file of the checkpoint ``folder`` (paths inside it), sorted."""
    found: set[Path] = set()
    for pattern in PATTERNS:
        for p in folder.glob(pattern):
            if p.is_file():
                check_symlink(p, folder)
                found.add(p)
    for name in FOLDERS:
        found.update(_tree(folder, folder / name))
    modules = folder / MODULES_JSON
    if modules.is_file():
        for sub in _module_folders(folder, modules):
            found.update(_tree(folder, sub))
    return sorted(found)


def _module_folders(folder: Path, modules: Path) -> list[Path]:
    """The folders ``modules.json`` names, except the Transformer's (its weights are ours)."""
    data = read_json(modules, CONFIG, root=folder)
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise Fp8ExportError(f"{modules}: not a sentence-transformers modules.json (a list of "
                             "{idx, name, path, type} objects). Restore the original file.")
    out = []
    for entry in data:
        path = entry.get("path", "")
        if path is None:
            continue
        if not isinstance(path, str):
            raise Fp8ExportError(f"{modules}: module path {path!r} is not a string.")
        if _is_root(folder, path, modules):  # "", ".", "./", a link to "."): the transformer
            continue  # we convert, whose files are the weights and the patterns above
        if str(entry.get("type", "")).endswith(".Transformer"):
            raise Fp8ExportError(
                f"{modules}: the Transformer module lives in {path!r}, not in the folder itself; "
                f"convert that folder ({folder / path}) and copy the other modules by hand.")
        out.append(contained(folder, path, named_by=modules))
    return out


def _is_root(folder: Path, path: str, named_by: Path) -> bool:
    """Whether a module path names the checkpoint folder itself, however spelled: copying "its
    folder" would carry every file beside the model (an optimizer state, private notes)."""
    if path in ("", "."):
        return True
    return contained(folder, path, named_by=named_by).resolve() == folder.resolve()


def _tree(folder: Path, root: Path) -> list[Path]:
    """Regular files under ``root`` (inside ``folder``), or ``[root]`` if it is an empty folder."""
    if not root.exists():
        return []
    check_symlink(root, folder)
    if not root.is_dir() or root.resolve() == folder.resolve():
        return []  # a module "folder" that is the checkpoint itself holds no module's files
    files: list[Path] = []
    stack = [(root, 0)]
    while stack:
        here, depth = stack.pop()
        for p in sorted(here.iterdir()):
            if p.name.startswith("."):
                continue
            check_symlink(p, folder)
            # a linked folder may lead back up (to the checkpoint itself): not followed
            if p.is_dir() and not p.is_symlink() and depth + 1 < MAX_DEPTH:
                stack.append((p, depth + 1))
            elif p.is_file():
                files.append(p)
    return files or [root]
