"""Progress: live on a terminal, one ``[stage]`` line per step in CI logs and pipes."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from fp8export import _progress

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "samples" / "tiny-llama" / "model"


def test_off_a_terminal_each_stage_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with _progress.stage("loading the model"):
        time.sleep(0.6)  # longer than a tick: still one line
    assert list(_progress.progress(range(3), total=3, desc="writing", unit="tensor")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert err.splitlines() == ["[stage] loading the model", "[stage] writing: 3 tensor(s)"]
    assert "\r" not in err


def test_on_a_terminal_progress_is_live_and_erased(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "progress_enabled", lambda: True)
    with _progress.stage("tracing"):
        time.sleep(1.2)
    err = capsys.readouterr().err
    assert "\rtracing ... 1s" in err and err.endswith("\r\033[K")  # ticking, then erased
    assert "[stage]" not in err


def _run_in_pty(args: list[str]) -> tuple[int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "FP8EXPORT_NO_PROGRESS")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "fp8export.cli", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave,
                            env=env)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


def test_the_cli_on_a_real_terminal_shows_bars_not_stage_lines():
    code, err = _run_in_pty(["inspect", str(MODEL)])
    assert code == 0, err
    assert "\r" in err and "tensor" in err  # tqdm's bar over the tensors
    assert "[stage]" not in err
    assert err.strip().splitlines()[-1].startswith("PASSED | inspect | ")


def test_printable_escapes_every_character_a_terminal_acts_on():
    import unicodedata

    acts = [chr(c) for c in range(0x110000) if c not in (9, 10)
            and unicodedata.category(chr(c)) in ("Cc", "Cf", "Zl", "Zp", "Cs")]
    text = "".join(acts)
    shown = _progress.printable(text)
    assert all(unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp", "Cs") for ch in shown)
    assert _progress.printable("name\x1b]0;owned\x07\x1b[2J\x9b31m\u202e\tok\n") == \
        "name\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202e\tok\n"
    assert _progress.printable("plain text, ünïcödé, 中文") == "plain text, ünïcödé, 中文"


def test_commands_print_only_through_printable():
    """Everything a command prints may carry text from a file: it goes through echo()/info()
    (printable), never click.echo or print directly."""
    import ast

    root = REPO / "fp8export"
    offenders = []
    for path in [*sorted((root / "commands").glob("*.py")), root / "cli.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = (f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute)
                        and isinstance(f.value, ast.Name) else getattr(f, "id", ""))
                if name in ("click.echo", "print") and not (
                        node.args and isinstance(node.args[0], (ast.JoinedStr, ast.Constant))
                        and "printable" in ast.unparse(node.args[0])
                        or node.args and isinstance(node.args[0], ast.Call)
                        and "printable" in ast.unparse(node.args[0])
                        or path.name == "cli.py" and _constant_text(node)):
                    offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not offenders, offenders


def _constant_text(node) -> bool:
    """A message built only from constants and the command's own name/status (cli.py)."""
    import ast

    arg = node.args[0] if node.args else None
    if isinstance(arg, ast.Constant):
        return True
    return isinstance(arg, ast.JoinedStr) and all(
        isinstance(v, ast.Constant)
        or ast.unparse(v.value) in ("name", "status", "code", "what", "lead")
        or "perf_counter" in ast.unparse(v.value) for v in arg.values)
