#!/usr/bin/env python
"""The FP8-folder matrix: folders made by every maker fp8export meets, through every command
that reads them and through transformers.

    python bench/fp8_matrix.py                       # every row (~40 min on 2 busy cores)
    python bench/fp8_matrix.py --rows ours-ct-tensor,hand-deepseek   # a few rows
    python bench/fp8_matrix.py --render              # rewrite the .md and the docs table

Makers: ``fp8export convert`` in each dialect and granularity; llm-compressor 0.14 (``oneshot``
FP8 / FP8_DYNAMIC / FP8_BLOCK, ``model_free_ptq`` FP8_DYNAMIC / FP8_BLOCK; in its own venv,
``--peer-venv``, default ``$FP8EXPORT_PEER_VENV`` or ``.venv-peers``); transformers' own
fine-grained quantize op (``Fp8Quantize``, F32 and UE8M0 scales); and folders written by hand
from each format's documented key names (``tests/fp8dir/foreign_folders.py``: DeepSeek-V3
fine-grained, AutoFP8, ModelOpt's HF export, and a fine-grained folder whose
``weight_scale_inv`` tensors were renamed ``weight_scale``). Dense rows use a tiny Llama over
the sample tokenizer (hidden 64, MLP 128, 2 layers; trained for 80 steps on a Markov chain so
its predictions are peaked): 128x128 blocks are partial on it, 8x8 blocks whole. MoE rows use
tiny random Mixtral / Qwen3-MoE models (``tests/families``).

Per folder, in this process through ``fp8export.api`` (what the commands call): ``inspect``
(the loader label), ``verify`` against the bf16 model (8 evaluation lines, no noise floor:
exit code, KL, top-1, or its ``Error:`` line) and ``export-onnx`` (fp32; exit code); then
transformers 5's default ``from_pretrained`` on CPU, every folder in one process of its own
(KL of its logits against the bf16 model's on the same 8 lines, or the exception). Writes
``bench/results/fp8_matrix.json`` and ``.md``; the table in docs/fp8-folder.md is rendered from
the JSON (``tests/bench/test_fp8_matrix.py`` pins it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests", REPO / "tests" / "families", REPO / "tests" / "fp8dir"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench._common import fp8export_argv, machine_info, md_table, write_json  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"
RESULTS = REPO / "bench" / "results"
DOC = REPO / "docs" / "fp8-folder.md"
BEGIN, END = "<!-- fp8_matrix begin -->", "<!-- fp8_matrix end -->"
CALIB = SAMPLE / "data" / "calib.txt"
EVAL = SAMPLE / "data" / "eval.txt"
SAMPLES = 8

# id: (maker, format, model, how)
ROWS: dict[str, tuple[str, str, str, tuple]] = {
    "ours-ct-tensor": ("fp8export convert", "compressed-tensors, tensor, static", "tiny",
                       ("ours", "--scales", "calibrate", "--calib-data", CALIB)),
    "ours-ct-channel": ("fp8export convert", "compressed-tensors, channel, dynamic", "tiny",
                        ("ours", "--weight-granularity", "channel")),
    "ours-ct-block": ("fp8export convert", "compressed-tensors, block 128, dynamic", "tiny",
                      ("ours", "--weight-granularity", "block")),
    "ours-vllm-tensor": ("fp8export convert", "vllm (quant_method fp8), tensor, static",
                         "tiny", ("ours", "--format", "vllm", "--scales", "calibrate",
                                    "--calib-data", CALIB)),
    "ours-vllm-block-8": ("fp8export convert", "vllm fine-grained, block 8x8", "tiny",
                          ("ours", "--format", "vllm", "--weight-granularity", "block",
                           "--block-size", "8x8")),
    "ours-vllm-ue8m0": ("fp8export convert", "vllm fine-grained, block 8x8, UE8M0 scales",
                        "tiny", ("ours", "--format", "vllm", "--weight-granularity", "block",
                                   "--block-size", "8x8", "--scale-format", "ue8m0")),
    "ours-modelopt": ("fp8export convert", "modelopt, tensor, static", "tiny",
                      ("ours", "--format", "modelopt", "--scales", "calibrate", "--calib-data",
                       CALIB)),
    "ours-mixtral": ("fp8export convert", "compressed-tensors, tensor, static (Mixtral)",
                     "mixtral", ("ours", "--scales", "calibrate", "--calib-data", CALIB)),
    "ours-qwen3-moe": ("fp8export convert", "compressed-tensors, tensor, static (Qwen3-MoE)",
                       "qwen3-moe", ("ours", "--scales", "calibrate", "--calib-data", CALIB)),
    "lc-fp8": ("llm-compressor oneshot", "FP8 (tensor, static)", "tiny",
               ("peer", "peers/llmcompressor_run.py", "FP8", "{model}", "{out}", CALIB, "16")),
    "lc-fp8-dynamic": ("llm-compressor oneshot", "FP8_DYNAMIC (channel, token)", "tiny",
                       ("peer", "peers/llmcompressor_run.py", "FP8_DYNAMIC", "{model}",
                        "{out}")),
    "lc-fp8-block": ("llm-compressor oneshot", "FP8_BLOCK (block 128, group)", "tiny",
                     ("peer", "peers/llmcompressor_run.py", "FP8_BLOCK", "{model}", "{out}")),
    "lc-mixtral": ("llm-compressor oneshot", "FP8 (tensor, static; Mixtral)", "mixtral",
                   ("peer", "families/llmcompressor_fp8.py", "{model}", CALIB, "{out}", "16")),
    "mfp-fp8-dynamic": ("llm-compressor model_free_ptq", "FP8_DYNAMIC, ignore lm_head",
                        "tiny", ("peer", "peers/llmcompressor_model_free.py", "FP8_DYNAMIC",
                                   "{model}", "{out}", "lm_head")),
    "mfp-fp8-dynamic-noemb": ("llm-compressor model_free_ptq",
                              "FP8_DYNAMIC, ignore lm_head and embed_tokens", "tiny",
                              ("peer", "peers/llmcompressor_model_free.py", "FP8_DYNAMIC",
                               "{model}", "{out}", "lm_head,model.embed_tokens")),
    "mfp-fp8-block": ("llm-compressor model_free_ptq", "FP8_BLOCK, ignore lm_head", "tiny",
                      ("peer", "peers/llmcompressor_model_free.py", "FP8_BLOCK", "{model}",
                       "{out}", "lm_head")),
    "tf-block-ue8m0": ("transformers Fp8Quantize", "fine-grained 8x8, UE8M0 scales", "tiny",
                       ("hand", "transformers_fp8_folder", {"block": (8, 8),
                                                           "scale_fmt": "ue8m0"})),
    "hand-deepseek": ("by hand (key names)", "fine-grained 8x8 (DeepSeek-V3)", "tiny",
                      ("hand", "deepseek_folder", {"block": (8, 8)})),
    "hand-renamed": ("by hand (key names)", "fine-grained 8x8, weight_scale_inv named "
                                            "weight_scale", "tiny",
                     ("hand", "renamed_folder", {"block": (8, 8)})),
    "hand-autofp8": ("by hand (key names)", "AutoFP8 (quant_method fp8, static)", "tiny",
                     ("hand", "autofp8_folder", {})),
    "hand-modelopt": ("by hand (key names)", "ModelOpt HF export (hf_quant_config.json)",
                      "tiny", ("hand", "modelopt_folder", {})),
}

_TRANSFORMERS_KL = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
pairs, data, n = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
lines = [s for s in open(data, encoding="utf-8").read().splitlines() if s.strip()][:n]
results = []
for ref, cand in pairs:
    try:
        tok = AutoTokenizer.from_pretrained(ref)
        a = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
        b = AutoModelForCausalLM.from_pretrained(cand).eval()
        kl, agree, count = 0.0, 0, 0
        with torch.no_grad():
            for line in lines:
                ids = tok(line, return_tensors="pt").input_ids[:, :64]
                p = torch.log_softmax(a(ids).logits.float(), -1)
                q = torch.log_softmax(b(ids).logits.float(), -1)
                kl += float((p.exp() * (p - q)).sum(-1).sum())
                agree += int((p.argmax(-1) == q.argmax(-1)).sum())
                count += ids.shape[1]
        results.append({"ok": True, "kl": kl / count, "top1": agree / count})
    except Exception as exc:
        msg = (str(exc).splitlines() or [""])[0][:160]
        results.append({"ok": False, "error": f"{type(exc).__name__}: {msg}"})
print(json.dumps(results))
"""


