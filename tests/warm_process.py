"""A warm interpreter that forks a fresh process for each run, for tests that start many.

A cold ``python -m fp8export.cli`` spends seconds importing torch and transformers before it
reads a byte, and a cold Keras probe child a third of a second on numpy and h5py; tests that
start hundreds of them spent most of their time there. The server here imports the packages
once and forks one child per run. Each child is a real process of its own: stdin, stdout and
stderr are its own files, it gets the run's environment and working directory, runs its target
as a fresh interpreter would (``-m module``: ``runpy`` as ``__main__`` with the working directory
first on ``sys.path``; ``module:function``: ``sys.exit(function(argv))``, a module's usual
``__main__`` block) and ends through the normal interpreter shutdown, so its exit status (a
signal included), flushed output and exit handlers are what a fresh process would give.

What only a cold interpreter shows (a package's import-time output, an import error) is left to
the tests that still start one (tests/corrupt: SUBPROCESS_IDS; tests/checkpoint: the probe's own
tests).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

# set by pytest for each test; nothing a server preloads reads it
IGNORED_ENV = ("PYTEST_CURRENT_TEST",)


def same_env(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in IGNORED_ENV} == \
        {k: v for k, v in b.items() if k not in IGNORED_ENV}


class WarmPython:
    """The test side. ``preload``: modules the server imports before it forks (not onnxruntime:
    a child forked after importing it hangs at exit). ``env``: the server's environment, which
    every run must share (a package may read it when imported)."""

    def __init__(self, preload: tuple[str, ...], *, env: dict, cwd: Path, scratch: Path):
        self.env, self.cwd, self.scratch = dict(env), Path(cwd), Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, __file__, *preload], cwd=cwd, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, bufsize=0)
        self.n, self.pending = 0, b""

    def _reply(self, timeout: float) -> dict | None:
        """The server's next line, or None after ``timeout`` seconds without one."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the warm Python server ended (exit {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, target: str, argv: list[str], *, env: dict, stdin: str | None = None,
            timeout: float, capture: bool = True) -> subprocess.CompletedProcess:
        """Run ``target`` ("-m module" or "module:function") with ``argv`` in a forked child;
        raises subprocess.TimeoutExpired (the child killed) after ``timeout`` seconds.
        ``capture=False``: stdin, stdout and stderr are /dev/null."""
        assert same_env(env, self.env), "a run in another environment needs a cold process"
        self.n += 1
        files = {k: self.scratch / f"{self.n}.{k}" if capture else Path(os.devnull)
                 for k in ("in", "out", "err")}
        if capture:
            files["in"].write_text(stdin or "")
        self.proc.stdin.write(json.dumps({"target": target, "argv": argv, "cwd": str(self.cwd),
                                          "env": env, **{k: str(v) for k, v in files.items()}})
                              .encode() + b"\n")
        pid = self._reply(60)["pid"]
        status = self._reply(timeout)
        if status is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended just now
                pass
            self._reply(60)
            raise subprocess.TimeoutExpired([target, *argv], timeout)
        if not capture:
            return subprocess.CompletedProcess([target, *argv], status["status"])
        # decoded as subprocess.run(text=True) does: UTF-8, universal newlines
        out, err = (files[k].read_bytes().decode().replace("\r\n", "\n").replace("\r", "\n")
                    for k in ("out", "err"))
        for f in files.values():
            f.unlink()
        return subprocess.CompletedProcess([target, *argv], status["status"], out, err)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class KerasProbeLauncher:
    """``subprocess`` as fp8export.checkpoint.keras_probe sees it in the Keras fuzz tests
    (conftest's ``warm_keras_probe``): its one ``run`` starts the probe's child by forking a warm
    server (numpy, h5py and the reader imported) instead of a fresh interpreter, a third of a
    second per example. The child still walks the file in a process of its own: a crash is its
    signal, a hang its timeout. The cold start is tested in tests/checkpoint/test_keras_bad_input.py
    and by every other test that opens a Keras file."""

    DEVNULL = subprocess.DEVNULL
    TimeoutExpired = subprocess.TimeoutExpired
    PRELOAD = ("fp8export.checkpoint.keras_reader",)

    def __init__(self, server: WarmPython):
        self.server = server

    def run(self, argv, *, env, stdin, stdout, stderr, timeout):
        from fp8export.checkpoint import keras_probe

        assert argv[:3] == [sys.executable, "-m", keras_probe.__name__], argv
        assert stdin == stdout == stderr == subprocess.DEVNULL
        return self.server.run(f"{keras_probe.__name__}:_main", argv[3:], env=env,
                               timeout=timeout, capture=False)


def _child(req: dict, control) -> None:
    for f in control:  # the server's pipes are not the child's
        f.close()
    for fd, name, flags in ((0, "in", os.O_RDONLY),
                            (1, "out", os.O_WRONLY | os.O_TRUNC | os.O_CREAT),
                            (2, "err", os.O_WRONLY | os.O_TRUNC | os.O_CREAT)):
        f = os.open(req[name], flags, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    target = req["target"]
    if target.startswith("-m "):
        import runpy

        sys.argv = ["-m", *req["argv"]]
        runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
        sys.exit(0)  # a module that returned
    import importlib

    module, function = target.split(":")
    sys.argv = [module, *req["argv"]]
    sys.exit(getattr(importlib.import_module(module), function)(req["argv"]))


def _serve(preload: list[str]) -> None:
    import gc
    import importlib

    for name in preload:
        importlib.import_module(name)
    gc.freeze()  # a child's collections then leave the server's objects (and pages) alone
    requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    for line in requests:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req, (requests, replies))  # ends the child's interpreter; never returns
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
