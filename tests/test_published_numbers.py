"""The numbers README.md and docs/ publish are the numbers the committed results hold.

Each benchmark or measurement script writes JSON (``bench/results/*.json``,
``samples/keras-hub-float8/tutorial_table.json``); the tables and figures in the docs are
copied from it. These tests re-derive every such table cell and figure from the JSON, with the
docs' own rounding, so a re-run that changes a result, or an edit of the docs alone, fails
here until both agree. Numbers from tests (not scripts) are pinned by those tests.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
README = (REPO / "README.md").read_text(encoding="utf-8")
VERIFY_MD = (REPO / "docs" / "verify.md").read_text(encoding="utf-8")


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _table(text: str, header: str) -> list[list[str]]:
    """Rows (cells, stripped) of the Markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]])
    assert rows, f"no rows under {header!r}"
    return rows


def _e(x: float, digits: int = 2) -> str:
    """``1.08e-5`` style: the docs drop the exponent's leading zero."""
    return re.sub(r"e([+-])0(\d)", r"e\1\2", f"{x:.{digits}e}")


def test_tutorial_table_is_the_committed_results():
    """README's Keras tutorial table, between its markers, is what tutorial_table.py renders
    from tutorial_table.json (the onnxruntime version aside: it names the installed one)."""
    path = REPO / "samples" / "keras-hub-float8" / "tutorial_table.py"
    spec = importlib.util.spec_from_file_location("tutorial_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = json.loads((path.parent / "tutorial_table.json").read_text())
    start = README.index(module.BEGIN)
    published = README[start:README.index(module.END) + len(module.END)]
    version = re.search(r"onnxruntime (\d+\.\d+\.\d+) CPU", published).group(1)
    import onnxruntime

    installed = onnxruntime.__version__
    try:
        onnxruntime.__version__ = version
        rendered = module.render(results)
    finally:
        onnxruntime.__version__ = installed
    assert published == rendered


def test_calibrator_table_is_calibrators_json():
    results = _json("calibrators.json")["results"]
    keys = {"none (bf16)": "reference", "FP8 weights only": "weights-only",
            "`max` (default)": "max", "`percentile` (99.99)": "percentile", "`mse`": "mse",
            "`entropy`": "entropy"}
    rows = _table(README, "| calibrator | KL(bf16‖FP8) per token |")
    assert [r[0] for r in rows] == list(keys)
    for label, kl, top1, ppl in rows:
        r = results[keys[label]]
        want_kl = "0" if r["kl_mean"] == 0 else _e(r["kl_mean"])
        want_top1 = "1" if r["top1_agreement"] == 1 else f"{r['top1_agreement']:.4f}"
        assert (kl, top1, ppl) == (want_kl, want_top1, f"{r['ppl']:.3f}"), label


METHODS = {"–": ("nearest", None), "GPTQ rounding": ("gptq", None),
           "smoothing": ("nearest", "smooth"), "scale search": ("nearest", "scale-search")}


def _recipe(rows: list[dict], weights, activations, calibrator, method) -> dict | None:
    rounding, extra = METHODS[method]
    for r in rows:
        if (r["weights"], r["activations"], r["calibrator"] or "–", r.get("kv_cache", "none"),
                r.get("rounding", "nearest"), r.get("method")) \
                == (weights, activations, calibrator, "none", rounding, extra):
            return r
    return None


def test_recipe_table_is_recipes_json():
    models = {m["model"]: m for m in _json("recipes.json")["models"]}
    rows = _table(README, "| weights | activations | calibrator | method |")
    assert len(rows) >= 6
    *recipes, floor = rows
    for weights, act, calib, method, sample, smol in recipes:
        activations = {"static": "static", "dynamic-tensor": "dynamic-tensor",
                       "dynamic-token": "dynamic-token",
                       "dynamic per token group (128)": "dynamic-group"}[act]
        weights = weights.split()[0]  # "block 128x128": the block size is the recipe's default
        s = _recipe(models["sample"]["rows"], weights, activations, calib, method)
        assert sample == ("–" if s is None else
                          f"{s['top1_agreement']:.4f} / {s['kl_mean']:.2e}"), (weights, act)
        m = _recipe(models["smollm2"]["rows"], weights, activations, calib, method)
        assert m is not None, (weights, act, method)
        verdict = "pass" if m["passed_default"] else "fail"
        assert smol == f"{m['top1_agreement']:.4f} / {m['kl_mean']:.2e} / {verdict}"
    assert floor[0].startswith("noise floor")
    for cell, model in zip(floor[-2:], ("sample", "smollm2"), strict=True):
        f = next(r["noise_floor"] for r in models[model]["rows"] if r.get("noise_floor"))
        assert cell == f"{f['top1_agreement']:.4f} / {f['kl_mean']:.2e}", model


def test_budget_table_is_budget_json():
    """README's accuracy-budget table is bench/budget.py's rendering of budget.json, row for
    row, and each model's kept share grows as its budget tightens."""
    doc = _json("budget.json")
    rendered = _bench("budget").render(doc).splitlines()
    header = "| model | budget (x all-FP8) | outcome |"
    start = next(i for i, ln in enumerate(rendered) if ln.startswith(header))
    want = [ln for ln in rendered[start + 2:] if ln.startswith("|")]
    lines = README.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    got = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        got.append(ln)
    assert got == want
    for m in doc["models"]:
        kept = [r.get("kept_param_fraction", 1.0) for r in m["runs"]]
        assert m["monotone"] and kept == sorted(kept), m["model"]


def test_h100_accuracy_row_is_the_gpu_report():
    """README's accuracy table row for real FP8 GEMMs on an H100 is
    bench/results/verify_gpu_sample/report.json."""
    rep = json.loads((RESULTS / "verify_gpu_sample" / "report.json").read_text())
    m = rep["metrics"]
    row = next(r for r in _table(README, "| model | runtime | perplexity |")
               if "H100" in r[1])
    assert row[2:] == [f"{m['ppl_candidate']:.4f}", _e(m["kl_mean"], 1),
                       f"{m['top1_agreement']:.3f}", "pass" if rep["passed"] else "fail"]
    assert rep["candidate"]["device"] == "cuda" and rep["candidate"]["mode"] == "scaled_mm"


def test_sample_rows_are_what_the_demo_prints():
    """README's CPU rows of the sample (the reference, the FP8 folder in torch emulation, its
    fp16 ONNX graph) are the reports of scripts/demo.sh's two verify runs
    (bench/results/demo/, written by bench/demo_accuracy.py), which the demo also prints."""
    rows = _table(README, "| model | runtime | perplexity |")
    demo = _json("demo/demo.json")
    for name, label, runtime in (("report-torch-fp8", "FP8, static input scales",
                                  "torch FP8 emulation, CPU"),
                                 ("report-onnx", "FP8 ONNX (fp16 graph)", "onnxruntime")):
        rep = _json(f"demo/{name}.json")
        m = rep["metrics"]
        row = next(r for r in rows if r[0] == label and r[1].startswith(runtime))
        assert row[2:] == [f"{m['ppl_candidate']:.4f}", _e(m["kl_mean"], 1),
                           f"{m['top1_agreement']:.3f}", "pass" if rep["passed"] else "fail"]
        reference = next(r for r in rows if r[0] == "bf16 (reference)")
        assert reference[2] == f"{m['ppl_reference']:.4f}"
        assert rep["header"]["data"]["samples"] == 256  # all of eval.txt, as the table says
        printed = next(ln for ln in demo["printed"] if ln.startswith("PASSED:")
                       and f"kl_mean={m['kl_mean']:.4g}" in ln)
        assert f"top1_agreement={m['top1_agreement']:.4g}" in printed
    onnx = _json("demo/report-onnx.json")
    assert onnx["candidate"]["kind"] == "onnx"
    # the graph the demo verified is the fp16 one the table names
    exported = [ln for ln in demo["printed"] if " export-onnx " in ln]
    assert exported and all("--dtype fp16" in ln for ln in exported), exported


def test_onnx_size_ratios_are_onnx_export_json():
    ratios = {r["dtype"]: r["size_ratio"] for r in _json("onnx_export.json")["rows"]}
    assert f"FP8/plain file size {ratios['fp16']:.2f} (fp16), {ratios['fp32']:.2f} (fp32)" \
        in README
    assert f"the fp16 FP8 graph is {ratios['fp16']:.2f}× the plain fp16 export" \
        in " ".join(README.split())  # as read, whatever the line breaks


def test_fault_injection_table_is_fault_injection_json():
    """docs/verify.md's fault-injection table (which set the thresholds) is what
    bench/fault_injection.py renders from its committed results."""
    module = _bench("fault_injection")
    start = VERIFY_MD.index(module.BEGIN)
    assert VERIFY_MD[start:VERIFY_MD.index(module.END) + len(module.END)] == \
        module.render(_json("fault_injection.json"))
    healthy = _json("fault_injection.json")["healthy"]
    assert healthy["default"]["passed"] and healthy["strict"]["passed"]


@pytest.mark.parametrize("doc", ["README.md", "docs/verify.md"])
def test_published_results_files_exist(doc):
    """Every ``bench/results/...`` a doc names is committed."""
    text = (REPO / doc).read_text(encoding="utf-8")
    named = {n.rstrip("/.") for n in re.findall(r"bench/results/([\w./-]*)", text)} - {""}
    assert named
    missing = [n for n in named if not (RESULTS / n).exists()]
    assert not missing, missing


def _bench(name: str):
    """A bench/ script as a module (they import their helpers from beside themselves)."""
    import sys

    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_fp8_report_is_rendered_from_the_h100_json(tmp_path):
    merged: dict = {}
    for part in ("prefill", "eager", "decode"):
        merged.update(_json(f"gpu_fp8_h100_{part}.json"))
    md = tmp_path / "gpu_fp8.md"
    _bench("gpu_fp8_report").write_report(merged, md, RESULTS / "gpu_fp8_notes.md")
    assert md.read_text() == (RESULTS / "gpu_fp8.md").read_text()


def test_gpu_fp8_attention_report_is_rendered_from_the_h200_json(tmp_path):
    """Tables from the two H200 runs' JSON (bench/gpu_fp8_report.py), the notes after them."""
    report = _bench("gpu_fp8_report")
    md = tmp_path / "gpu_fp8_attention_h200.md"
    report.main([str(RESULTS / "gpu_fp8_h200_attention_run1.json"),
                 str(RESULTS / "gpu_fp8_h200_attention_run2.json"), "--targets", "--md",
                 str(md), "--notes", str(RESULTS / "gpu_fp8_attention_h200_notes.md")])
    assert md.read_text() == (RESULTS / "gpu_fp8_attention_h200.md").read_text()


def test_multi_gpu_report_is_rendered_from_its_json():
    """The tables are the JSON's; hand-written notes about the run follow them."""
    assert (RESULTS / "multi_gpu.md").read_text().startswith(
        _bench("multi_gpu").render(_json("multi_gpu.json")) + "\n")


def test_recipes_report_is_rendered_from_its_json():
    assert _bench("recipes").markdown(_json("recipes.json")) == \
        (RESULTS / "recipes.md").read_text()


def _section(start: str, end: str) -> str:
    i = README.index(start)
    return " ".join(README[i:README.index(end, i)].split())


def _figures(text: str) -> list[str]:
    """Numbers as written (``6,363``, ``1.19``, ``7.5k``)."""
    return re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?k?", text)


def _value(fig: str) -> float:
    return float(fig.replace(",", "").rstrip("k")) * (1000 if fig.endswith("k") else 1)


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    return []


@pytest.mark.parametrize(("start", "end", "sources", "not_results"), [
    ("- **FP8 GPU runtime vs bf16**", "- **CPU threads**",
     ["gpu_fp8.md", "gpu_fp8_attention_h200.md",
      "gpu_attention_h200_2026-11-29/gpu_fp8_attention.md",
      "gpu_attention_h200_2026-11-29b/gpu_fp8_attention.md",
      "gpu_attention_h200_2026-11-29b/notes.md"], ["2026"]),  # the run's date
    ("- **CPU threads**", "- **Calibration overhead**", ["threads.md"], ["2", "6", "8", "64"]),
    ("- **Calibration overhead**", "- **verify's fixed cost**",
     ["calibrate_cuda.json", "calibrate_cpu.json"], ["1.1", "15", "1.15"]),  # size, targets
    ("- **verify's fixed cost**", "- **16-bit linears on CPUs", ["verify_load.md"], []),
    ("- **16-bit linears on CPUs", "- **Multi-GPU calibrate / verify**", ["cpu_gemm.md"],
     ["16", "2", "128", "32"]),  # the unit width, rounds, samples
    ("- **Multi-GPU calibrate / verify**", "- **Layer streaming**", ["multi_gpu.md"], []),
    ("- **Layer streaming**", "- **Transformer Engine reader**",
     ["streaming_h200.md", "streaming_h200.json"],
     ["2", "84", "3.2", "3", "1.15", "0.8"]),  # the GPU count, model shape, targets
    ("- **Transformer Engine reader**", "- **export-onnx**", ["te_reader.md"], []),
    ("**Against llm-compressor, and why not further**", "**Encoders** (`bench/minilm.py`",
     ["margin-smollm2-block.md", "margin_explore-smollm2.md"],
     ["135", "32", "20", "1"]),  # the model size, eval lines, target, threads
    ("**Encoders** (`bench/minilm.py`", "**Accuracy budget** (`bench/budget.py`",
     ["minilm.json"], ["48", "128", "0.999", "256"]),  # the data sizes, target, block size
    ("- **convert** (`bench/convert.py`", "## Reliability",
     ["convert.md", "convert_large.md", "convert_loaded.md", "convert_vs_main.md",
      "convert_vs_main_loaded.md"],
     []),
])
def test_benchmark_figures_in_the_readme_are_in_the_results(start, end, sources, not_results):
    """Every figure of the README's summary of a benchmark is one of its results' numbers, as
    rounded there (the reports rendered from JSON are checked above); ``not_results`` are the
    setup and target figures the summary quotes."""
    have = []
    for name in sources:
        text = (RESULTS / name).read_text()
        have += _numbers(json.loads(text)) if name.endswith(".json") else \
            [_value(x) for x in _figures(text)]
    missing = []
    for fig in _figures(_section(start, end)):
        digits = len(fig.rstrip("k").split(".")[1]) if "." in fig else 0
        digits -= 3 if fig.endswith("k") else 0
        if fig not in not_results and not any(round(y, digits) == _value(fig) for y in have):
            missing.append(fig)
    assert not missing, f"README figures not in bench/results/{sources}: {missing}"


def test_convert_figures_are_convert_json():
    size = _json("convert.json")["sizes"][0]
    best, targets = size["best"], size["targets"]
    w1, w2 = targets["workers_1"], targets["workers_2"]
    mib = 1024**2
    text = _section("- **convert** (`bench/convert.py`", "## Reliability")
    for phrase in [
        f"cp + fsync {best['cp']['total_seconds']:.2f} s",
        f"convert **{best['convert_w1']['total_seconds']:.2f} s** with 1 worker, "
        f"**{best['convert_w2']['total_seconds']:.2f} s** with 2",
        f"({w1['convert_over_cp']:.1f}× / {w2['convert_over_cp']:.1f}× cp",
        f"llm-compressor {best['llmcompressor']['total_seconds']:.2f} s "
        f"({w1['llmc_over_convert']:.1f}× / {w2['llmc_over_convert']:.1f}× convert",
        f"2 workers {w2['speedup_over_1_worker']:.2f}× of 1",
        f"Peak RSS **{w1['peak_rss_bytes'] / mib:.0f} MiB** (1 worker) / "
        f"**{w2['peak_rss_bytes'] / mib:.0f} MiB** (2)",
        f"limits of {w1['rss_limit_bytes'] / mib:.0f} MiB / {w2['rss_limit_bytes'] / 1024**3:.2f} "
        "GiB",
        f"llm-compressor {best['llmcompressor']['peak_rss_bytes'] / 1024**3:.2f} GiB",
    ]:
        assert phrase in text, phrase


def test_calibration_overhead_figures_are_calibrate_json():
    cuda = _json("calibrate_cuda.json")["methods"]
    cpu = _json("calibrate_cpu.json")["methods"]
    text = " ".join(_section("- **Calibration overhead**", "- **verify's fixed cost**").split())
    assert f"`max` +{cuda['max']['overhead_pct']:.1f} % over a plain bf16 forward" in text
    assert f"`percentile`/`mse`/`entropy` +{cuda['percentile']['overhead_pct']:.0f} %" in text
    assert f"`max` +{cpu['max']['overhead_pct']:.1f} %, `percentile` " \
        f"+{cpu['percentile']['overhead_pct']:.1f} %" in text
    assert max(m["total_overhead_pct"] for m in cpu.values()
               if "total_overhead_pct" in m) <= 15, "the README says the 1.15x target is met"


def test_te_reader_figures_are_te_reader_json():
    rows = _json("te_reader.json")["results"]
    text = _section("- **Transformer Engine reader**", "- **export-onnx**")
    assert {f"{r['ratio']:.1f}" for r in rows} == {"1.2"} and "stays 1.2× `torch.load`" in text
    at_30k = next(r for r in rows if r["tensors"] == 30000)
    assert f"{at_30k['reader_s']:.0f} s now" in text


def _signed(x: float) -> str:
    return ("+" if x >= 0 else "") + _e(x, 1)


def test_sequential_gptq_figures_are_gptq_sequential_json():
    """The reports are rendered from bench/gptq_sequential.py's JSON, and README's and
    docs/architecture.md's sentences on gptq-sequential quote it as rounded there, with the
    verdict its paired interval gives (better only when the interval lies below zero)."""
    module = _bench("gptq_sequential")
    docs = {name: _json(f"{name}.json") for name in ("gptq_sequential", "gptq_sequential-eval256")}
    for name, doc in docs.items():
        assert (RESULTS / f"{name}.md").read_text().startswith(module.render(doc) + "\n"), name
    wide = docs["gptq_sequential-eval256"]
    assert wide["eval"]["samples"] == 256 and wide["calib"]["samples"] == 128
    runs = wide["settings"]["dynamic"]["runs"]
    seq, par = runs["gptq-sequential"], runs["gptq"]
    d = wide["settings"]["dynamic"]["sequential_minus_parallel"]
    static = docs["gptq_sequential"]["settings"]["static"]["sequential_minus_parallel"]

    def kl(r):
        return f"{r['kl_mean']:.4f} [{r['interval'][0]:.4f}, {r['interval'][1]:.4f}]"

    def interval(x):
        return f"[{_signed(x['interval'][0])}, {_signed(x['interval'][1])}]"

    common = [f"KL {kl(seq)} against {kl(par)}", interval(d), "did not measurably beat `gptq`"]
    readme = " ".join(README.split())
    start = readme.index("- `--weight-rounding gptq-sequential`")
    sentence = readme[start:readme.index("- `--kv-cache fp8`", start)]
    for phrase in common + [
            f"paired difference of {_e(d['kl_difference'], 1)} per token "
            f"({100 * d['relative']:.1f}%)",
            f"convert {seq['convert_s']:.0f} s against {par['convert_s']:.0f} s",
            f"64 lines: {100 * static['relative']:.1f}%, its interval {interval(static)}"]:
        assert phrase in sentence, phrase
    arch = " ".join((REPO / "docs" / "architecture.md").read_text(encoding="utf-8").split())
    for phrase in common + [f"paired difference {_e(d['kl_difference'], 1)} per token"]:
        assert phrase in arch, phrase
    # "did not measurably beat" is what an interval holding zero says
    assert d["interval"][0] < 0 <= d["interval"][1] and static["interval"][0] < 0 <= \
        static["interval"][1]
