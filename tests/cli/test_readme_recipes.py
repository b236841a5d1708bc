"""README's recommended recipes are command lines convert accepts: each one, run on the sample
with its placeholders filled in, converts (options and their combination are valid)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from fp8export.cli import cli

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "samples" / "tiny-llama"


def _recipes() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("**Recommended recipes, as command lines**")
    table = text[start:text.index("\n\n", text.index("| use | command |", start))]
    return re.findall(r"`(fp8export [^`]+)`", table)


@pytest.mark.slow  # six converts, three of them with GPTQ: minutes on a busy 2-core machine
def test_every_recommended_recipe_runs(tmp_path):
    commands = _recipes()
    converts = [c for c in commands if c.split()[1] == "convert"]
    assert len(converts) >= 4 and any("--weight-rounding gptq" in c for c in converts)
    assert any("--scheme" in c for c in converts) and "--recipe recipe.yaml" in converts[-1]
    for i, command in enumerate(converts):
        argv = shlex.split(command)[1:]
        if "recipe.yaml" in argv:  # the first recipe's recorded options, pinned as a file
            options = json.loads((tmp_path / "o0" / "fp8export.json").read_text())["options"]
            (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(options))
            shutil.copy(SAMPLE / "data" / "calib.txt", tmp_path / options["calib_data"])
        argv = [{"MODEL": str(SAMPLE / "model"), "MODEL-fp8": str(tmp_path / f"o{i}"),
                 "calib.txt": str(SAMPLE / "data" / "calib.txt"),
                 "recipe.yaml": str(tmp_path / "recipe.yaml")}.get(a, a) for a in argv]
        # small and quick here; the recipe's own options are untouched
        argv += ["--calib-samples", "16", "--accuracy-samples", "8", "--seq-len", "64"] \
            if "--accuracy-budget" in argv else \
            (["--calib-samples", "16", "--seq-len", "64"] if "--calib-data" in argv else [])
        r = CliRunner().invoke(cli, argv)
        assert r.exit_code == 0, (command, r.output)
        assert (tmp_path / f"o{i}" / "fp8export.json").is_file()
    replayed = tmp_path / f"o{len(converts) - 1}" / "model.safetensors"
    assert replayed.read_bytes() == (tmp_path / "o0" / "model.safetensors").read_bytes()
