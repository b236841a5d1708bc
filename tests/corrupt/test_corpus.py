"""The corrupt/hostile-input corpus through the real CLI.

For every case of ``make_corpus.py``: the exit code the contract requires (1 for bad input),
exactly one ``Error:`` line that names the file (or tensor) and the problem, no traceback, no
output left at the output path nor a hidden temporary sibling of it, and the payload's marker
file never created.

Exit 3 cases (verification ran and failed) expect one ``Verification failed:`` line instead;
exit 0 cases (documented fallbacks) expect their ``expect`` strings somewhere in the output.
Every case's output is checked for raw control characters (escapes are printed escaped).

Runtime: every case runs in-process through click's ``CliRunner`` (torch is imported once),
except those marked ``isolate`` or with their own ``env`` / ``rlimits``, which ``test_case``
runs as a separate process; ``test_case_in_subprocess`` runs a representative case per reader
as a real ``python -m fp8export.cli`` process (stdout/stderr, exit status, an interpreter that
starts cold), and with ``--run-slow`` every case that ``test_case`` did not already run as one:
each in a process of its own forked from a server that has torch and transformers imported
(tests/warm_process.py; the same stdout/stderr, exit status and shutdown, without the seconds
of imports that were most of this file's time).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_corpus  # noqa: E402
from warm_process import WarmPython, same_env  # noqa: E402

from fp8export.cli import cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
IDS = [fn.__name__ for fn in make_corpus.BUILDERS]
# cases that show a known bug in another module: strict xfail, so a fix makes them fail loudly
KNOWN_BUGS = {fn.__name__: fn.xfail for fn in make_corpus.BUILDERS if getattr(fn, "xfail", "")}


def _params(slow_unless=None):
    out = []
    for i in IDS:
        marks = []
        if i in KNOWN_BUGS:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[i]))
        if slow_unless is not None and i not in slow_unless:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(i, marks=marks))
    return out
# one per reader/stage, run as real processes in the default run
SUBPROCESS_IDS = ["st_truncated", "bin_malicious_pickle", "te2_malicious_extra_state",
                  "keras_zip_bomb", "calib_binary_txt", "engine_custom_op",
                  # checkpoint code with "y" on a real stdin pipe, one case per kind of entry
                  # point (every code_* case runs in-process with "y" on stdin by default, and
                  # as a process too with --run-slow)
                  "code_calibrate_tokenizer", "code_export_onnx", "code_verify_candidate_data"]

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return root, {c.id: c for c in make_corpus.build_corpus(root)}


def _leftovers(path: Path) -> list[str]:
    """The output itself and hidden temporary siblings such as ``.<name>.tmp-123-ab``."""
    found = [str(path)] if path.exists() or path.is_symlink() else []
    if path.parent.exists():
        found += [str(p) for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]
    return found


def _dig(obj, keys):
    for k in keys:
        obj = obj[k]
    return obj


def check(c: make_corpus.Case, code: int, stderr: str, stdout: str) -> None:
    everything = stdout + stderr
    if c.marker:
        assert not Path(c.marker).exists(), f"{c.id}: the payload ran ({c.marker} exists)"
    assert "[y/N]" not in everything, f"{c.id}: something prompted on stdin\n{everything[-2000:]}"
    assert code == c.exit, f"{c.id}: exit {code}, expected {c.exit}\n{everything[-3000:]}"
    assert "Traceback" not in everything, everything
    # nothing from a file reaches the terminal raw: no escape sequences, no C1 controls
    raw = [ch for ch in everything if ch not in "\n\t" and (ch < " " or "\x7f" <= ch <= "\x9f")]
    assert not raw, f"{c.id}: printed control characters {sorted(set(raw))!r}"
    for path, digest in c.unchanged.items():
        assert make_corpus.sha256_file(path) == digest, f"{c.id}: {path} was changed"
    for path in c.absent:
        assert not os.path.lexists(path), f"{c.id}: {path} exists"
    if c.exit == 0:
        for part in c.expect:  # a documented fallback says what it did
            assert part in everything, f"{c.id}: {part!r} not in the output\n{everything[-3000:]}"
        for out in map(Path, c.outputs):
            if c.manifest:
                manifest = json.loads((out / "fp8export.json").read_text())
                for keys, value in c.manifest:
                    assert _dig(manifest, keys) == value, (keys, _dig(manifest, keys))
            assert not _leftovers(out)[1:], _leftovers(out)
        return
    # exit 3: verification ran and failed (the reports are written); else one Error: line
    head = "Verification failed:" if c.exit == 3 else "Error:"
    errors = [line for line in stderr.splitlines() if line.startswith(head)]
    assert len(errors) == 1, f"{c.id}: expected one {head} line\n{stderr}"
    message = stderr[stderr.index(head):]
    for part in c.expect:
        assert part in message, f"{c.id}: {part!r} not in {message!r}"
    for out in map(Path, c.outputs):
        assert not _leftovers(out), f"{c.id}: left {_leftovers(out)}"


def test_corpus_is_large_and_covers_every_reader(corpus):
    _, cases = corpus
    assert len(cases) >= 30
    readers = {c.reader for c in cases.values()}
    assert {"safetensors", "hf-folder", "torch", "transformer-engine", "keras",
            "calibration-data", "fp8-folder/export-onnx", "onnx/build-engine",
            "onnx/verify"} <= readers
    assert sum(1 for c in cases.values() if c.marker) >= 15  # payload cases
    # checkpoint code through every command that builds a model or a tokenizer
    code = {c.argv[0] for c in cases.values() if c.reader == "code"}
    assert code == {"calibrate", "convert", "export-onnx", "verify"}
    assert {"paths", "outputs", "sizes", "parsing", "config"} <= readers


@pytest.mark.parametrize("cid", _params())
def test_case(corpus, cid):
    _, cases = corpus
    c = cases[cid]
    if c.isolate or c.env or c.rlimits:  # would hang or exhaust memory without its guard, or
        # needs an environment or limits of its own: never in this process
        r = _subprocess(c, timeout=ISOLATED_TIMEOUT_S)
        check(c, r.returncode, r.stderr, r.stdout)
        return
    result = CliRunner().invoke(cli, c.argv, input=c.stdin)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a crash: show it with its traceback
    check(c, result.exit_code, result.stderr, result.stdout)


# Isolated cases finish in seconds when guarded; unguarded they block (FIFO, a 10^15-step
# Loop) or read /dev/zero. The limits turn that into a failure instead of a hung CI job.
ISOLATED_TIMEOUT_S = 120
ISOLATED_MEMORY = 4 << 30


def _limits(c: make_corpus.Case):
    """preexec_fn: the address-space limit of isolated cases and the case's own limits."""
    import resource
    import signal

    def apply() -> None:
        if c.isolate:
            resource.setrlimit(resource.RLIMIT_AS, (ISOLATED_MEMORY, ISOLATED_MEMORY))
        for name, value in c.rlimits.items():
            limit = getattr(resource, f"RLIMIT_{name.upper()}")
            resource.setrlimit(limit, (value, value))
        if "fsize" in c.rlimits:  # a write past the limit fails (EFBIG) instead of killing
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


