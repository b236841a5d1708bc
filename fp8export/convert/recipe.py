"""A convert run's options from layers: defaults, a recipe file, a scheme, explicit options.

A **recipe file** (``convert --recipe FILE``, YAML or JSON) is a mapping with the keys of the
manifest's record of a run (``fp8export.json`` → ``options``: ``scales``, ``calib_data``,
``weight_granularity``, ``scheme``, ...), so the ``options`` of a folder's manifest saved as a
file replays that run; keys left out (or ``null``) keep their defaults. Relative paths in it
(``calib_data``, ``calib_amax``) are relative to the recipe file. It is read through the
guarded opener (a regular file of at most 1 MiB, YAML aliases refused), and what it holds is
checked before anything else is read: an unknown key, a value of the wrong type or an unknown
enum name is an error naming the file and the key (exit 1).

Layers, lowest first; each is a scheme's options (``convert/schemes.py``) overlaid by the
options given beside it: the defaults, then the recipe (its ``scheme``, then its keys), then
the command line (``--scheme``, then the options given explicitly). So explicit options refine
a scheme and override a recipe; a combination that cannot work is ``ConvertConfig``'s usage
error, prefixed with the scheme or recipe it came through.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from fp8export.convert.config import OPTION_ENUMS, ConvertConfig
from fp8export.convert.schemes import scheme_named
from fp8export.errors import Fp8ExportError, UsageError
from fp8export.fp8dir.manifest import NOT_RECORDED

# The keys a recipe may hold: every option the manifest records.
RECIPE_KEYS = tuple(f.name for f in fields(ConvertConfig)
                    if f.name not in NOT_RECORDED and f.name != "extra")
_BOOLS = {"weight_scales_from_history", "fuse_scales", "plan"}
_INTS = {"calib_samples", "batch_size", "seq_len", "accuracy_samples", "margin"}
_NUMBERS = {"percentile", "accuracy_budget"}
_LISTS = {"exclude", "include"}
_PATHS = {"calib_data", "calib_amax"}
_TEXT = {"max_memory", "scheme", *OPTION_ENUMS}


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The options a recipe file sets (null values dropped, relative paths resolved against
    the file's folder); Fp8ExportError naming the file and key for anything else."""
    from fp8export.io.guarded import RECIPE, parse_json, parse_yaml, read_input

    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise Fp8ExportError(f"{path}: no such recipe file. Give a YAML or JSON file of convert "
                             "options (the `options` of an fp8export.json manifest is one).")
    raw = read_input(path, RECIPE)
    data = parse_json(raw, path, RECIPE.what) if path.suffix.lower() == ".json" \
        else parse_yaml(raw, path, RECIPE.what)
    if not isinstance(data, dict):
        raise Fp8ExportError(f"{path}: a recipe file must be a mapping of convert options "
                             f"(e.g. scheme: FP8_DYNAMIC), not {type(data).__name__}.")
    unknown = sorted(str(k) for k in data if k not in RECIPE_KEYS)
    if unknown:
        where = " (checkpoint and output are given on the command line)" \
            if {"checkpoint", "output"} & set(unknown) else ""
        raise Fp8ExportError(f"{path}: unknown recipe key(s) {', '.join(unknown)}{where}; a "
                             f"recipe takes the keys of fp8export.json's options: "
                             f"{', '.join(RECIPE_KEYS)}.")
    options = {}
    for key, value in data.items():
        if value is not None:
            options[key] = _checked(path, key, value)
    return options


def _checked(path: Path, key: str, value: Any) -> Any:
    """``value`` of recipe key ``key`` in the type ConvertConfig takes, or an error."""
    def bad(want: str) -> Fp8ExportError:
        return Fp8ExportError(f"{path}: recipe key {key} must be {want}, got "
                              f"{str(value)[:80]!r}.")

    if key in _BOOLS:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if key in _INTS:
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("an integer")
        return value
    if key in _NUMBERS:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad("a number")
        return float(value)
    if key in _LISTS:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad("a list of glob patterns")
        return tuple(value)
    if key in _PATHS:
        if not isinstance(value, str) or not value:
            raise bad("a file path")
        return path.parent / value  # an absolute value stays absolute
    if key == "block_size":
        if not (isinstance(value, str) or (isinstance(value, list) and len(value) == 2
                                           and all(type(v) is int for v in value))):
            raise bad("NxK or a list [N, K]")
        return value
    if not isinstance(value, str):  # _TEXT
        raise bad("a string")
    try:
        if key in OPTION_ENUMS:
            OPTION_ENUMS[key].parse(value, key)
        elif key == "scheme":
            scheme_named(value)
    except UsageError as exc:
        raise Fp8ExportError(f"{path}: recipe {exc}") from None
    return value


def _layer(scheme: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """One layer: the scheme's options overlaid by the options given beside it."""
    out = dict(scheme_named(scheme).options) if scheme is not None else {}
    out.update(options)
    if scheme is not None:
        out["scheme"] = scheme
    return out


def resolve_config(checkpoint: str | Path, output: str | Path | None = None, *,
                   scheme: str | None = None, recipe: str | Path | None = None,
                   **options: Any) -> ConvertConfig:
    """The ``ConvertConfig`` of ``checkpoint`` from a recipe file, a scheme and options given
    explicitly (``ConvertConfig`` field names), layered as the module says. ``workers``,
    ``read_back`` and ``force`` pass through (a recipe does not hold them)."""
    values: dict[str, Any] = {}
    if recipe is not None:
        from_file = read_recipe(recipe)
        values.update(_layer(from_file.pop("scheme", None), from_file))
    values.update(_layer(scheme, options))
    try:
        return ConvertConfig(checkpoint=checkpoint, output=output, **values)
    except UsageError as exc:
        if scheme is None and recipe is None:
            raise
        via = [f"--scheme {scheme_named(values['scheme']).name} "
               f"({scheme_named(values['scheme']).flags()})"] if values.get("scheme") else []
        if recipe is not None:
            via.append(f"--recipe {Path(recipe).name}")
        if recipe is not None and scheme is None and not options:  # the file's own values
            raise Fp8ExportError(f"{recipe}: the recipe's options cannot work together: "
                                 f"{exc}") from None
        raise UsageError(f"with {' and '.join(via)}: {exc}") from None
