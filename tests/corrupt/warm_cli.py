"""A warm interpreter that forks a fresh process for each CLI run (the corpus's exploring pass).

A cold ``python -m fp8export.cli`` spends seconds importing torch and transformers before it
reads a byte, and the slow tier runs every corpus case that way: most of the corpus's time. The
server here imports those third-party packages once (never fp8export: each child imports it
itself, as a cold process does) and forks one child per run. Each child is a real process of its
own: stdin, stdout and stderr are its own files, it gets the run's environment and working
directory, runs the CLI exactly as ``python -m fp8export.cli`` does (``runpy`` as ``__main__``,
the working directory first on ``sys.path``) and ends through the normal interpreter shutdown,
so its exit status, flushed output and exit handlers are what a user's process would give.

What only a cold interpreter shows (a package's import-time output) is left to the cases that
``test_corpus.SUBPROCESS_IDS`` runs cold, one per reader and stage.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

# Third-party packages the commands import (fp8export must not be among them). Not
# onnxruntime: a child forked after importing it hangs at exit; it loads in a tenth of a second.
PRELOAD = ("numpy", "torch", "safetensors.torch", "transformers", "transformers.modeling_utils",
           "tokenizers", "onnx", "h5py", "click")
# set by pytest for each test; no package reads it
IGNORED_ENV = ("PYTEST_CURRENT_TEST",)


def same_env(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in IGNORED_ENV} == \
        {k: v for k, v in b.items() if k not in IGNORED_ENV}


class WarmCli:
    """The test side: ``run(argv, env=, stdin=, timeout=)`` -> a CompletedProcess."""

    def __init__(self, env: dict, cwd: Path, scratch: Path):
        self.env, self.cwd, self.scratch = dict(env), Path(cwd), Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, __file__], cwd=cwd, env=self.env,
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
                raise RuntimeError(f"the warm CLI server ended (exit {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], *, env: dict, stdin: str | None,
            timeout: float) -> subprocess.CompletedProcess:
        assert same_env(env, self.env), "a run in another environment needs a cold process"
        self.n += 1
        files = {k: self.scratch / f"{self.n}.{k}" for k in ("in", "out", "err")}
        files["in"].write_text(stdin or "")
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(self.cwd), "env": env,
                                          **{k: str(v) for k, v in files.items()}}).encode()
                              + b"\n")
        pid = self._reply(60)["pid"]
        status = self._reply(timeout)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            self._reply(60)
            raise subprocess.TimeoutExpired(argv, timeout)
        # decoded as subprocess.run(text=True) does: UTF-8, universal newlines
        out, err = (files[k].read_bytes().decode().replace("\r\n", "\n").replace("\r", "\n")
                    for k in ("out", "err"))
        return subprocess.CompletedProcess(argv, status["status"], out, err)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


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
    sys.argv = ["-m", *req["argv"]]
    import runpy

    runpy.run_module("fp8export.cli", run_name="__main__", alter_sys=True)
    sys.exit(0)  # cli.py exits itself; this is a module that returned


def _serve() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    assert not [m for m in sys.modules if m.split(".")[0] == "fp8export"], "fp8export preloaded"
    import gc

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
    _serve()
