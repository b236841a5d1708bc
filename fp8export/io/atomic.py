"""Publish an output folder atomically: build it in a hidden temporary sibling, rename when done.

A crash leaves at most a hidden ``.<name>.tmp-*`` folder, never a half-written folder under the
final name. With ``force`` an existing output is replaced only after the new one is complete
and verified: the old folder is renamed aside, the new one renamed in, then the old one deleted
(if the swap fails the old folder is put back).
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from fp8export.errors import Fp8ExportError


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# The mode every output file is created with: what ``open(path, "w")`` asks for, so the user's
# umask decides (0644 under the usual 022), the same for weights, configs and copied tokenizer
# files; a server running as another user must be able to read all of them.
OUTPUT_MODE = 0o666


def _create_private(path: Path) -> int:
    """Create ``path`` exclusively: never an existing file, never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, OUTPUT_MODE)


def write_file_atomic(path: Path, data: bytes, what: str = "the file") -> None:
    """Write ``data`` to ``path`` via a hidden temporary sibling, fsync, then rename: a crash
    leaves the old file or the new one, never half of one. The temporary name is random and
    created exclusively (a planted symlink is not followed); any OSError (read-only folder, full
    disk) is an Fp8ExportError and leaves nothing behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    try:
        fd = _create_private(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        raise Fp8ExportError(f"{path}: cannot write {what} ({exc.strerror or exc}); nothing "
                             "was written. Check the path, its permissions and the free space."
                             ) from exc
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def probe_writable(output: Path, option: str = "-o/--output") -> None:
    """Fail before any work when ``output`` cannot be written: create and remove a random file
    in the folder that will hold it (or its nearest existing ancestor, which would)."""
    output = Path(output)
    folder = output if output.is_dir() else output.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    probe = folder / f".{output.name}.probe-{secrets.token_hex(8)}"
    try:
        os.close(_create_private(probe))
        os.unlink(probe)
    except OSError as exc:
        raise Fp8ExportError(f"{output}: cannot write there ({exc.strerror or exc}). Choose "
                             f"another {option}, or fix the folder's permissions or space."
                             ) from exc


# Files a checkpoint given as a single file still reads from beside it.
READ_BESIDE = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "generation_config.json", "model.safetensors.index.json",
               "pytorch_model.bin.index.json")


def refuse_inside_input(output: Path, source: Path, option: str = "-o/--output") -> None:
    """Refuse an output that would land inside (or replace, or contain) the input ``source``:
    a folder input owns everything under it; a file input owns itself and the files read
    from beside it (config, tokenizer, index)."""
    out, src = Path(output).resolve(), Path(source).resolve()
    inside = out == src or out in src.parents
    if src.is_dir():
        inside = inside or src in out.parents
    else:
        beside = (*READ_BESIDE, f"{src.name}.data")  # and an ONNX graph's external data
        inside = inside or (out.parent == src.parent and out.name in beside)
    if inside:
        raise Fp8ExportError(
            f"{output}: {option} would write inside, contain or replace the input {source}; "
            "fp8export never writes into its input. Choose a path beside it.")


def check_output_target(target: Path, force: bool) -> None:
    """Refuse to touch an existing output without ``force``, and never replace a file."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise Fp8ExportError(f"{target}: exists and is not a folder; fp8export replaces only "
                             "folders it wrote. Choose another -o/--output path.")
    if target.exists() and not force:
        raise Fp8ExportError(f"{target}: already exists. Pass --force to replace it (the new "
                             "folder is built first; the old one is removed only on success), "
                             "or choose another -o/--output path.")


class AtomicDir:
    """Context manager: ``with AtomicDir(target, force) as tmp: ...; publish()``.

    Write everything under ``tmp``; call :meth:`publish` when it is complete and verified.
    Leaving the block without publishing (an exception, or no call) deletes ``tmp``.
    """

    def __init__(self, target: Path, force: bool = False):
        self.target = Path(target)
        self.force = force
        self.tmp: Path | None = None
        self.published = False

    def __enter__(self) -> Path:
        check_output_target(self.target, self.force)
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.tmp = parent / f".{self.target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            self.tmp.mkdir()
        except OSError as exc:
            raise Fp8ExportError(f"{parent}: cannot create the output folder there "
                                 f"({exc.strerror or exc}). Check the path and permissions."
                                 ) from exc
        return self.tmp

    def publish(self) -> Path:
        assert self.tmp is not None, "publish() outside the with-block"  # programming error
        check_output_target(self.target, self.force)  # it may have appeared meanwhile
        fsync_dir(self.tmp)
        old: Path | None = None
        if self.target.exists():
            old = self.target.parent / f".{self.target.name}.old-{secrets.token_hex(4)}"
            os.rename(self.target, old)
        try:
            os.rename(self.tmp, self.target)
        except OSError as exc:
            if old is not None:
                os.rename(old, self.target)
            raise Fp8ExportError(f"{self.target}: cannot move the finished output into place "
                                 f"({exc.strerror or exc}); the previous state is unchanged."
                                 ) from exc
        fsync_dir(self.target.parent)
        self.published = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.target

    def __exit__(self, *exc) -> None:
        if not self.published and self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
