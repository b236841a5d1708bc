"""Read members of an untrusted zip archive (a ``.keras`` file) without extracting it.

A ``.keras`` file is a zip that anyone may hand us. We never call ``extractall``: every entry
name is checked (no absolute paths, drive letters, ``..`` components, backslashes or NUL
bytes, no symlinks, no duplicates), and sizes are checked from the central directory *before*
anything is decompressed (a zip bomb declares a huge uncompressed size for a tiny compressed
one, or lies about it). Members are read into memory, or copied into a caller-owned temporary
file when large, never to a path derived from the entry name; the copy counts the bytes it
writes and stops at the declared size.
"""

from __future__ import annotations

import shutil
import stat
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from fp8export.errors import Fp8ExportError

MAX_ENTRIES = 10_000
MAX_TOTAL_BYTES = 256 * 2**30  # 256 GiB: beyond any single-file Keras model we would convert
MAX_RATIO = 200  # Keras stores members uncompressed; real deflated weights stay far below this
RATIO_FLOOR_BYTES = 1 * 2**20  # small members (JSON) may compress well; ratio only checked above
_CHUNK = 1 << 20
# What zipfile raises on corrupt members: bad headers/CRC, bad deflate streams, unsupported
# compression methods, short reads.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, NotImplementedError, OSError, EOFError,
                RuntimeError, ValueError)


def check_ratio(where: str | Path, info: zipfile.ZipInfo, max_ratio: float = MAX_RATIO) -> None:
    """The zip-bomb rule, for every zip fp8export reads (``.keras`` archives, ``.npz`` data): a
    member above :data:`RATIO_FLOOR_BYTES` that declares more than ``max_ratio`` times its
    compressed size is refused before anything is decompressed."""
    size, packed = info.file_size, max(info.compress_size, 1)
    if size > RATIO_FLOOR_BYTES and size / packed > max_ratio:
        raise Fp8ExportError(
            f"{where}: zip entry {info.filename!r} declares {size} bytes from "
            f"{info.compress_size} compressed (ratio {size / packed:.0f} > {max_ratio:g}): "
            "a zip bomb or a corrupt archive. Refusing to decompress it.")


def _bad_name(name: str) -> str | None:
    """Why an entry name is unsafe, or None."""
    if not name or "\x00" in name:
        return "empty name or NUL byte"
    if "\\" in name:
        return "backslash in name (a Windows path separator)"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    if any(part == ".." for part in PurePosixPath(name).parts):
        return "'..' component escapes the archive"
    return None


class SafeZip:
    """An opened, validated zip archive. Use as a context manager."""

    def __init__(self, path: str | Path, *, max_total_bytes: int = MAX_TOTAL_BYTES,
                 max_ratio: float = MAX_RATIO):
        self.path = Path(path)
        try:
            self._zf = zipfile.ZipFile(self.path)
        except _READ_ERRORS as exc:  # NotImplementedError: "zip file version 8.4" (fuzz-found)
            raise Fp8ExportError(
                f"{self.path}: not a readable zip archive ({exc}); a .keras file is a zip "
                "written by model.save(). Re-save the model, or check the file is complete."
            ) from None
        try:
            self._infos = self._validate(max_total_bytes, max_ratio)
        except Fp8ExportError:
            self._zf.close()
            raise

    def _validate(self, max_total_bytes: int, max_ratio: float) -> dict[str, zipfile.ZipInfo]:
        infos = self._zf.infolist()
        if len(infos) > MAX_ENTRIES:
            raise Fp8ExportError(f"{self.path}: {len(infos)} zip entries (limit {MAX_ENTRIES}); "
                                 "not a Keras archive.")
        seen: dict[str, zipfile.ZipInfo] = {}
        total = 0
        for info in infos:
            why = _bad_name(info.filename)
            if why is None and stat.S_ISLNK(info.external_attr >> 16):
                why = "symbolic link"
            if why is None and info.filename in seen:
                why = "duplicate entry (ambiguous content)"
            if why is None and info.flag_bits & 0x1:
                why = "encrypted entry"
            if why is not None:
                raise Fp8ExportError(f"{self.path}: unsafe zip entry {info.filename!r}: {why}. "
                                     "Refusing to read this archive.")
            check_ratio(self.path, info, max_ratio)
            total += info.file_size
            seen[info.filename] = info
        if total > max_total_bytes:
            raise Fp8ExportError(f"{self.path}: the archive declares {total} uncompressed bytes "
                                 f"(limit {max_total_bytes}). Refusing to decompress it.")
        return seen

    def names(self) -> list[str]:
        return list(self._infos)

    def size(self, name: str) -> int:
        return self._member(name).file_size

    def _member(self, name: str) -> zipfile.ZipInfo:
        try:
            return self._infos[name]
        except KeyError:
            entries = ", ".join(sorted(self._infos)) or "none"
            raise Fp8ExportError(f"{self.path}: the archive has no {name!r} "
                                 f"(entries: {entries}).") from None

    def read_bytes(self, name: str, max_bytes: int) -> bytes:
        """The member's content in memory; refuses members declared larger than ``max_bytes``."""
        info = self._member(name)
        if info.file_size > max_bytes:
            raise Fp8ExportError(f"{self.path}: entry {name!r} is {info.file_size} bytes; the "
                                 f"limit for it is {max_bytes}.")
        try:
            with self._open(info) as src:
                data = src.read(info.file_size + 1)
        except _READ_ERRORS as exc:
            raise self._read_error(info, exc) from None
        return self._check_length(info, len(data), data)

    def copy_to(self, name: str, dest: Path) -> Path:
        """Stream the member into ``dest``, a path the caller chose (a TemporaryDirectory)."""
        info = self._member(name)
        written = 0
        try:
            with self._open(info) as src, open(dest, "wb") as out:
                while chunk := src.read(_CHUNK):
                    written += len(chunk)
                    if written > info.file_size:
                        break
                    out.write(chunk)
        except _READ_ERRORS as exc:
            raise self._read_error(info, exc) from None
        self._check_length(info, written, None)
        return dest

    def _open(self, info: zipfile.ZipInfo):
        try:
            return self._zf.open(info)
        except _READ_ERRORS as exc:
            raise self._read_error(info, exc) from None

    def _read_error(self, info: zipfile.ZipInfo, exc: BaseException) -> Fp8ExportError:
        return Fp8ExportError(f"{self.path}: cannot read entry {info.filename!r} "
                              f"({type(exc).__name__}: {exc}); the archive is corrupt or "
                              "truncated. Re-save the model.")

    def _check_length(self, info, n: int, data):
        if n != info.file_size:
            raise Fp8ExportError(f"{self.path}: entry {info.filename!r} holds {n} bytes but "
                                 f"declares {info.file_size}: corrupt or tampered archive.")
        return data

    def close(self) -> None:
        self._zf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def copy_member(archive: SafeZip, name: str, tmpdir: Path) -> Path:
    """Copy ``name`` to a fixed file name inside ``tmpdir`` (never a name from the archive)."""
    free = shutil.disk_usage(tmpdir).free
    if archive.size(name) > free:
        raise Fp8ExportError(f"{archive.path}: entry {name!r} needs {archive.size(name)} bytes "
                             f"of temporary space; {free} are free in {tmpdir}.")
    return archive.copy_to(name, tmpdir / "member.bin")
