"""The one way fp8export opens a file it did not write, and parses JSON it did not write.

Every input file (weights, configs, tokenizer files, data, amax files, manifests, ONNX graphs)
comes from someone else, so every read goes through :func:`open_input`:

* inside ``root`` (the folder the user named) after resolving symlinks — or inside the hub
  cache's ``blobs`` folder for a snapshot (:func:`~fp8export.io.paths.allowed_roots`);
  the descriptor actually opened is checked again, so a link swapped in between is caught;
* a regular file: a FIFO would block forever, ``/dev/zero`` would read until memory runs out.
  Opening uses ``O_NONBLOCK`` so not even the ``open`` of a FIFO waits;
* no larger than the cap of its :class:`FileKind`, checked on the descriptor before reading,
  and reads stop at the cap (a file that grows while we read it is refused, not followed).

YAML (thresholds and recipe files) goes through :func:`parse_yaml`: aliases are refused, so a
few hundred bytes cannot expand into gigabytes. JSON goes through :func:`parse_json`: nesting
depth and integer length are bounded before Python's parser sees the text (a ``[[[[…`` file is
a RecursionError, a 5000-digit integer a ValueError, both tracebacks), NaN/Infinity are
refused (not JSON), and every failure is an :class:`Fp8ExportError` naming the file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fp8export.errors import Fp8ExportError
from fp8export.io.paths import allowed_roots, check_symlink

MiB = 1 << 20
GiB = 1 << 30

# Deeper than any real config (each nested Keras model adds ~3 levels; real ones stay < 40).
MAX_JSON_DEPTH = 128
# Longer than any real integer in a config: tokenizer configs carry int(1e30), 31 digits.
MAX_INT_DIGITS = 64


@dataclass(frozen=True)
class FileKind:
    """What a file is (for messages) and the largest size any real one has."""

    what: str
    max_bytes: int


CONFIG = FileKind("config file", 16 * MiB)  # config.json, tokenizer_config.json, generation …
INDEX = FileKind("index file", 64 * MiB)  # a 600B-parameter index is ~10 MB
MANIFEST = FileKind("fp8export manifest", 256 * MiB)  # ~500 bytes per tensor
AMAX = FileKind("amax file", 64 * MiB)
THRESHOLDS = FileKind("thresholds file", 1 * MiB)
RECIPE = FileKind("recipe file", 1 * MiB)
TOKENIZER = FileKind("tokenizer file", 256 * MiB)  # tokenizer.json of a 256k vocab: ~35 MB
DATA = FileKind("data file", 8 * GiB)
ONNX = FileKind("ONNX model", 2 * GiB)  # protobuf's own limit; weights beyond go to .data
WEIGHTS = FileKind("weight file", 1 << 62)  # sizes are checked against the header instead
ENGINE = FileKind("TensorRT engine", 64 * GiB)
TIMING_CACHE = FileKind("timing cache", 1 * GiB)

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) \
    | getattr(os, "O_NOCTTY", 0)


def file_type_name(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO (named pipe)", "a character device" …)."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def _opened_path(fd: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # no procfs (macOS): the resolve-before-open check stands alone
        return None


def open_input(path: str | Path, kind: FileKind, *, root: str | Path | None = None) -> IO[bytes]:
    """Open ``path`` for reading as a binary file object, or raise Fp8ExportError.

    ``root`` is the folder the user named (a checkpoint folder): the file must resolve inside
    it. Without ``root`` the user named the file itself; it must still be a regular file within
    the size cap of ``kind``.
    """
    p = Path(path)
    if root is not None:
        check_symlink(p, Path(root))
    try:
        fd = os.open(p, _OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise Fp8ExportError(f"{p}: no such {kind.what}.") from exc
    except OSError as exc:
        raise Fp8ExportError(f"{p}: cannot open the {kind.what} ({exc.strerror or exc}).") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Fp8ExportError(f"{p}: is {file_type_name(st.st_mode)}, not a regular file; "
                                 f"refused (a {kind.what} must be an ordinary file). Replace it "
                                 "with the real file.")
        if root is not None:
            real = _opened_path(fd)
            if real is not None and not any(real == r or real.is_relative_to(r)
                                            for r in allowed_roots(Path(root))):
                raise Fp8ExportError(f"{p}: opened {real}, outside the folder {root}; refused "
                                     "(a symlink changed while it was opened).")
        if st.st_size > kind.max_bytes:
            raise Fp8ExportError(
                f"{p}: {st.st_size} bytes, more than any real {kind.what} (limit "
                f"{kind.max_bytes}); refused without reading it. The file is corrupt or not a "
                f"{kind.what}.")
        flags = os.get_blocking(fd)
        if not flags:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_input(path: str | Path, kind: FileKind, *, root: str | Path | None = None) -> bytes:
    """The whole content of ``path`` (see :func:`open_input`); never more than the cap."""
    p = Path(path)
    with open_input(p, kind, root=root) as f:
        try:
            data = f.read(kind.max_bytes + 1)
        except OSError as exc:
            raise Fp8ExportError(f"{p}: cannot read the {kind.what} ({exc.strerror or exc})."
                                 ) from exc
    if len(data) > kind.max_bytes:
        raise Fp8ExportError(f"{p}: grew beyond {kind.max_bytes} bytes while being read; "
                             "refused.")
    return data


def copy_input(path: str | Path, dest: Path, kind: FileKind, *,
               root: str | Path | None = None, mode: int = 0o600) -> Path:
    """Copy ``path`` (opened as :func:`open_input` does) to ``dest``, a path the caller owns.

    ``mode`` (less the umask): 0o600 for a private working copy; a copy that is part of an
    output passes :data:`fp8export.io.atomic.OUTPUT_MODE` so it is as readable as the rest.
    """
    data = read_input(path, kind, root=root)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return dest


# ------------------------------------------------------------------------------------- JSON

# A string literal, or an unterminated one running to the end: every match attempt consumes
# what it scans, so stripping strings is linear even for hostile text.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in JSON text (brackets inside strings ignored)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return min(raw.count(b"[") + raw.count(b"{"), MAX_JSON_DEPTH)
    import numpy as np

    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max())


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (limit {MAX_INT_DIGITS})")
    return int(text)


def _parse_constant(name: str) -> float:
    raise _Refused(f"{name}, which is not JSON (numbers must be finite)")


class _Refused(ValueError):
    pass


def parse_json(raw: bytes | str, where: str | Path, what: str = "JSON file", *,
               object_pairs_hook=None) -> Any:
    """Parse untrusted JSON with bounded depth and integer length; errors name ``where``."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise Fp8ExportError(f"{where}: {what} nests deeper than {MAX_JSON_DEPTH} levels; no real "
                             f"{what} does. The file is corrupt or hostile; refused.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise Fp8ExportError(f"{where}: {what} is not valid JSON: not UTF-8 text ({exc.reason} "
                             f"at byte {exc.start}). Restore the original file.") from exc
    try:
        return json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant,
                          object_pairs_hook=object_pairs_hook)
    except _Refused as exc:
        raise Fp8ExportError(f"{where}: {what} holds {exc}; refused. Restore or regenerate the "
                             "file.") from exc
    except json.JSONDecodeError as exc:
        raise Fp8ExportError(f"{where}: {what} is not valid JSON ({exc.msg} at line {exc.lineno} "
                             f"column {exc.colno}). Restore or regenerate the file.") from exc
    except (ValueError, RecursionError) as exc:  # object_pairs_hook refusals, C-level limits
        raise Fp8ExportError(f"{where}: {what} is not usable JSON ({exc}). Restore or "
                             "regenerate the file.") from exc