def _peer_python(venv: Path) -> Path | None:
    py = venv / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", "import llmcompressor"],
                                        capture_output=True).returncode == 0
    return py if ok else None


def _dense_model(path: Path) -> Path:
    """A tiny Llama (hidden 64, MLP 128, 2 layers) over the sample tokenizer's vocabulary,
    trained briefly on a Markov chain so its next-token distributions are peaked (on a random
    model's flat logits a misread folder and a right one look alike)."""
    import torch
    from fp8_folders import markov_tokens
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1962, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(80):
        ids = markov_tokens(1962, 16, 32, seed=step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.to(torch.bfloat16).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(SAMPLE / "model" / name, path / name)
    return path


def _models(work: Path) -> dict[str, Path]:
    from model_families import save_family

    return {"tiny": _dense_model(work / "tiny"),
            "mixtral": save_family("mixtral", work / "mixtral"),
            "qwen3-moe": save_family("qwen3-moe", work / "qwen3-moe")}


def renamed_folder(src: Path, out: Path, block=(8, 8)) -> Path:
    from foreign_folders import deepseek_folder, edit

    return edit(deepseek_folder(src, out, block=block), lambda t: t.update(
        {k.removesuffix("_inv"): t.pop(k) for k in list(t) if k.endswith("_inv")}))


def _build(how: tuple, model: Path, out: Path, peer: Path | None) -> str | None:
    """Make the folder; None, or why it could not be made."""
    kind = how[0]
    if kind == "ours":
        run = subprocess.run([*fp8export_argv(), "convert", str(model), "-o", str(out),
                              *map(str, how[1:])], capture_output=True, text=True)
        return None if run.returncode == 0 else _error_line(run)
    if kind == "peer":
        if peer is None:
            return "llm-compressor peer venv missing"
        args = [str(a).format(model=model, out=out) for a in how[2:]]
        run = subprocess.run([str(peer), str(REPO / "tests" / how[1]), *args],
                             capture_output=True, text=True, timeout=1200)
        if run.returncode != 0:
            last = [ln for ln in run.stderr.splitlines() if ln.strip()][-1:]
            return f"the maker failed: {last[0][:160] if last else run.returncode}"
        return None
    import foreign_folders

    builder = renamed_folder if how[1] == "renamed_folder" else getattr(foreign_folders, how[1])
    builder(model, out, **how[2])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model / name).exists():
            shutil.copy(model / name, out / name)
    return None


