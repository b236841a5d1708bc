"""End to end on a tiny trained Llama: pass, fail with exit 3, reports, per-layer, bad input."""

import html as html_lib
import json
import re
import xml.etree.ElementTree as ET

import pytest
from fp8_folders import DAMAGED

from fp8export.errors import EXIT_BAD_INPUT, EXIT_VERIFY_FAILED


def test_healthy_fp8_folder_passes_default(run_cli, tiny_llama, tiny_fp8, eval_npz, tmp_path):
    rd = tmp_path / "rep"
    r = run_cli("verify", tiny_llama, tiny_fp8, "--data", eval_npz, "--report-dir", rd)
    assert r.exit_code == 0, r.output
    rep = json.loads((rd / "report.json").read_text())
    for key in ("passed", "backend", "samples", "metrics", "thresholds", "failures", "per_layer"):
        assert key in rep
    assert rep["passed"] is True and rep["failures"] == [] and rep["samples"] == 16
    assert rep["backend"] == "torch-fp8"
    for key in ("cosine_mean", "cosine_min", "rel_l2", "max_abs", "top1_agreement", "kl_mean",
                "ppl_reference", "ppl_candidate"):
        assert isinstance(rep["metrics"][key], float), key
    assert rep["metrics"]["kl_mean"] < 0.005 and rep["metrics"]["top1_agreement"] > 0.95
    suite = ET.parse(rd / "junit.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) == len(rep["thresholds"]) and suite.get("failures") == "0"
    html = (rd / "report.html").read_text()
    assert html.count("<svg") == 2 and "<img" not in html  # KL histogram, logits; no layers
    assert "PASSED" in (rd / "report.md").read_text()
    # the header says what was judged
    head = rep["header"]
    assert head["command"] == (f"fp8export verify {tiny_llama} {tiny_fp8} --data {eval_npz} "
                               f"--report-dir {rd}")
    assert head["tool"]["version"] and head["created"].endswith("+00:00")
    assert head["candidate"]["converted_from_reference"] is True
    assert len(head["reference"]["sha256"]) == 64 and head["data"]["sha256"]
    assert head["data"]["samples"] == 16 and head["backend"] == "torch-fp8"
    shown = html_lib.unescape(re.sub(r"<[^>]+>", "", html))
    assert head["reference"]["sha256"][:12] in shown and head["command"] in shown
    # how certain the verdict is: an interval per gated metric, in every report and the console
    conf = rep["confidence"]
    assert conf["samples"] == 16 and conf["resamples"] == 1000 and conf["level"] == 0.95
    kl = next(c for c in rep["checks"] if c["metric"] == "kl_mean")
    assert kl["interval"][0] <= kl["value"] <= kl["interval"][1] and kl["decided"] is True
    assert conf["intervals"]["kl_mean"] == kl["interval"]
    assert f"verdict {conf['verdict']} (95% bootstrap intervals over 16 samples" in r.output
    assert "95% interval" in html and "95% interval" in (rd / "report.md").read_text()


def test_damaged_candidate_fails_with_exit_3_and_is_blamed(run_cli, tiny_llama, damaged_fp8,
                                                           eval_npz, tmp_path):
    rd = tmp_path / "rep"
    r = run_cli("verify", tiny_llama, damaged_fp8, "--data", eval_npz, "--report-dir", rd,
                "--per-layer")
    assert r.exit_code == EXIT_VERIFY_FAILED, r.output
    rep = json.loads((rd / "report.json").read_text())
    assert rep["passed"] is False
    failing = {f["metric"] for f in rep["failures"]}
    assert {"kl_mean", "top1_agreement", "cosine_min"} <= failing
    assert rep["per_layer"][0]["module"] == DAMAGED
    assert rep["per_layer"][0]["sqnr_db"] < 0 < rep["per_layer"][1]["sqnr_db"] - 15
    md = (rd / "report.md").read_text()
    assert "FAILED" in md and "`kl_mean`" in md and DAMAGED in md
    junit = ET.parse(rd / "junit.xml").getroot()
    failed_cases = [c.get("name") for c in junit.iter("testcase") if c.find("failure") is not None]
    assert any(n.startswith("kl_mean") for n in failed_cases)
    html = (rd / "report.html").read_text()
    assert html.count("<svg") == 3  # per-layer, KL histogram, logits
    # worst samples: where the largest divergence sits, and both models' predictions there
    worst = rep["worst_samples"]
    assert len(worst) == 10 and worst[0]["kl_mean"] >= worst[-1]["kl_mean"]
    assert 0 <= worst[0]["position"] < worst[0]["tokens"] and worst[0]["token"].startswith("[")
    per = {s["index"]: s for s in rep["per_sample"]}[worst[0]["index"]]
    assert per["kl_max"] == worst[0]["kl_max"] and per["kl_max_pos"] == worst[0]["position"]
    assert "Worst samples" in html and "Worst samples" in md


def test_an_existing_report_is_replaced_only_with_force(run_cli, tiny_llama, tiny_fp8, eval_npz,
                                                        tmp_path):
    rd = tmp_path / "rep"
    rd.mkdir()
    (rd / "notes.txt").write_text("mine")  # other files in the folder are never a problem
    common = ("verify", tiny_llama, tiny_fp8, "--data", eval_npz, "--samples", "4",
              "--no-noise-floor", "--report-dir", rd)
    assert run_cli(*common).exit_code == 0
    first = (rd / "report.json").read_bytes()
    again = run_cli(*common)
    assert again.exit_code == EXIT_BAD_INPUT, again.output
    assert "already holds a verify report" in again.stderr and "--force" in again.stderr
    assert "loading the reference" not in again.output  # refused before any work
    assert (rd / "report.json").read_bytes() == first
    forced = run_cli(*common, "--force")
    assert forced.exit_code == 0, forced.output
    assert json.loads((rd / "report.json").read_text())["header"]["command"].endswith("--force")
    assert (rd / "notes.txt").read_text() == "mine"


def test_library_result_is_json_serialisable(tiny_llama, tiny_fp8, tmp_path):
    from fp8export import api
    from fp8export.verify.config import VerifyConfig

    res = api.verify(VerifyConfig(reference=tiny_llama, candidate=tiny_fp8, samples=4,
                                  report_dir=tmp_path / "r", write_reports=False))
    d = res.to_dict()
    json.dumps(d)
    assert d["data"]["builtin"] is True and "No --data given" in d["notes"][0]
    assert res.passed and res.reports == {}


def test_same_model_passes_strict(run_cli, tiny_llama, eval_npz, tmp_path):
    r = run_cli("verify", tiny_llama, tiny_llama, "--data", eval_npz, "--thresholds", "strict",
                "--report-dir", tmp_path)
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "report.json").read_text())["metrics"]["kl_max"] == 0.0


