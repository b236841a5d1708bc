"""convert --recipe FILE: the options a manifest records, saved as a file, replay the run (the
same folder, byte for byte); command-line options override it; a bad recipe file is an error
naming the file and key (exit 1) before anything is read, a bad combination a usage error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from fp8export.convert.recipe import RECIPE_KEYS, read_recipe, resolve_config
from fp8export.errors import EXIT_BAD_INPUT, EXIT_USAGE, Fp8ExportError


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    from fp8_folders import markov_tokens

    path = tmp_path_factory.mktemp("recipe-data") / "calib.npz"
    np.savez(path, input_ids=markov_tokens(256, 48, 32, seed=3).numpy())
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_manifest_options_replay_the_same_folder(suffix, markov_llama, calib, tmp_path,
                                                 run_cli):
    first = tmp_path / "a" / "out"
    r = run_cli("convert", markov_llama, "-o", first, "--scheme", "FP8", "--calib-data", calib,
                "--calib-samples", "24", "--exclude", "*.layers.1.mlp.down_proj",
                "--no-fuse-scales")
    assert r.exit_code == 0, r.output
    options = json.loads((first / "fp8export.json").read_text())["options"]
    assert set(options) == set(RECIPE_KEYS)  # a recipe takes exactly what the manifest records
    # elsewhere: the recipe beside its own copy of the data (its paths are relative to it)
    where = tmp_path / "ci"
    where.mkdir()
    shutil.copy(calib, where / options["calib_data"])
    recipe = where / f"recipe{suffix}"
    recipe.write_text(json.dumps(options) if suffix == ".json" else yaml.safe_dump(options))
    again = tmp_path / "b" / "out"
    r = run_cli("convert", markov_llama, "-o", again, "--recipe", recipe)
    assert r.exit_code == 0, r.output
    assert _files(first) == _files(again)  # the manifest included


def test_command_line_overrides_the_recipe(markov_llama, tmp_path, run_cli):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("scheme: FP8_DYNAMIC\nexclude: ['*.mlp.*']\n")
    r = run_cli("convert", markov_llama, "-o", tmp_path / "o", "--recipe", recipe,
                "--weight-granularity", "tensor", "--exclude", "*.o_proj")
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "o" / "fp8export.json").read_text())
    assert man["options"]["weight_granularity"] == "tensor"  # the command line
    assert man["options"]["scales"] == "weights"  # the recipe's scheme
    assert man["options"]["exclude"] == ["*.o_proj"]  # replaced, not appended
    assert man["scheme"]["name"] == "FP8_DYNAMIC"
    assert man["scheme"]["overridden"] == {"weight_granularity": "tensor"}
    # a scheme on the command line replaces the recipe's
    cfg = resolve_config(markov_llama, recipe=recipe, scheme="FP8_BLOCK")
    assert cfg.scheme == "FP8_BLOCK" and cfg.block_size == (128, 128)
    assert cfg.exclude == ("*.mlp.*",)


BAD = {
    "unknown key": ("scheme: FP8\nweight_granularty: channel\n", "unknown recipe key(s) "
                    "weight_granularty"),
    "checkpoint key": ("checkpoint: model\n", "checkpoint and output are given on the command "
                                              "line"),
    "wrong type": ("calib_samples: many\n", "recipe key calib_samples must be an integer"),
    "flag as text": ("fuse_scales: 'no'\n", "recipe key fuse_scales must be true or false"),
    "unknown value": ("scales: sometimes\n", "recipe scales: unknown value 'sometimes'"),
    "unknown scheme": ("scheme: FP4\n", "recipe --scheme: unknown scheme 'FP4'"),
    "not a mapping": ("- scheme: FP8\n", "must be a mapping of convert options"),
    "alias": ("a: &x [1]\nexclude: *x\n", "YAML alias (*name) refused"),
    "not YAML": ("scheme: [FP8\n", "cannot parse recipe file"),
    "its own contradiction": ("weight_granularity: block\nscales: calibrate\ncalib_data: c.txt\n",
                              "the recipe's options cannot work together"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_recipe_files_exit_1_naming_the_file(case, tmp_path, run_cli):
    text, message = BAD[case]
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    r = run_cli("convert", tmp_path / "no-such", "-o", tmp_path / "o", "--recipe", recipe)
    assert r.exit_code == EXIT_BAD_INPUT, r.output
    assert message in r.stderr and "bad.yaml" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_missing_recipe_and_overriding_into_a_contradiction(tmp_path, run_cli):
    r = run_cli("convert", tmp_path / "no-such", "--recipe", tmp_path / "none.yaml")
    assert r.exit_code == EXIT_BAD_INPUT and "no such recipe file" in r.stderr
    recipe = tmp_path / "r.yaml"
    recipe.write_text("scheme: FP8_BLOCK\n")
    r = run_cli("convert", tmp_path / "no-such", "--recipe", recipe, "--scales", "calibrate",
                "--calib-data", tmp_path / "c.txt")
    assert r.exit_code == EXIT_USAGE, r.output  # the command line made it so
    assert "with --scheme FP8_BLOCK" in r.stderr and "--recipe r.yaml" in r.stderr


def test_relative_paths_are_the_recipe_files_and_nulls_are_defaults(tmp_path):
    recipe = tmp_path / "sub" / "r.yml"
    recipe.parent.mkdir()
    recipe.write_text("calib_data: data/c.txt\ncalib_amax: null\nmargin: 2\n")
    assert read_recipe(recipe) == {"calib_data": tmp_path / "sub" / "data" / "c.txt",
                                   "margin": 2}
    big = tmp_path / "big.yaml"
    big.write_text("exclude:\n" + "  - 'x'\n" * 200_000)
    with pytest.raises(Fp8ExportError, match="big.yaml"):  # the guarded opener's size cap
        read_recipe(big)