def _error_line(run: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("Error:")]
    return (lines[0] if lines else (run.stderr.strip().splitlines() or ["?"])[-1])[:400]


def _exit(exc: BaseException) -> int:
    from fp8export.errors import UsageError, VerificationFailed

    return 3 if isinstance(exc, VerificationFailed) else 2 if isinstance(exc, UsageError) else 1


def _inspect(folder: Path) -> dict:
    from fp8export.api import inspect
    from fp8export.errors import Fp8ExportError

    try:
        s = inspect(folder).summary
    except Fp8ExportError as exc:
        return {"exit": _exit(exc), "error": f"Error: {exc}"[:400]}
    return {"exit": 0, "loaded_by": s.get("loaded_by"),
            "not_loaded_by": s.get("not_loaded_by") or {}}


def _verify(model: Path, folder: Path, work: Path) -> dict:
    from fp8export.api import verify
    from fp8export.errors import Fp8ExportError, VerificationFailed
    from fp8export.verify.config import VerifyConfig

    cfg = VerifyConfig(reference=model, candidate=folder, data=EVAL, samples=SAMPLES,
                       noise_floor=False, report_dir=work / "report")
    try:
        result = verify(cfg)
        code = 0
    except VerificationFailed as exc:
        result, code = exc.result, 3
    except Fp8ExportError as exc:
        return {"exit": _exit(exc), "error": f"Error: {exc}"[:400]}
    m = result.metrics
    return {"exit": code, "kl": m.get("kl_mean"), "top1": m.get("top1_agreement")}


def _export(folder: Path, work: Path) -> dict:
    from fp8export.api import export_onnx
    from fp8export.errors import Fp8ExportError
    from fp8export.onnx.export import ExportOnnxConfig

    t0 = time.perf_counter()
    out = {}
    try:
        export_onnx(ExportOnnxConfig(fp8_dir=folder, output=work / "m.onnx", dtype="fp32"))
        out["exit"] = 0
    except Fp8ExportError as exc:
        out.update(exit=_exit(exc), error=f"Error: {exc}"[:400])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    for p in work.glob("m.onnx*"):
        p.unlink()
    return out


