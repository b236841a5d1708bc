"""A Keras HDF5 weights file is walked by a separate process before this one opens it.

HDF5, the C library under h5py, is not hardened against hostile files: a corrupt attribute or
object header can crash the process that reads it (seen: a segfault reading a group's ``name``
attribute in a fuzzed ``.weights.h5``). So :func:`check` runs the same reader's discovery (every
group, link and attribute it will touch, no tensor data) in a child interpreter, and a child
killed by a signal, or one that does not finish within :data:`TIMEOUT_S`, becomes one
:class:`Fp8ExportError` naming the file instead of the user's process dying. Everything else —
including the reader's own refusals — is left to the in-process reader, which reports it as
usual. The child gets no input beyond the path and sends nothing back but its exit status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fp8export.errors import Fp8ExportError

TIMEOUT_S = 300.0
_CHILD_ENV = "FP8EXPORT_KERAS_PROBE_CHILD"  # set in the child: its reader must not probe again


def in_child() -> bool:
    return os.environ.get(_CHILD_ENV) == "1"


def check(path: Path) -> None:
    """Raise Fp8ExportError when walking ``path``'s HDF5 weights crashes or hangs a child."""
    env = dict(os.environ, **{_CHILD_ENV: "1"})
    try:
        r = subprocess.run([sys.executable, "-m", __name__, str(path)], env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=TIMEOUT_S)
    except OSError as exc:  # no process could start (a process limit, a missing interpreter)
        raise Fp8ExportError(f"{path}: could not start the separate process that checks its "
                             f"HDF5 weights ({exc}); HDF5 files are not opened without it. "
                             "Raise the process limit or run where Python can start a child "
                             "process.") from None
    except subprocess.TimeoutExpired:
        raise Fp8ExportError(f"{path}: walking its HDF5 weights did not finish in {TIMEOUT_S:.0f} "
                             "s (in a separate process); the file is damaged or not a Keras "
                             "weights file. Re-save the model.") from None
    if r.returncode < 0:
        try:
            name = signal.Signals(-r.returncode).name
        except ValueError:
            name = f"signal {-r.returncode}"
        raise Fp8ExportError(f"{path}: reading its HDF5 weights crashed the HDF5 library "
                             f"({name}, in a separate process); the file is damaged or hostile. "
                             "Re-save the model.")


def _main(argv: list[str]) -> int:
    from fp8export.checkpoint.keras_reader import KerasCheckpoint

    try:
        KerasCheckpoint.open(Path(argv[0])).close()
    except Exception:  # noqa: BLE001 - refusals are the parent's to report, in-process
        pass
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
