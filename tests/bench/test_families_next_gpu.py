"""bench/families_next_gpu.py: the table of the GPU family run, from its JUnit XML (a pytest
run with record_property in JUnit's xunit1 form, made here on the CPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_families_next_gpu",
                                                  REPO / "bench" / "families_next_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_from_a_pytest_junit(tmp_path):
    (tmp_path / "test_fake.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('family', ['jamba', 'whisper'])\n"
        "def test_fp8_runtime_on_the_gpu(family, record_property):\n"
        "    for k, v in (('device', 'H200'), ('inputs', '2x96 tokens'), ('kl_mean', 1.5e-5),\n"
        "                 ('top1', 0.97), ('rel_l2_vs_emulation', 3e-3), ('quantized', 21),\n"
        "                 ('layer_rel_l2_max', 1e-3), ('rel_l2_emulated_vs_bf16', 2e-2),\n"
        "                 ('layer_over_budget_max', 0.12),\n"
        "                 ('on_fp8_path', 21), ('status', 'pass')):\n"
        "        record_property(k, v)\n"
        "    assert family == 'jamba', f'{family}: rel-L2 against the emulation 0.3 > 0.02'\n"
        "def test_skipped():\n"
        "    import pytest; pytest.skip('needs a CUDA GPU')\n")
    xml = tmp_path / "j.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                    "junit_family=xunit1", str(tmp_path / "test_fake.py"), "--junitxml",
                    str(xml)], cwd=tmp_path, capture_output=True, check=False)
    bench = _bench()
    assert bench.read_junit(xml) == []  # only the GPU family test's cases by default
    rows = {r["family"]: r for r in bench.read_junit(xml, module="test_fake")}
    assert rows["jamba"]["outcome"] == "passed" and rows["whisper"]["outcome"] == "failed"
    assert rows["test_skipped"]["outcome"] == "skipped"
    text = bench.table(list(rows.values()), "j.xml")
    assert "| jamba | pass | 2x96 tokens | 21 / 21 | 1.50e-05 | – | 0.970 | 1.00e-03 / 0.12 | " \
           "3.00e-03 / 2.00e-02 |" in text
    assert "| whisper | FAIL: AssertionError: whisper: rel-L2 against the emulation 0.3 > " \
           "0.02 |" in text
    assert "| test_skipped | skipped: needs a CUDA GPU |" in text
    assert "Device: H200." in text


def test_the_committed_table_is_rendered_from_its_junit(tmp_path):
    """bench/results/families_next_gpu.md is what the script renders from the committed H200
    JUnit file and notes (so its numbers are the run's)."""
    results = REPO / "bench" / "results"
    md = tmp_path / "families_next_gpu.md"
    _bench().main([str(results / "families_next_gpu_h200" / "junit.xml"), "--md", str(md),
                   "--source", "families_next_gpu_h200/junit.xml", "--notes",
                   str(results / "families_next_gpu_h200" / "notes.md")])
    assert md.read_text() == (results / "families_next_gpu.md").read_text()
    assert md.with_suffix(".json").read_text() == (results / "families_next_gpu.json").read_text()
