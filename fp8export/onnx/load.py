"""Reading an ONNX graph we did not write: guarded file, protobuf parse, external data checked.

``onnx.load`` on a user's file follows whatever it is (a FIFO blocks, a device reads forever),
raises protobuf's own errors on bytes that are not ONNX, and resolves external-data locations
itself (``../../etc/passwd`` is refused by onnx, as an uncaught ``ValidationError``). Here the
file is read through :func:`fp8export.io.guarded.read_input` (a regular file, at most
protobuf's 2 GiB), parsed, and every external-data reference is checked before anyone reads
it: a plain name inside the model's folder (no absolute path, no ``..``, no symlink leading
out), a regular file, with ``offset + length`` inside it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from fp8export.errors import Fp8ExportError
from fp8export.io.guarded import ONNX, WEIGHTS, open_input, read_input
from fp8export.io.paths import contained

HINT = "Export one with `fp8export export-onnx FP8DIR -o model.onnx`."


def _tensors(graph, depth: int = 0) -> Iterator:
    """Every TensorProto of ``graph`` and its subgraphs (initializers, attribute tensors)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if depth < 16:  # protobuf parsing already bounds nesting; this bounds our walk
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    yield from _tensors(sub, depth + 1)


def check_external_data(model, path: Path) -> list[Path]:
    """Validate every external-data reference of ``model`` (loaded from ``path``); return the
    files it names."""
    return sorted(external_extents(model, path))


def external_extents(model, path: Path) -> dict[Path, int]:
    """Validate every external-data reference of ``model`` (loaded from ``path``); return each
    file it names with the end of the last byte range the graph reads from it."""
    from onnx import TensorProto

    folder = path.parent
    files: dict[str, int] = {}
    ends: dict[str, int] = {}
    for t in _tensors(model.graph):
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        where = contained(folder, location, named_by=path)  # no abs path, no .., no escape
        if location not in files:
            with open_input(where, WEIGHTS, root=folder) as f:
                files[location] = os.fstat(f.fileno()).st_size
        try:
            offset = int(info.get("offset", 0) or 0)
            length = int(info["length"]) if "length" in info else files[location] - offset
        except ValueError as exc:
            raise Fp8ExportError(f"{path}: tensor {t.name!r} has external-data offset/length "
                                 f"that are not integers ({exc}). {HINT}") from exc
        if offset < 0 or length < 0 or offset + length > files[location]:
            raise Fp8ExportError(
                f"{path}: tensor {t.name!r} reads bytes {offset}..{offset + length} of "
                f"{location}, which holds {files[location]}; the external data is truncated or "
                f"does not belong to this graph. {HINT}")
        ends[location] = max(ends.get(location, 0), offset + length)
    return {folder / name: ends[name] for name in sorted(files)}


def load_onnx(path: str | Path, *, load_data: bool = False):
    """The ``onnx.ModelProto`` of ``path``, checked as the module docstring says.

    ``load_data`` also reads the (validated) external data into the tensors.
    """
    import onnx
    from google.protobuf.message import DecodeError

    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise Fp8ExportError(f"{p}: no such ONNX file. {HINT}")
    raw = read_input(p, ONNX)
    model = onnx.ModelProto()
    try:
        model.ParseFromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise Fp8ExportError(f"{p}: not a readable ONNX model ({type(exc).__name__}: {exc}). "
                             f"{HINT}") from exc
    if not model.HasField("graph") or not model.graph.node or not model.opset_import:
        raise Fp8ExportError(f"{p}: not a readable ONNX model (no graph nodes or opset in the "
                             f"{len(raw)} bytes). {HINT}")
    check_external_data(model, p)
    if load_data:
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(model, str(p.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise Fp8ExportError(f"{p}: cannot read its external data ({exc}). {HINT}") from exc
    return model
