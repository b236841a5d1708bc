"""Optional providers from other packages (history policy, calibration, sensitivity), imported late.

A provider that is not installed in this build is an error that names the option and what to
use instead — never a silent fallback.
"""

from __future__ import annotations

import importlib
from typing import Any

from fp8export.errors import Fp8ExportError


def provider(module: str, attr: str, option: str, instead: str) -> Any:
    """``module.attr``, or Fp8ExportError saying ``option`` is unavailable and what to do."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise Fp8ExportError(f"{option} is unavailable in this build of fp8export ({module} "
                                 f"is not installed). {instead}") from exc
        raise
    fn = getattr(mod, attr, None)
    if fn is None:
        raise Fp8ExportError(f"{option} is unavailable in this build of fp8export "
                             f"({module}.{attr} is missing). {instead}")
    return fn