# --- bad input: exit 1, never a failed comparison ---------------------------------------------

@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    from fp8_folders import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("other") / "m", vocab=128, train_steps=0)


def _bad(r, *needles):
    assert r.exit_code == EXIT_BAD_INPUT, r.output
    for n in needles:
        assert n in r.output, r.output


def test_bad_inputs(run_cli, tiny_llama, tiny_fp8, other_model, eval_npz, tmp_path):
    rd = ("--report-dir", tmp_path / "r")
    _bad(run_cli("verify", other_model, tiny_fp8, *rd), "different models", "vocab_size")
    weird = tmp_path / "model.bin2"
    weird.write_text("x")
    _bad(run_cli("verify", tiny_llama, weird, *rd), "unknown candidate kind")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _bad(run_cli("verify", tiny_llama, tiny_fp8, "--data", empty, *rd), "empty")
    engine = tmp_path / "model.engine"
    engine.write_bytes(b"\0" * 16)
    _bad(run_cli("verify", tiny_llama, engine, *rd), "TensorRT is not installed")
    bad_thr = tmp_path / "t.yaml"
    bad_thr.write_text("kl_avg: 1\n")
    _bad(run_cli("verify", tiny_llama, tiny_fp8, "--thresholds", bad_thr, *rd), "kl_mean")
    _bad(run_cli("verify", tiny_llama, tiny_fp8, "--backend", "onnxruntime", *rd),
         "--backend torch")
    _bad(run_cli("verify", tiny_fp8, tiny_llama, *rd), "reference is an FP8 folder")
    assert not (tmp_path / "r" / "report.json").exists()


def test_cuda_without_gpu_is_bad_input(run_cli, tiny_llama, tiny_fp8, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    _bad(run_cli("verify", tiny_llama, tiny_fp8, "--device", "cuda", "--report-dir", tmp_path),
         "no CUDA GPU")


@pytest.mark.gpu
def test_scaled_mm_runtime_passes_on_gpu(run_cli, tiny_llama, tiny_fp8, eval_npz, tmp_path):
    from fp8export.runtime.fp8_linear import scaled_mm_available

    if not scaled_mm_available("cuda"):
        pytest.skip("needs compute capability >= 8.9")
    r = run_cli("verify", tiny_llama, tiny_fp8, "--data", eval_npz, "--device", "cuda",
                "--fp8-mode", "scaled_mm", "--per-layer", "--report-dir", tmp_path)
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["candidate"]["mode"] == "scaled_mm" and rep["candidate"]["fallbacks"] == {}


def test_independently_written_folder_and_dynamic_activations(tiny_llama, eval_npz, tmp_path):
    """A folder written from docs/fp8-folder.md alone, and a weights-only (dynamic) convert."""
    from fp8_folders import make_fp8_folder, write_fp8_folder

    from fp8export.api import verify
    from fp8export.verify.config import VerifyConfig

    for cand in (write_fp8_folder(tiny_llama, tmp_path / "indep"),
                 make_fp8_folder(tiny_llama, tmp_path / "dyn", static=False)):
        res = verify(VerifyConfig(reference=tiny_llama, candidate=cand, data=eval_npz,
                                  write_reports=False))
        assert res.passed, (cand, res.failures)
    import json as _json

    assert _json.loads((tmp_path / "dyn" / "fp8export.json").read_text())[
        "activation_scheme"] == "dynamic"
