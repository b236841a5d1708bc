"""An FP8 folder converted from Keras keeps the Keras model's config.json: only fp8export's own
runtimes load it. convert's summary, the manifest and inspect say so (never vLLM/transformers),
and real transformers indeed refuses the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERAS = REPO / "samples" / "keras-float8" / "model"
NOTE = "converted from Keras: config.json is the Keras model's config"


@pytest.fixture(scope="module")
def keras_run(tmp_path_factory):
    from click.testing import CliRunner

    from fp8export.cli import cli

    out = tmp_path_factory.mktemp("keras") / "fp8"
    r = CliRunner().invoke(cli, ["convert", str(KERAS), "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out, r.stdout


def test_convert_names_fp8export_as_the_only_loader(keras_run):
    out, stdout = keras_run
    assert f"wrote {out}  [compressed-tensors: loads in fp8export (verify, export-onnx) only]" \
        in stdout
    assert f"note: {NOTE}" in stdout
    manifest = json.loads((out / "fp8export.json").read_text())
    assert manifest["loaded_by"] == ["fp8export (verify, export-onnx)"]
    assert manifest["notes"][0].startswith(NOTE)
    assert not any("vllm" in name or "transformers" in name for name in manifest["loaded_by"])


def test_inspect_says_the_same(keras_run, run_cli):
    out, _ = keras_run
    r = run_cli("inspect", out, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["summary"]["loaded_by"] == ["fp8export (verify, export-onnx)"]
    assert sum(n.startswith(NOTE) for n in data["notes"]) == 1


def test_transformers_really_cannot_load_it(keras_run):
    from transformers import AutoModel

    out, _ = keras_run
    with pytest.raises((ValueError, KeyError, OSError)):
        AutoModel.from_pretrained(out)


def test_keras_embeddings_and_norms_are_named_by_their_layer(keras_run):
    out, stdout = keras_run
    excluded = json.loads((out / "fp8export.json").read_text())["excluded"]
    embeddings = [n for n in excluded if "embedding" in n]
    norms = [n for n in excluded if "layer_norm" in n]
    assert len(embeddings) == 2 and len(norms) == 4
    assert {excluded[n] for n in embeddings} == {"embedding (kept in high precision by default)"}
    assert {excluded[n] for n in norms} == {"normalization (kept in high precision)"}
    assert "not a weight" not in stdout