def _transformers(pairs: list[tuple[Path, Path]]) -> list[dict]:
    """transformers' default from_pretrained of each (reference, folder), one process for all
    (its import costs more than these models)."""
    run = subprocess.run([sys.executable, "-c", _TRANSFORMERS_KL, json.dumps(
        [[str(a), str(b)] for a, b in pairs]), str(EVAL), str(SAMPLES)],
        capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_row(row: str, models: dict[str, Path], work: Path, peer: Path | None) -> dict:
    """Make one row's folder and run fp8export's commands on it; the folder stays for the
    transformers pass (``result["folder"]``)."""
    maker, fmt, model_name, how = ROWS[row]
    model = models[model_name]
    out = work / row
    shutil.rmtree(out, ignore_errors=True)
    result = {"maker": maker, "format": fmt, "model": model_name}
    t0 = time.perf_counter()
    why = _build(how, model, out, peer)
    result["make_seconds"] = round(time.perf_counter() - t0, 1)
    if why is not None:
        result["made"] = why
        return result
    result["made"] = "ok"
    scratch = work / f"{row}-scratch"
    scratch.mkdir(exist_ok=True)
    seconds = {}
    for key, step in (("inspect", lambda: _inspect(out)),
                      ("verify", lambda: _verify(model, out, scratch)),
                      ("export_onnx", lambda: _export(out, scratch))):
        t1 = time.perf_counter()
        result[key] = step()
        seconds[key] = round(time.perf_counter() - t1, 1)
    result["seconds"] = seconds
    shutil.rmtree(scratch, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------- rendering
def _e(x: float) -> str:
    return f"{x:.1e}".replace("e-0", "e-")


def cells(r: dict) -> tuple[str, ...]:
    """One table row of a result (the docs' and the .md's)."""
    head = (r["maker"], r["format"])
    if r["made"] != "ok":
        return (*head, "not made: " + r["made"], "—", "—", "—")
    ins = r["inspect"]
    if ins["exit"]:
        label = f"exit {ins['exit']}"
    elif ins["loaded_by"]:
        label = "loads in " + ", ".join(n.split(" (")[0] if "drops" not in n else
                                        n.split(" (")[0] + " (drops expert input scales)"
                                        for n in ins["loaded_by"])
    else:
        label = "no engine loads it as written"
    v = r["verify"]
    if v["exit"] in (0, 3):
        verify = f"{'PASS' if v['exit'] == 0 else 'FAIL'} (KL {_e(v['kl'])}, top-1 {v['top1']:.3f})"
    else:
        verify = f"exit {v['exit']}: {_short(v.get('error', ''))}"
    x = r["export_onnx"]
    export = "ok" if x["exit"] == 0 else f"exit {x['exit']}"
    t = r["transformers"]
    tf = f"KL {_e(t['kl'])}, top-1 {t['top1']:.3f}" if t.get("ok") else \
        f"fails ({t['error'].split(':')[0]})"
    return (*head, label, verify, export, tf)


def _short(error: str) -> str:
    """The reason an ``Error:`` line gives, cut to its point (the docs table's width)."""
    text = error.removeprefix("Error: ")
    for key in ("is an embedding", "names its experts gate_proj", "read its weight scale from",
                "leaves it in high precision", "is stored but"):
        if key in text:
            return {"is an embedding": "refused: FP8 embedding",
                    "names its experts gate_proj": "refused: expert names no loader reads",
                    "read its weight scale from": "refused: scale names its engines do not read",
                    "leaves it in high precision": "refused: FP8 layer the config leaves out",
                    "is stored but": "refused: a scale its engines do not read"}[key]
    return text[:60]


HEADER = ("maker", "format", "inspect: loader label", "verify", "export-onnx",
          "transformers from_pretrained")


def render(results: dict) -> str:
    rows = [cells(results["rows"][k]) for k in ROWS if k in results["rows"]]
    return md_table(rows, HEADER)


def write_docs(results: dict) -> None:
    table = render(results)
    (RESULTS / "fp8_matrix.md").write_text(
        "# FP8-folder matrix (`bench/fp8_matrix.py`)\n\n" + table + "\n")
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table + "\n" + text[end:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", help="comma-separated row ids (default: all)")
    ap.add_argument("--peer-venv", type=Path, default=Path(os.environ.get(
        "FP8EXPORT_PEER_VENV", REPO / ".venv-peers")))
    ap.add_argument("--render", action="store_true", help="only re-render from the JSON")
    args = ap.parse_args()
    path = RESULTS / "fp8_matrix.json"
    if args.render:
        write_docs(json.loads(path.read_text()))
        return
    rows = args.rows.split(",") if args.rows else list(ROWS)
    results = json.loads(path.read_text()) if path.exists() and args.rows else {"rows": {}}
    peer = _peer_python(args.peer_venv)
    with tempfile.TemporaryDirectory(prefix="fp8export-matrix-") as tmp:
        work = Path(tmp)
        results["machine"] = machine_info(work)
        models = _models(work)
        made = []
        for row in rows:
            print(f"[matrix] {row} ...", flush=True)
            results["rows"][row] = run_row(row, models, work, peer)
            if results["rows"][row]["made"] == "ok":
                made.append(row)
            write_json(path, results)
        print("[matrix] transformers from_pretrained on every folder ...", flush=True)
        t0 = time.perf_counter()
        found = _transformers([(models[ROWS[r][2]], work / r) for r in made])
        for row, tf in zip(made, found):
            results["rows"][row]["transformers"] = tf
        results["transformers_seconds"] = round(time.perf_counter() - t0, 1)
        for row in rows:
            print("  " + " | ".join(cells(results["rows"][row])), flush=True)
        write_json(path, results)
    write_docs(results)
    print(render(results))


if __name__ == "__main__":
    main()
