"""convert --scheme NAME: each scheme writes exactly what the options it stands for write (the
options spelled out here from the peers' definitions, not read from the scheme table), explicit
options refine it, --list-schemes lists them, and bad names are usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fp8export.convert.config import ConvertConfig
from fp8export.convert.recipe import resolve_config
from fp8export.convert.schemes import SCHEMES
from fp8export.errors import EXIT_USAGE, UsageError


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    from fp8_folders import markov_tokens

    path = tmp_path_factory.mktemp("scheme-data") / "calib.npz"
    np.savez(path, input_ids=markov_tokens(256, 64, 32, seed=7).numpy())
    return path


# The peers' definitions (compressed-tensors quant_scheme.py PRESET_SCHEMES; ModelOpt hf_ptq
# QUANT_CFG_CHOICES), as fp8export options.
FP8_DYNAMIC = ["--weight-granularity", "channel", "--dynamic-activations", "token",
               "--scales", "weights"]
FP8_STATIC = ["--weight-granularity", "tensor", "--scales", "calibrate", "--calib-method", "max"]
FP8_BLOCK = ["--weight-granularity", "block", "--block-size", "128x128", "--scales", "weights"]
CASES = {
    "FP8_DYNAMIC": (["--scheme", "FP8_DYNAMIC"], FP8_DYNAMIC, False),
    "ModelOpt fp8_pc_pt": (["--scheme", "fp8_pc_pt"], FP8_DYNAMIC, False),
    "FP8": (["--scheme", "FP8"], FP8_STATIC, True),
    "ModelOpt fp8": (["--scheme", "fp8"], FP8_STATIC, True),
    "FP8_BLOCK": (["--scheme", "FP8_BLOCK"], FP8_BLOCK, False),
    "FP8_DYNAMIC with GPTQ": (["--scheme", "FP8_DYNAMIC", "--weight-rounding", "gptq"],
                              [*FP8_DYNAMIC, "--weight-rounding", "gptq"], True),
}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("case", CASES)
def test_scheme_writes_what_its_options_write(case, markov_llama, calib, tmp_path, run_cli):
    by_name, spelled_out, data = CASES[case]
    extra = ["--calib-data", calib, "--calib-samples", "32"] if data else []
    named = run_cli("convert", markov_llama, "-o", tmp_path / "named", *by_name, *extra)
    assert named.exit_code == 0, named.output
    plain = run_cli("convert", markov_llama, "-o", tmp_path / "plain", *spelled_out, *extra)
    assert plain.exit_code == 0, plain.output
    a, b = _files(tmp_path / "named"), _files(tmp_path / "plain")
    assert sorted(a) == sorted(b)
    for name in a:  # the same tensors, byte for byte, and the same config
        if name != "fp8export.json":
            assert a[name] == b[name], name
    man, ref = json.loads(a["fp8export.json"]), json.loads(b["fp8export.json"])
    scheme = SCHEMES[man["scheme"]["name"]]
    assert man["options"].pop("scheme") == scheme.name and ref["options"].pop("scheme") is None
    assert man["options"] == ref["options"]  # the recorded run is the same run
    assert man["scheme"]["options"] == {k: list(v) if isinstance(v, tuple) else v
                                        for k, v in scheme.options.items()}
    assert man["scheme"]["overridden"] == {}
    assert f"scheme: {scheme.name} = {scheme.flags()}" in named.stdout


def test_scheme_matches_peer_config_groups(markov_llama, calib, tmp_path, run_cli):
    """What each scheme declares in config.json is compressed-tensors' preset of that name:
    weight strategy, input strategy, dynamic, group and block sizes."""
    want = {
        "FP8": ({"strategy": "tensor", "dynamic": False},
                {"strategy": "tensor", "dynamic": False}),
        "FP8_DYNAMIC": ({"strategy": "channel", "dynamic": False},
                        {"strategy": "token", "dynamic": True}),
        "FP8_BLOCK": ({"strategy": "block", "dynamic": False, "block_structure": [128, 128]},
                      {"strategy": "group", "dynamic": True, "group_size": 128}),
    }
    for name, (weights, inputs) in want.items():
        out = tmp_path / name
        extra = ["--calib-data", calib, "--calib-samples", "16"] if name == "FP8" else []
        r = run_cli("convert", markov_llama, "-o", out, "--scheme", name, *extra)
        assert r.exit_code == 0, r.output
        group = json.loads((out / "config.json").read_text())["quantization_config"][
            "config_groups"]["group_0"]
        assert {k: group["weights"][k] for k in weights} == weights, name
        assert {k: group["input_activations"][k] for k in inputs} == inputs, name


def test_explicit_options_refine_a_scheme(markov_llama, tmp_path, run_cli):
    r = run_cli("convert", markov_llama, "-o", tmp_path / "o", "--scheme", "FP8_DYNAMIC",
                "--weight-granularity", "tensor")
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "o" / "fp8export.json").read_text())
    assert man["weight_granularity"] == "tensor" and man["dynamic_activations"] == "token"
    assert man["options"]["scales"] == "weights"  # from the scheme
    assert man["scheme"]["overridden"] == {"weight_granularity": "tensor"}
    assert "refined by --weight-granularity tensor" in r.stdout


def test_library_resolution_equals_the_spelled_out_config(tmp_path):
    for name, scheme in SCHEMES.items():
        data = {"calib_data": tmp_path / "c.txt"} if scheme.options["scales"] == "calibrate" \
            else {}
        got = resolve_config(tmp_path, scheme=name.lower(), **data)
        want = ConvertConfig(checkpoint=tmp_path, **data, **scheme.options, scheme=name)
        assert got == want, name
    assert resolve_config(tmp_path, scheme="FP8_BLOCK", block_size="64").block_size == (64, 64)


def test_list_schemes(run_cli):
    r = run_cli("convert", "--list-schemes")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    for name, scheme in SCHEMES.items():
        line = next(ln for ln in lines if ln.startswith(f"{name} "))
        assert scheme.flags() in line and all(p in line for p in scheme.peers)
    assert "PASSED" not in r.output  # informational, like --help


@pytest.mark.parametrize(("scheme", "message"), [
    ("FP8_NONSENSE", "unknown scheme 'FP8_NONSENSE'; known schemes: FP8_DYNAMIC, FP8, FP8_BLOCK"),
    ("fp8_pb_wo", "weight-only FP8"),
    ("FP8", "with --scheme FP8 (--weight-granularity tensor --scales calibrate --calib-method "
            "max): --scales calibrate needs --calib-data"),
])
def test_bad_schemes_are_usage_errors_before_any_work(scheme, message, tmp_path, run_cli):
    r = run_cli("convert", tmp_path / "no-such", "-o", tmp_path / "o", "--scheme", scheme)
    assert r.exit_code == EXIT_USAGE, r.output
    assert message in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_contradicting_a_scheme_is_a_usage_error(tmp_path, run_cli):
    r = run_cli("convert", tmp_path / "no-such", "--scheme", "FP8_BLOCK", "--scales",
                "calibrate", "--calib-data", tmp_path / "c.txt")
    assert r.exit_code == EXIT_USAGE, r.output
    assert "with --scheme FP8_BLOCK" in r.stderr and "drop --scales calibrate" in r.stderr
    with pytest.raises(UsageError, match="--format vllm cannot hold per-channel"):
        resolve_config(tmp_path, scheme="FP8_DYNAMIC", format="vllm")
