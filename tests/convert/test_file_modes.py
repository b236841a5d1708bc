"""Every file of an FP8 folder is as readable as a plain write makes it: a server that runs as
another user must read the tokenizer and generation files as well as the weights and configs.

The folder's files are created with mode 0o666 less the umask (what ``open(path, "w")``
gives), its folders 0o777 less the umask, whatever path wrote them (the parallel writer, the
one-tensor-at-a-time writer, copied loader files).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from fp8export.convert.config import ConvertConfig
from fp8export.convert.pipeline import convert

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "samples" / "tiny-llama" / "model"
LOADER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json"}


def _convert_under_umask(mask: int, out: Path, **options) -> None:
    old = os.umask(mask)
    try:
        convert(ConvertConfig(checkpoint=MODEL, output=out, **options))
    finally:
        os.umask(old)


def _modes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode)
            for p in [folder, *folder.rglob("*")]}


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
@pytest.mark.parametrize("options", [{}, {"weight_granularity": "channel"}],
                         ids=["parallel-writer", "general-writer"])
def test_every_output_file_has_the_mode_a_plain_write_gives(tmp_path, mask, options):
    out = tmp_path / "fp8"
    _convert_under_umask(mask, out, **options)
    modes = _modes(out)
    assert LOADER_FILES <= set(modes)  # the copied tokenizer and generation files are there
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o777 if (out / name).is_dir() else 0o666) & ~mask}
    assert not wrong, f"umask {oct(mask)}: {wrong}"
    # and never less readable than the source file it was copied from
    for name in LOADER_FILES:
        source = stat.S_IMODE((MODEL / name).stat().st_mode)
        assert source & 0o444 & ~mask & ~modes[name] == 0, name


def _as_nobody() -> list[str] | None:
    if os.geteuid() != 0:
        return None
    for tool in (["runuser", "-u", "nobody", "--"],
                 ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]):
        if shutil.which(tool[0]):
            probe = subprocess.run([*tool, "true"], capture_output=True)
            if probe.returncode == 0:
                return tool
    return None


def test_another_user_reads_every_file_of_the_folder():
    as_nobody = _as_nobody()
    if as_nobody is None:
        pytest.skip("needs root and a working runuser/setpriv to act as another user")
    # pytest's tmp_path is private to this user; the server's view needs a readable parent.
    base = Path(tempfile.mkdtemp(prefix="fp8export-modes-"))
    try:
        base.chmod(0o755)
        out = base / "fp8"
        _convert_under_umask(0o022, out)
        files = sorted(str(p) for p in out.rglob("*") if p.is_file())
        assert {Path(f).name for f in files} >= LOADER_FILES
        read = subprocess.run([*as_nobody, "sh", "-c",
                               'for f; do cat "$f" > /dev/null || exit 1; done', "sh", *files],
                              capture_output=True, text=True)
        assert read.returncode == 0, read.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