def _env(c: make_corpus.Case) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1", **c.env}


def _subprocess(c: make_corpus.Case, timeout: float = 300,
                warm: WarmPython | None = None) -> subprocess.CompletedProcess:
    """``python -m fp8export.cli`` started cold, or forked by the warm server."""
    env = _env(c)
    try:
        if warm is not None and same_env(warm.env, env):  # else its packages loaded in another
            return warm.run("-m fp8export.cli", c.argv, env=env, stdin=c.stdin, timeout=timeout)
        argv = [sys.executable, "-m", "fp8export.cli", *c.argv]
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout, input=c.stdin or "",
                              preexec_fn=_limits(c) if c.isolate or c.rlimits else None)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{c.id}: still running after {timeout} s (it blocks or never "
                             "ends)") from exc


# Third-party packages the commands import: never fp8export, which each child imports itself.
WARM_PRELOAD = ("numpy", "torch", "safetensors.torch", "transformers",
                "transformers.modeling_utils", "tokenizers", "onnx", "h5py", "click")


@pytest.fixture(scope="module")
def warm_cli(corpus):
    """``warm_cli(case)``: the warm server (tests/warm_process.py, started on first use) for the
    exploring pass, or None for the cases that run cold (SUBPROCESS_IDS)."""
    root, _ = corpus
    started = []

    def get(c: make_corpus.Case) -> WarmPython | None:
        if c.id in SUBPROCESS_IDS:
            return None
        if not started:
            started.append(WarmPython(WARM_PRELOAD, env=_env(c), cwd=REPO,
                                      scratch=root / "warm-cli"))
        return started[0]

    yield get
    for server in started:
        server.close()


@pytest.mark.parametrize("cid", _params(slow_unless=SUBPROCESS_IDS))
def test_case_in_subprocess(corpus, warm_cli, cid):
    _, cases = corpus
    c = cases[cid]
    if c.isolate or c.env or c.rlimits:
        pytest.skip("test_case runs it as a separate process already")
    if c.exit == 0:
        for out in map(Path, c.outputs):  # the in-process run may have written it already
            import shutil

            if out.is_dir():
                shutil.rmtree(out)
            else:
                out.unlink(missing_ok=True)
    r = _subprocess(c, warm=warm_cli(c))
    check(c, r.returncode, r.stderr, r.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("cid", ["st_truncated", "code_calibrate_tokenizer"])
def test_a_warm_process_answers_as_a_cold_one(corpus, warm_cli, cid):
    """The exploring pass's forked processes give what a cold ``python -m fp8export.cli``
    gives: the same exit status, stdout and stderr (but for the seconds in the status line)."""
    _, cases = corpus
    c = cases[cid]
    server = warm_cli(make_corpus.Case("warm", "", [], []))
    cold, warm = _subprocess(c), _subprocess(c, warm=server)

    def same(text: str) -> str:
        return re.sub(r"\| [0-9.]+s$", "| Ns", text.strip(), flags=re.M)

    assert (warm.returncode, same(warm.stdout), same(warm.stderr)) == \
        (cold.returncode, same(cold.stdout), same(cold.stderr))
    assert c.exit != 0 and warm.returncode == c.exit


def test_script_writes_a_case_list(tmp_path):
    assert make_corpus.main([str(tmp_path / "c")]) == 0
    listed = json.loads((tmp_path / "c" / "cases.json").read_text())
    assert [c["id"] for c in listed] == IDS
    assert not list((tmp_path / "c" / "out").iterdir())


# ---- gaps found while building the corpus (owned by other modules; see the report) -------

@pytest.mark.parametrize("cid", ["te2_malicious_extra_state", "te1_malicious_extra_state",
                                 "te2_unknown_global", "te2_nonfinite_history"])
def test_te_errors_name_the_file(corpus, cid):
    _, cases = corpus
    c = cases[cid]
    result = CliRunner().invoke(cli, c.argv)
    assert result.exit_code == 1
    assert Path(c.argv[1]).name in result.stderr, result.stderr
