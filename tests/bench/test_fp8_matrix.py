"""The FP8-folder matrix of docs/fp8-folder.md is bench/fp8_matrix.py's, and what it says holds:
the table is rendered from the committed JSON, every cell has a result, each label's promise
of transformers is kept by the measured transformers column, and the hand-made rows' labels are
what the reader says of those folders now."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = json.loads((REPO / "bench" / "results" / "fp8_matrix.json").read_text())


def _bench():
    spec = importlib.util.spec_from_file_location("fp8_matrix", REPO / "bench" / "fp8_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_committed_results():
    bench = _bench()
    doc = (REPO / "docs" / "fp8-folder.md").read_text()
    published = doc[doc.index(bench.BEGIN) + len(bench.BEGIN):doc.index(bench.END)].strip()
    assert published == bench.render(RESULTS)
    assert (REPO / "bench" / "results" / "fp8_matrix.md").read_text().strip().endswith(published)


def test_every_row_was_run_and_every_cell_has_a_result():
    bench = _bench()
    assert set(RESULTS["rows"]) == set(bench.ROWS)
    for row, r in RESULTS["rows"].items():
        if r["made"] != "ok":  # a maker that fails says why (llm-compressor's own errors)
            assert r["maker"].startswith("llm-compressor") and r["made"], row
            continue
        assert all(cell and cell != "?" for cell in bench.cells(r)), row
        assert r["verify"]["exit"] in (0, 1, 3) and r["export_onnx"]["exit"] in (0, 1), row


def test_labels_that_promise_transformers_are_kept_by_transformers():
    for row, r in RESULTS["rows"].items():
        if r["made"] != "ok":
            continue
        promised = any(n.startswith("transformers") for n in r["inspect"]["loaded_by"] or [])
        t = r["transformers"]
        if promised:
            assert t["ok"] and t["kl"] < 1e-2, (row, t)
        if r["verify"]["exit"] == 1 and r["model"] == "tiny":
            # refused by fp8export: transformers runs those folders wrong or not at all
            assert not t["ok"] or t["kl"] > 0.1, (row, t)


@pytest.mark.parametrize("row", ["hand-deepseek", "hand-renamed", "hand-autofp8",
                                 "hand-modelopt"])
def test_hand_made_rows_are_labelled_as_the_reader_labels_them_now(row, tmp_path):
    """Rebuilt on the sample (its dimensions, like the matrix model's, are whole 8x8 blocks:
    the label depends on the format and on whole or partial blocks only)."""
    from fp8export.errors import Fp8ExportError
    from fp8export.fp8dir.reader import read_fp8_folder

    sys.path.insert(0, str(REPO / "tests" / "fp8dir"))
    bench = _bench()
    how = bench.ROWS[row][3]
    bench._build(how, REPO / "samples" / "tiny-llama" / "model", tmp_path / row, None)
    try:
        with read_fp8_folder(tmp_path / row) as f:
            now = list(f.loaders.ok)
    except Fp8ExportError:
        now = []
    assert now == RESULTS["rows"][row]["inspect"]["loaded_by"]
