"""The checkpoint's tokenizer, run in a child process with memory and CPU-time limits.

Tokenizers are native code fed by the checkpoint: a ``tokenizer.json`` can make them allocate
until the allocator aborts the whole process (SIGABRT: no ``except`` runs), spin in a regex for
hours, or panic. :mod:`fp8export.inputs.tokenizer_rules` refuses the known shapes of that before
anything runs; this module contains the rest. The tokenizer is loaded and run in a forked child
(cheap: the parent has already imported transformers, and the pages are shared copy-on-write):

* its address space is limited (``RLIMIT_AS``: what the parent had plus
  :func:`memory_budget`), so a memory bomb ends the child, not the command;
* every request (load, a batch of lines, the report's decoding) gets :data:`REQUEST_SECONDS`
  of CPU time (``RLIMIT_CPU``, raised request by request) and twice that of wall time, after
  which the parent kills the child;
* a panic or any exception in the child comes back as a message.

Each ends in one :class:`~fp8export.errors.Fp8ExportError` naming the tokenizer and what it was
doing. Requests and answers are length-prefixed JSON (token ids as raw int64 bytes); nothing is
unpickled. The child dies with the parent (``PR_SET_PDEATHSIG``) and reads nothing but the pipe.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import resource
import select
import signal
import struct
import time
import warnings
from pathlib import Path
from typing import Any

from fp8export.errors import Fp8ExportError

GiB = 1 << 30
REQUEST_SECONDS = 120
MEMORY_BASE = 2 * GiB
MEMORY_PER_FILE_BYTE = 32  # a loaded tokenizer takes ~10x its tokenizer.json; 3x more spare
_HEAD = struct.Struct("<QQ")  # JSON length, binary length


def memory_budget(private: Path) -> int:
    """Bytes the child may add to the address space it inherits."""
    files = sum(p.stat().st_size for p in private.iterdir() if p.is_file())
    return MEMORY_BASE + MEMORY_PER_FILE_BYTE * files


class TokenizerProcess:
    """A loaded tokenizer in a child process. Use as a context manager.

    ``facts``: ``pad_token_id``, ``eos_token_id`` (or None) and ``num_special`` (special
    tokens a single sequence gets).
    """

    def __init__(self, private: Path, name: str, *, memory_bytes: int | None = None,
                 seconds: float = REQUEST_SECONDS, owns_private: bool = False):
        self.name = name  # what messages call the tokenizer: its tokenizer.json, or the folder
        # removed once the child has loaded what it needs from it (or on close)
        self._private = private if owns_private else None
        self._facts: dict[str, Any] | None = None
        self.seconds = float(seconds)
        self.memory_bytes = int(memory_bytes if memory_bytes is not None
                                else memory_budget(private))
        self.pid = 0
        self._busy = True  # until the child answers: loading
        import transformers
        from transformers import AutoTokenizer  # noqa: F401  (and its tokenizer modules)

        # Imported here, once, shared with the child: transformers' tokenizer classes, and the
        # config class AutoTokenizer looks up (our own one-key config.json; the command loads
        # that model's config anyway). The child would otherwise import them on every start.
        if (private / "config.json").is_file():
            transformers.AutoConfig.from_pretrained(str(private), local_files_only=True,
                                                    trust_remote_code=False)

        pid = -1
        to_child, self._to_child = os.pipe()
        self._from_child, from_child = os.pipe()
        gc.freeze()  # the child's collector leaves the parent's objects (and their pages) alone
        try:
            with warnings.catch_warnings():  # Python 3.12+ warns about fork with threads
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        finally:
            if pid != 0:
                gc.unfreeze()
        if pid == 0:  # the child: never returns
            os.close(self._to_child)
            os.close(self._from_child)
            _child(to_child, from_child, private, self.memory_bytes, self.seconds)
        self.pid = pid
        os.close(to_child)
        os.close(from_child)
        # The child loads while the caller goes on (verify loads its models meanwhile); its
        # answer is awaited on first use, and a tokenizer that fails to load fails there.

    @property
    def facts(self) -> dict[str, Any]:
        """What the loaded tokenizer says of itself; waits for the child to have loaded it."""
        if self._facts is None:
            try:
                self._facts = self._answer("loading it")[0]
            except BaseException:
                self.close()
                raise
            finally:
                self._drop_private()
        return self._facts

    def _drop_private(self) -> None:
        if self._private is not None:
            import shutil

            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None

    # ------------------------------------------------------------------------- requests
    def encode(self, texts: list[str], what: str) -> list[list[int]]:
        """Token ids of each text (with the tokenizer's default special tokens)."""
        import numpy as np

        self.facts  # noqa: B018 - loaded (or its failure raised) before the first request
        self._send({"op": "encode", "texts": texts})
        head, blob = self._answer(what)
        ids = np.frombuffer(blob, dtype="<i8")
        out, start = [], 0
        for n in head["lengths"]:
            out.append(ids[start:start + n].tolist())
            start += n
        return out

    def decode(self, sequences: list[list[int]], what: str) -> list[str | None]:
        """Each id sequence as text (None where the tokenizer could not decode it)."""
        self.facts  # noqa: B018
        self._send({"op": "decode", "sequences": [[int(i) for i in s] for s in sequences]})
        return self._answer(what)[0]["texts"]

    def _send(self, message: dict[str, Any]) -> None:
        self._busy = True
        data = json.dumps(message).encode("utf-8")
        try:
            _write_all(self._to_child, _HEAD.pack(len(data), 0) + data)
        except OSError:  # the child is gone: _answer says why
            pass

    def _answer(self, what: str) -> tuple[dict[str, Any], bytes]:
        deadline = time.monotonic() + 2 * self.seconds + 10
        try:
            head_len, blob_len = _HEAD.unpack(self._read(_HEAD.size, deadline))
            head = json.loads(self._read(head_len, deadline))
            blob = self._read(blob_len, deadline)
        except _ChildGone:
            raise self._died(what) from None
        self._busy = False
        if not head.get("ok"):
            raise Fp8ExportError(f"{self.name}: the tokenizer failed while {what} "
                                 f"({head.get('error', 'unknown error')}). The tokenizer files "
                                 "are broken or hostile; restore them, or give pre-tokenised "
                                 ".npz / .safetensors data.")
        return head, blob

    def _read(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise Fp8ExportError(
                    f"{self.name}: the tokenizer ran longer than its limit ({self.seconds:.0f} s "
                    "of CPU time per request) and was stopped; the tokenizer files are hostile "
                    "or broken (a regex that backtracks for ever?). Restore them, or give "
                    "pre-tokenised .npz / .safetensors data.")
            ready, _, _ = select.select([self._from_child], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(self._from_child, min(n - got, 1 << 20))
            if not chunk:
                raise _ChildGone
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _died(self, what: str) -> Fp8ExportError:
        status = self._wait()
        sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
        if sig == signal.SIGXCPU:
            why = f"ran longer than its limit ({self.seconds:.0f} s of CPU time per request)"
        elif sig in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGKILL):
            why = (f"was stopped by {signal.Signals(sig).name} (memory limit "
                   f"{self.memory_bytes / GiB:.1f} GiB beyond the process: it tried to use more)")
        else:
            why = f"ended unexpectedly (status {status})"
        return Fp8ExportError(f"{self.name}: the tokenizer {why} while {what}; the tokenizer "
                              "files are hostile or broken. Refused: restore them, or give "
                              "pre-tokenised .npz / .safetensors data.")

    # ------------------------------------------------------------------------- lifetime
    def _kill(self) -> None:
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait()

    def _wait(self) -> int | None:
        if not self.pid:
            return None
        pid, self.pid = self.pid, 0
        try:
            return os.waitpid(pid, 0)[1]
        except ChildProcessError:
            return None

    def close(self) -> None:
        """End the child: killed if it is still working on a request (an interrupt, an error
        on our side), else its closed pipe ends it and it is reaped without waiting."""
        if self._busy:
            self._kill()
        for fd in ("_to_child", "_from_child"):
            if getattr(self, fd, None) is not None:
                os.close(getattr(self, fd))
                setattr(self, fd, None)
        if self.pid:
            _EXITING.append(self.pid)  # it exits in a few ms; reaped by the next _reap()
            self.pid = 0
        _reap()
        self._drop_private()

    def __enter__(self) -> TokenizerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "pid", 0):
            self._kill()
        if getattr(self, "_private", None) is not None:
            self._drop_private()


class _ChildGone(Exception):
    pass


# Children told to exit and not reaped yet: waiting for one costs the time the kernel needs to
# tear down a copy of a large address space (tens of ms), so they are reaped later.
_EXITING: list[int] = []


def _reap(wait: bool = False) -> None:
    for pid in list(_EXITING):
        try:
            done = os.waitpid(pid, 0 if wait else os.WNOHANG)[0]
        except ChildProcessError:
            done = pid
        if done:
            _EXITING.remove(pid)


def _reap_at_exit() -> None:
    for pid in _EXITING:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _reap(wait=True)


atexit.register(_reap_at_exit)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------------------- the child

def _child(requests: int, answers: int, private: Path, memory: int, seconds: float) -> None:
    """Load the tokenizer and serve requests until the pipe closes; always ``os._exit``."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        import faulthandler

        faulthandler.disable()  # it may write to a copy of stderr (pytest's, PYTHONFAULTHANDLER)
        quiet = os.open(os.devnull, os.O_RDWR)  # what it would print (a Rust panic's
        for fd in (0, 1, 2):  # backtrace, file content) comes back as a message instead
            os.dup2(quiet, fd)
        _die_with_parent()
        _limit(memory, seconds)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no thread pool: one thread, one arena
        tok = _load(private, answers)
        while tok is not None:
            raw = _read_exact(requests, _HEAD.size)
            if raw is None:
                break
            size, _ = _HEAD.unpack(raw)
            body = _read_exact(requests, size)
            if body is None:
                break
            _cpu_for_next_request(seconds)
            _serve(tok, json.loads(body), answers)
    except BaseException:  # noqa: BLE001 - the child must end here, whatever happened
        pass
    finally:
        os._exit(0)


def _die_with_parent() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed pipe ends the child instead
        pass


def _limit(memory: int, seconds: float) -> None:
    try:
        with open("/proc/self/statm") as f:
            have = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (have + memory, have + memory))
    except (OSError, ValueError):  # no procfs (macOS, where RLIMIT_AS is not enforced anyway)
        pass
    _cpu_for_next_request(seconds)


def _cpu_for_next_request(seconds: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = int(used + seconds) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _reply(fd: int, head: dict[str, Any], blob: bytes = b"") -> None:
    data = json.dumps(head).encode("utf-8")
    _write_all(fd, _HEAD.pack(len(data), len(blob)) + data + blob)


def _failure(exc: BaseException) -> dict[str, Any]:
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return {"ok": False, "error": f"{type(exc).__name__}: {text}" if text
            else type(exc).__name__}


def _load(private: Path, answers: int):
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        tok = transformers.AutoTokenizer.from_pretrained(
            str(private), local_files_only=True, trust_remote_code=False)
        try:
            special = int(tok.num_special_tokens_to_add(pair=False))
        except Exception:  # slow tokenizers without the method: count nothing as special
            special = 0
        facts = {"ok": True, "num_special": special}
        for key in ("pad_token_id", "eos_token_id"):
            value = getattr(tok, key, None)
            facts[key] = value if isinstance(value, int) and not isinstance(value, bool) else None
    except BaseException as exc:  # noqa: BLE001 - PanicException is a BaseException
        text = _failure(exc)
        text["error"] = text["error"].replace(str(private), "<tokenizer folder>")
        _reply(answers, text)
        return None
    _reply(answers, facts)
    return tok


def _serve(tok, request: dict[str, Any], answers: int) -> None:
    import numpy as np

    try:
        if request.get("op") == "encode":
            texts = request["texts"]
            ids = tok(texts, add_special_tokens=True, truncation=False)["input_ids"] if texts \
                else []
            lengths = [len(row) for row in ids]
            flat = np.fromiter((int(t) for row in ids for t in row), dtype="<i8",
                               count=sum(lengths))
            _reply(answers, {"ok": True, "lengths": lengths}, flat.tobytes())
            return
        texts = []
        for seq in request["sequences"]:
            try:
                texts.append(tok.decode(seq, skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False))
            except Exception:  # one id sequence it cannot decode: shown as ids instead
                texts.append(None)
        _reply(answers, {"ok": True, "texts": texts})
    except BaseException as exc:  # noqa: BLE001 - PanicException is a BaseException
        _reply(answers, _failure(exc))
