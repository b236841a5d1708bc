"""Keeping paths named by untrusted files inside their folder.

Index files (``*.index.json``) name shard files; a hostile one can name ``../../etc/passwd``,
an absolute path, or a shard that is a symlink leading out of the folder. Every such path is
resolved (symlinks followed) and must land inside the checkpoint folder — or, for a Hugging
Face hub cache snapshot (``…/snapshots/<rev>/``, whose files are symlinks into the repo's
``blobs/``), inside that cache's ``blobs`` folder.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from fp8export.errors import Fp8ExportError


def allowed_roots(folder: Path) -> list[Path]:
    """Folders that files of ``folder`` may resolve into (see the module docstring)."""
    root = folder.resolve()
    roots = [root]
    if root.parent.name == "snapshots":  # huggingface_hub cache: <repo>/snapshots/<rev>/
        roots.append(root.parent.parent / "blobs")
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def contained(folder: Path, name: str, *, named_by: Path) -> Path:
    """``folder / name`` after checking that ``name`` cannot escape ``folder``.

    ``named_by`` is the file that gave us ``name`` (for the message). Returns the path inside
    the folder (not resolved, so messages show what the user sees); it may not exist.
    """
    if not isinstance(name, str) or not name:
        raise Fp8ExportError(f"{named_by}: file name {name!r} is not a non-empty string. "
                             "Fix or regenerate the file.")
    if (PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute()
            or ".." in PurePosixPath(name.replace("\\", "/")).parts or "\0" in name):
        raise Fp8ExportError(
            f"{named_by}: refers to {name!r}, a path outside the checkpoint folder; refused. "
            "Index entries must be file names inside the folder — regenerate the index."
        )
    path = folder / name
    check_symlink(path, folder, named_by=named_by)
    return path


def check_symlink(path: Path, folder: Path, *, named_by: Path | None = None) -> None:
    """Raise if ``path`` (or a symlink on the way) resolves outside ``folder``'s allowed roots."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as exc:  # symlink loops
        raise Fp8ExportError(f"{path}: cannot resolve the path ({exc}). Replace the symlink "
                             "with the real file.") from exc
    if not _inside(real, allowed_roots(folder)):
        origin = f" (named by {named_by})" if named_by else ""
        raise Fp8ExportError(
            f"{path}{origin}: resolves to {real}, outside the checkpoint folder {folder}; "
            "refused. Copy the real file into the folder instead of linking to it."
        )
