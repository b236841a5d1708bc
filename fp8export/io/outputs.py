"""Where fp8export may write: every output path checked against every input before any work.

One set of rules for every command (convert's folder, calibrate's amax file, export-onnx's
graph and its ``.data``, build-engine's engine, verify's report folder, inspect's plot):

* **No output is, or contains, an input.** Compared after resolving symlinks and, for files
  that exist, by device and inode (a hard link is the same file). A folder input owns
  everything under it; a file input owns itself and the files read from beside it (config,
  tokenizer, index, an ONNX graph's ``.data``).
* **Only regular files and folders are replaced.** An existing output that is a symlink, a
  FIFO, a device or a socket is refused even with ``--force`` (as root, ``-o /dev/null
  --force`` would otherwise replace ``/dev/null``).
* **``--force`` replaces only what fp8export wrote.** An existing output folder is replaced
  only when it holds the file that marks our output (convert: ``fp8export.json``) or is
  empty; a folder of someone else's files is refused, naming some of them.
* Nothing existing is touched without ``--force``, and an unwritable location fails before the
  work (:func:`probe_writable`).

The writers check again at the moment they replace (:mod:`fp8export.io.atomic`), so a file
swapped in meanwhile is not replaced either.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import file_type_name

# Files a checkpoint given as a single file still reads from beside it.
READ_BESIDE = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "generation_config.json", "model.safetensors.index.json",
               "pytorch_model.bin.index.json")
_NEVER = "fp8export never writes into its input"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _owned_by(src: Path) -> list[Path]:
    """What an input owns besides itself (resolved): the files read from beside a file."""
    if src.is_dir():
        return []
    beside = (*READ_BESIDE, f"{src.name}.data")
    return [src.parent / name for name in beside]


def refuse_overlap(output: str | Path, inputs: Iterable[str | Path | None],
                   option: str = "-o/--output") -> None:
    """Raise when ``output`` is, is inside, or contains one of ``inputs`` (None entries are
    skipped), or is a file read from beside a file input."""
    out = Path(output)
    out_r = out.resolve()
    for given in inputs:
        if given is None:
            continue
        src = Path(given)
        src_r = src.resolve()
        why = None
        if out_r == src_r or _same_file(out, src):
            why = f"is the input {src}"
        elif src_r.is_dir() and src_r in out_r.parents:
            why = f"is inside the input {src}"
        elif out_r in src_r.parents:
            why = f"contains the input {src}"
        elif any(out_r == p or _same_file(out, p) for p in _owned_by(src_r)):
            why = f"is a file read from beside the input {src}"
        if why is not None:
            raise Fp8ExportError(f"{output}: {option} {why}; {_NEVER}. Choose a path that is "
                                 "neither an input nor holds one.")


def refuse_inside_input(output: str | Path, source: str | Path,
                        option: str = "-o/--output") -> None:
    """:func:`refuse_overlap` for one input."""
    refuse_overlap(output, [source], option)


def _lstat_target(p: Path, option: str) -> os.stat_result | None:
    """The target's own status (links not followed); None when nothing is there."""
    try:
        return os.lstat(p)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Fp8ExportError(f"{p}: cannot check the {option} path ({exc.strerror or exc})."
                             ) from exc


def check_file_target(path: str | Path, force: bool, option: str = "-o/--output") -> None:
    """An output file may replace only a regular file, and only with ``force``."""
    p = Path(path)
    st = _lstat_target(p, option)
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode):
        raise Fp8ExportError(f"{p}: is a symbolic link; {option} replaces only regular files "
                             "(never what a link points to). Choose another path.")
    if stat.S_ISDIR(st.st_mode):
        raise Fp8ExportError(f"{p}: is a folder; {option} names a file. Choose a file path.")
    if not stat.S_ISREG(st.st_mode):
        raise Fp8ExportError(f"{p}: is {file_type_name(st.st_mode)}; fp8export replaces only "
                             f"regular files, even with --force. Choose another {option} path.")
    if not force:
        raise Fp8ExportError(f"{p}: already exists. Pass --force to replace it, or choose "
                             f"another {option} path.")


def foreign_entries(folder: Path, marker: str, limit: int = 3) -> list[str] | None:
    """None when ``folder`` may be replaced (it is empty, or holds ``marker`` as a regular file:
    an output fp8export wrote); else up to ``limit`` of its entries, for the message."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        return [f"(unreadable: {exc.strerror or exc})"]
    if not names:
        return None
    try:
        if stat.S_ISREG(os.lstat(folder / marker).st_mode):
            return None
    except OSError:
        pass
    return names[:limit] + ([f"… {len(names) - limit} more"] if len(names) > limit else [])


def check_folder_target(path: str | Path, force: bool, marker: str,
                        option: str = "-o/--output") -> None:
    """An output folder may replace only a folder fp8export wrote (holding ``marker``) or an
    empty one, and only with ``force``; never a file, a link or anything else."""
    p = Path(path)
    st = _lstat_target(p, option)
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else file_type_name(st.st_mode)
        if stat.S_ISREG(st.st_mode):
            what = "a file"
        raise Fp8ExportError(f"{p}: exists and is {what}, not a folder; fp8export replaces only "
                             f"folders it wrote. Choose another {option} path.")
    if not force:
        raise Fp8ExportError(f"{p}: already exists. Pass --force to replace it (the new folder "
                             "is built first; the old one is removed only on success), or choose "
                             f"another {option} path.")
    foreign = foreign_entries(p, marker)
    if foreign is not None:
        raise Fp8ExportError(
            f"{p}: holds files fp8export did not write ({', '.join(foreign)}); --force replaces "
            f"only a folder holding {marker} (an earlier output) or an empty one. Choose another "
            f"{option} path, or move those files away yourself.")


def _create_exclusive(path: Path) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, 0o600)


def probe_writable(output: str | Path, option: str = "-o/--output") -> None:
    """Fail before any work when ``output`` cannot be written: create and remove a random file
    in the folder that will hold it (or its nearest existing ancestor, which would)."""
    output = Path(output)
    folder = output if output.is_dir() and not output.is_symlink() else output.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    probe = folder / f".{output.name}.probe-{secrets.token_hex(8)}"
    try:
        os.close(_create_exclusive(probe))
        os.unlink(probe)
    except OSError as exc:
        raise Fp8ExportError(f"{output}: cannot write there ({exc.strerror or exc}). Choose "
                             f"another {option}, or fix the folder's permissions or space."
                             ) from exc


def claim_output_file(path: str | Path, *, inputs: Iterable[str | Path | None], force: bool,
                      option: str = "-o/--output") -> None:
    """Every check an output file needs before the work starts (see the module docstring)."""
    refuse_overlap(path, inputs, option)
    check_file_target(path, force, option)
    probe_writable(path, option)


def claim_output_folder(path: str | Path, *, inputs: Iterable[str | Path | None], force: bool,
                        marker: str, option: str = "-o/--output") -> None:
    """Every check an output folder that is replaced as a whole needs before the work."""
    refuse_overlap(path, inputs, option)
    check_folder_target(path, force, marker, option)
