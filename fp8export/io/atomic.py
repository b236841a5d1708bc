"""Publish an output folder atomically: build it in a hidden temporary sibling, rename when done.

A crash leaves at most a hidden ``.<name>.tmp-*`` folder, never a half-written folder under the
final name. With ``force`` an existing output is replaced only after the new one is complete
and verified: the old folder is renamed aside, the new one renamed in, then the old one deleted
(if the swap fails the old folder is put back).

A set of files in a folder others also write into (verify's report folder) is published with
:func:`write_files_atomic` (all staged first, then all put in place, or none) under
:func:`folder_lock` (one run at a time).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import file_type_name
from fp8export.io.outputs import check_folder_target


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


def make_folders(folder: Path) -> list[Path]:
    """Create ``folder`` and whichever of its ancestors are missing; return the ones created,
    outermost first, for :func:`remove_folders` to take back when the command fails (an output
    that fails leaves nothing behind, not even the folders made to hold it)."""
    missing = []
    here = Path(folder)
    while not os.path.lexists(here) and here != here.parent:
        missing.append(here)
        here = here.parent
    created: list[Path] = []
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:  # made meanwhile by someone else: theirs, not ours
                continue
            created.append(path)
    except BaseException:
        remove_folders(created)
        raise
    return created


def remove_folders(created: list[Path]) -> None:
    """Remove the folders :func:`make_folders` created, innermost first, if still empty."""
    for path in reversed(created):
        try:
            path.rmdir()
        except OSError:  # not empty (someone wrote there meanwhile) or already gone
            pass


# The mode every output file is created with: what ``open(path, "w")`` asks for, so the user's
# umask decides (0644 under the usual 022), the same for weights, configs and copied tokenizer
# files; a server running as another user must be able to read all of them.
OUTPUT_MODE = 0o666


def _create_private(path: Path) -> int:
    """Create ``path`` exclusively: never an existing file, never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, OUTPUT_MODE)


def _refuse_special(path: Path) -> None:
    """Only a regular file is ever replaced: not a link, a FIFO, a device or a folder."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else file_type_name(mode)
        raise Fp8ExportError(f"{path}: is {what}; fp8export replaces only regular files. "
                             "Choose another output path.")


def write_file_atomic(path: Path, data: bytes, what: str = "the file") -> None:
    """Write ``data`` to ``path`` via a hidden temporary sibling, fsync, then rename: a crash
    leaves the old file or the new one, never half of one. The temporary name is random and
    created exclusively (a planted symlink is not followed); any OSError (read-only folder, full
    disk) is an Fp8ExportError and leaves nothing behind."""
    path = Path(path)
    _refuse_special(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    try:
        fd = _create_private(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _refuse_special(path)  # it may have appeared meanwhile
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        raise Fp8ExportError(f"{path}: cannot write {what} ({exc.strerror or exc}); nothing "
                             "was written. Check the path, its permissions and the free space."
                             ) from exc
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


class AtomicDir:
    """Context manager: ``with AtomicDir(target, force) as tmp: ...; publish()``.

    Write everything under ``tmp``; call :meth:`publish` when it is complete and verified.
    Leaving the block without publishing (an exception, or no call) deletes ``tmp``.
    """

    def __init__(self, target: Path, force: bool = False, *, marker: str):
        self.target = Path(target)
        self.force = force
        self.marker = marker  # the file that marks a folder as ours (replaceable with force)
        self.tmp: Path | None = None
        self.published = False
        self.created: list[Path] = []  # missing parents made for the output

    def __enter__(self) -> Path:
        check_folder_target(self.target, self.force, self.marker)
        parent = self.target.parent
        self.tmp = parent / f".{self.target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.created = make_folders(parent)
            self.tmp.mkdir()
        except BaseException as exc:  # an interrupt too: __exit__ will not run
            shutil.rmtree(self.tmp, ignore_errors=True)
            remove_folders(self.created)
            if isinstance(exc, OSError):
                raise Fp8ExportError(f"{parent}: cannot create the output folder there "
                                     f"({exc.strerror or exc}). Check the path and "
                                     "permissions.") from exc
            raise
        return self.tmp

    def publish(self) -> Path:
        assert self.tmp is not None, "publish() outside the with-block"  # programming error
        check_folder_target(self.target, self.force, self.marker)  # it may have changed
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
            remove_folders(self.created)


def write_files_atomic(files: dict[Path, bytes], *, replace: bool, what: str = "the files"
                       ) -> None:
    """Publish a set of files in one folder as a whole: every one or none.

    Each is first written in full to a hidden temporary sibling and fsynced, so a full disk or
    a read-only folder fails before any existing file is touched. Then each is put in place:
    without ``replace`` by a hard link, which refuses a file that exists (one that appeared
    since the caller checked: saved by the user, or written by another run); with ``replace``
    by a rename, after keeping the file it replaces aside. If putting one in place fails, the
    ones already placed are undone (the set before the call is restored) and Fp8ExportError
    names the file; nothing of the new set is left.
    """
    paths = [Path(p) for p in files]
    staged: dict[Path, Path] = {}
    placed: list[Path] = []
    kept: dict[Path, Path] = {}  # final path -> the earlier file, kept aside until done
    try:
        try:
            for path in paths:
                _refuse_special(path)
                tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
                fd = _create_private(tmp)
                staged[path] = tmp
                with os.fdopen(fd, "wb") as f:
                    f.write(files[path])
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as exc:
            raise Fp8ExportError(
                f"{path}: cannot write {what} ({exc.strerror or exc}); nothing was written and "
                "what was there before is unchanged. Check the path, its permissions and the "
                "free space.") from exc
        for path in paths:
            try:
                _refuse_special(path)  # it may have appeared meanwhile
                if not replace:
                    os.link(staged[path], path)
                else:
                    if os.path.lexists(path):
                        aside = path.with_name(f".{path.name}.old-{secrets.token_hex(8)}")
                        os.link(path, aside)
                        kept[path] = aside
                    os.replace(staged[path], path)
            except FileExistsError as exc:
                raise Fp8ExportError(
                    f"{path}: appeared while fp8export was working (saved meanwhile, or written "
                    f"by another run); nothing was written and it was left as it is. Pass "
                    "--force to replace it, or choose another path.") from exc
            except OSError as exc:
                raise Fp8ExportError(
                    f"{path}: cannot put {what} in place ({exc.strerror or exc}); nothing was "
                    "written and what was there before is unchanged.") from exc
            placed.append(path)
        if paths:
            fsync_dir(paths[0].parent)
        placed = []  # done: nothing to undo
    finally:
        for path in reversed(placed):  # undo a set that was not completed
            if path in kept:
                os.replace(kept.pop(path), path)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for leftover in (*staged.values(), *kept.values()):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


@contextlib.contextmanager
def folder_lock(folder: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (flock on the folder itself: no lock file is left,
    and a crashed holder releases it); a second holder is refused at once, naming ``what``."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: the writers' own checks still hold
        yield
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Fp8ExportError(
                f"{folder}: another fp8export run is writing {what} there now; wait for it to "
                "finish, or choose another folder.") from None
        except OSError:  # a filesystem without flock: the writers' own checks still hold
            pass
        yield
    finally:
        os.close(fd)