def read_json(path: str | Path, kind: FileKind, *, root: str | Path | None = None,
              what: str | None = None) -> Any:
    """:func:`read_input` then :func:`parse_json`."""
    return parse_json(read_input(path, kind, root=root), path, what or kind.what)


def read_json_object(path: str | Path, kind: FileKind, *, root: str | Path | None = None,
                     what: str | None = None) -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object."""
    data = read_json(path, kind, root=root, what=what)
    if not isinstance(data, dict):
        raise Fp8ExportError(f"{path}: {what or kind.what} must hold a JSON object, not "
                             f"{type(data).__name__}. Restore or regenerate the file.")
    return data


def parse_yaml(raw: bytes, where: str | Path, what: str = "YAML file") -> Any:
    """Parse untrusted YAML with PyYAML's safe loader, aliases refused: ``*name`` repeats a node,
    so a few hundred bytes of nested aliases ("billion laughs") expand to gigabytes, and no file
    fp8export reads needs them. Errors name ``where``."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise Fp8ExportError(
                    f"{where}: line {mark.line + 1}: YAML alias (*name) refused: aliases repeat "
                    "nodes and can expand a small file into gigabytes. Write the values out.")
            return super().compose_node(parent, index)

    try:
        return yaml.load(raw.decode("utf-8"), Loader=NoAliases)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise Fp8ExportError(f"{where}: cannot parse {what} ({first}).") from exc
