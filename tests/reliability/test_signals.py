"""SIGTERM and SIGHUP (a job killed by its scheduler, a closed terminal) clean up like Ctrl-C.

The command is a real process; the signal is sent the moment its hidden temporary output
(``.<name>.tmp-*``) appears, so the cleanup of a half-written output is what is tested. After
the signal: exit 128 + signal number, a ``Terminated by SIG…`` line and a ``FAILED`` status
line, no traceback, and nothing at the output path nor beside it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from reliability_helpers import CLI, REPO, cli_env, make_corpus, mid_checkpoint, siblings


def _default_signals() -> None:
    """preexec_fn: default dispositions, as from a terminal (a background test job may have
    SIGHUP ignored, and the CLI rightly keeps an ignored signal ignored)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def _signal_when_writing(argv: list, out: Path, sig: signal.Signals) -> tuple[int, str]:
    proc = subprocess.Popen([*CLI, *map(str, argv)], cwd=REPO, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_signals)
    try:
        deadline = time.monotonic() + 300
        while not any(".tmp-" in p.name for p in siblings(out)):
            assert proc.poll() is None, f"finished before writing began:\n{proc.stderr.read()}"
            assert time.monotonic() < deadline, "no temporary output after 300 s"
            time.sleep(0.0005)
        proc.send_signal(sig)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def _check(code: int, err: str, out: Path, sig: signal.Signals, command: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 128 + sig, f"exit {code}\n{err[-3000:]}"
    assert f"Terminated by {sig.name}" in err and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith(f"FAILED | {command} | ")
    assert not out.exists() and not siblings(out), siblings(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_during_convert_leaves_nothing(tmp_path, sig):
    ckpt = mid_checkpoint(tmp_path, hidden=384, layers=6)  # ~25 MB: a write window of a second
    out = tmp_path / "out"
    code, err = _signal_when_writing(["convert", ckpt, "-o", out], out, sig)
    _check(code, err, out, sig, "convert")


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGHUP,
                                                              marks=pytest.mark.slow)],
                         ids=lambda s: s.name)
def test_signal_during_export_onnx_leaves_nothing(tmp_path, sig):
    folder = make_corpus.fp8_folder(tmp_path, "fp8")
    out = tmp_path / "m.onnx"
    code, err = _signal_when_writing(["export-onnx", folder, "-o", out], out, sig)
    _check(code, err, out, sig, "export-onnx")
