"""Help that tells the truth: ``--help`` is instant (no torch/onnx/transformers: a subprocess
proves it), every option states its default, and the README's command table lists every option
of every command (and none that does not exist)."""

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from fp8export.cli import COMMANDS, LazyGroup

HEAVY = ("torch", "onnx", "onnxruntime", "transformers", "keras", "tensorrt", "numpy")
README = Path(__file__).resolve().parents[2] / "README.md"


def _imported_after(args: list[str]) -> set[str]:
    code = (
        "import sys\n"
        "from fp8export.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        f"print('MODULES', ' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("MODULES")][-1]
    return set(line.split()[1:])


def test_top_level_help_imports_nothing_heavy():
    assert _imported_after(["--help"]) == set()


def test_every_command_help_imports_nothing_heavy():
    for name in COMMANDS:
        assert _imported_after([name, "--help"]) == set(), name


def test_top_level_help_lists_each_command_once(run_cli):
    out = run_cli("--help").output
    for name in COMMANDS:
        assert len(re.findall(rf"^  {re.escape(name)} ", out, re.M)) == 1, (name, out)


@pytest.mark.parametrize("name", ["convert", "inspect", "verify"])
def test_commands_that_read_checkpoints_name_keras_inputs(run_cli, name):
    text = " ".join(run_cli(name, "--help").output.split())  # click wraps lines
    assert ".keras / .weights.h5" in text, text


def test_version(run_cli):
    result = run_cli("--version")
    assert result.exit_code == 0
    assert "fp8export" in result.output


def _options(name: str) -> list[click.Option]:
    return [p for p in LazyGroup._load(name).params
            if isinstance(p, click.Option) and p.name != "help"]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_states_its_default(name):
    missing = []
    for opt in _options(name):
        if opt.is_flag:  # off unless given
            continue
        shown = opt.show_default and opt.default is not None
        if not shown and "default" not in (opt.help or "").lower() \
                and "required" not in (opt.help or "").lower():
            missing.append(opt.opts[-1])
    assert not missing, f"{name}: help of {missing} does not say the default"


def _readme_rows() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Commands"):]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([a-z-]+) ", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_readme_table_lists_every_option():
    rows = _readme_rows()
    assert set(rows) == set(COMMANDS)
    for name in COMMANDS:
        cell = re.split(r"(?<!\\)\|", rows[name])[1]  # the first column; choices escape "|"
        listed = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", cell))
        omitted = [opt.opts[-1] for opt in _options(name) if not set(opt.opts) & listed]
        assert not omitted, f"README omits {omitted} of {name}"
        options = {o for opt in _options(name) for o in opt.opts}
        assert listed <= options, f"README lists {sorted(listed - options)} that {name} lacks"


def test_design_cli_block_lists_every_option():
    """docs/DESIGN.md's CLI contract names every option of every command, and no other."""
    text = (README.parent / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    start = text.index("```\nfp8export convert")
    block = text[start + 4:text.index("```", start + 4)]
    listed: dict[str, set[str]] = {}
    for line in block.splitlines():
        if line.startswith("fp8export "):
            name = line.split()[1]
        listed.setdefault(name, set()).update(
            re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", line.replace(f"fp8export {name}", "")))
    assert set(listed) == set(COMMANDS)
    for name in COMMANDS:
        options = {o for opt in _options(name) for o in opt.opts}
        omitted = [opt.opts[-1] for opt in _options(name) if not set(opt.opts) & listed[name]]
        assert not omitted, f"DESIGN.md omits {omitted} of {name}"
        assert listed[name] <= options, f"DESIGN.md lists {listed[name] - options} of {name}"


def test_convert_help_says_what_it_writes(run_cli):
    """The first line of convert --help names every weight granularity convert writes."""
    first = run_cli("convert", "--help").output.split("\n\n")[1]
    first = " ".join(first.split())
    assert "per tensor, channel or block" in first and "per-tensor scales." not in first
