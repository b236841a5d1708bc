"""Regenerate the tutorial's accuracy table (Keras vs fp8export) in README.md, for both samples.

Keras (dev install: keras, and keras-hub without dependencies) evaluates the two trained models
as the tutorial does; then the fp8export CLI converts the float8 model, exports it to ONNX and
the script runs the FP8 model in onnxruntime and in fp8export's torch FP8 runtime. Every FP8
prediction is compared with Keras's own float8 predictions, under the policy the model was
trained with (``mixed_bfloat16``) and under ``float32`` (the same float8 layers, computed in
float32: what the exported graph computes).

Run:  KERAS_BACKEND=torch .venv/bin/python samples/keras-hub-float8/tutorial_table.py
Writes the table between the ``tutorial-table`` markers of README.md and the numbers to
samples/keras-hub-float8/tutorial_table.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.setdefault("KERAS_BACKEND", "torch") != "torch":
    sys.exit("Keras runs on the torch backend here: set KERAS_BACKEND=torch.")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BEGIN, END = "<!-- tutorial-table:begin -->", "<!-- tutorial-table:end -->"
PARITY = ["--amax-algo", "stored", "--weight-scales-from-history"]


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keras_models(sample: str, policy: str):
    """(bf16-trained, float8-trained) Keras models of a sample, built under ``policy``."""
    keras.backend.clear_session()
    keras.config.set_dtype_policy(policy)
    folder = REPO / "samples" / sample
    results = json.loads((folder / "results.json").read_text())
    if sample == "keras-hub-float8":
        build = _module("kerashub_train", folder / "train.py").build_model
        bf16_weights, f8_weights = folder / "model" / "bf16_model.keras", \
            folder / "model" / "float8_model.keras"
    else:
        build = _module("kerasf8_model", folder / "model.py").build_model
        bf16_weights, f8_weights = folder / "model" / "bf16_model.weights.h5", \
            folder / "model" / "float8_model.weights.h5"
    models = []
    for weights, float8 in ((bf16_weights, False), (f8_weights, True)):
        model = build(vocabulary_size=results["vocabulary_size"], **results["model"])
        if float8:
            model.quantize("float8")
        model.load_weights(weights)
        models.append(model)
    keras.config.set_dtype_policy("float32")
    return models


def _cli(*args) -> None:
    cmd = [sys.executable, "-m", "fp8export.cli", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")


def _ort(path: Path, ids: np.ndarray) -> np.ndarray:
    """The graph as a user runs it: ``InferenceSession(path)``, onnxruntime's default level."""
    import onnxruntime as ort

    return ort.InferenceSession(str(path)).run(None, {"input_ids": ids})[0][:, 0]


def _torch_fp8(folder: Path, ids: np.ndarray) -> np.ndarray:
    """The FP8 folder in fp8export's torch runtime, as verify runs it (bf16 activations)."""
    from fp8export.runtime.fp8_model import load_fp8_model

    model, *_ = load_fp8_model(folder, dtype=torch.bfloat16, mode="auto")
    with torch.no_grad():
        return np.concatenate([model(torch.as_tensor(ids[i:i + 100])).float().numpy()[:, 0]
                               for i in range(0, len(ids), 100)])


def _rebuilt(path: Path, ids: np.ndarray, dtype: str) -> np.ndarray:
    """The Keras file rebuilt by fp8export (float8 layers unquantized), as verify's reference."""
    from fp8export.keras_model.build import load_keras_model

    model = load_keras_model(path, torch.float32 if dtype == "fp32" else torch.bfloat16)
    with torch.no_grad():
        return model(torch.as_tensor(ids)).float().numpy()[:, 0]


def measure(sample: str, work: Path) -> dict:
    folder = REPO / "samples" / sample
    data = np.load(folder / "data" / "eval.npz")
    ids, labels = data["input_ids"].astype(np.int64), data["labels"]

    def predict(model):
        return np.asarray(model.predict(ids, batch_size=100, verbose=0), np.float32)[:, 0]

    bf16, f8 = _keras_models(sample, "mixed_bfloat16")
    p_bf16, p_f8 = predict(bf16), predict(f8)
    p_f8_fp32 = predict(_keras_models(sample, "float32")[1])
    rows = [("bf16-trained (`mixed_bfloat16`)", "Keras", p_bf16),
            ("float8-trained (`quantize(\"float8\")`)", "Keras, `mixed_bfloat16` (as trained)",
             p_f8),
            ("float8-trained", "Keras, `float32` policy", p_f8_fp32)]
    model = folder / "model" / "float8_model.keras"
    rows += [("float8-trained, FP8 off (verify's reference)", f"fp8export torch, {dtype}",
              _rebuilt(model, ids, dtype)) for dtype in ("fp32", "bf16")]
    for label, extra in (("`--scales history`", []), ("`... " + " ".join(PARITY) + "`", PARITY)):
        out = work / sample / ("parity" if extra else "default")
        _cli("convert", model, "-o", out / "fp8", "--scales", "history", *extra)
        _cli("export-onnx", out / "fp8", "-o", out / "model.onnx")
        rows.append((f"FP8 ONNX, {label}", "onnxruntime 1.x CPU (default level), fp32 graph",
                     _ort(out / "model.onnx", ids)))
        rows.append((f"FP8 folder, {label}", "fp8export torch FP8 runtime, bf16",
                     _torch_fp8(out / "fp8", ids)))
    table = []
    for name, runtime, p in rows:
        row = {"model": name, "runtime": runtime, "accuracy": float(((p > 0.5) == labels).mean())}
        if p is not p_bf16:  # a different model: no point comparing its probabilities
            for key, ref in (("vs_keras_float8", p_f8), ("vs_keras_float8_fp32", p_f8_fp32)):
                row[key] = {"max_abs": float(np.abs(p - ref).max()),
                            "mean_abs": float(np.abs(p - ref).mean())}
        table.append(row)
    return {"sample": sample, "eval_reviews": int(len(labels)), "rows": table}


def render(results: list[dict]) -> str:
    import onnxruntime

    lines = [BEGIN, "<!-- written by samples/keras-hub-float8/tutorial_table.py; do not edit -->"]
    titles = {"keras-hub-float8": "keras_hub layers (`samples/keras-hub-float8`, the tutorial "
                                  "as written)",
              "keras-float8": "look-alike layers (`samples/keras-float8`)"}
    for res in results:
        lines += ["", f"**{titles[res['sample']]}**, eval split of {res['eval_reviews']} "
                      "reviews:", "",
                  "| model | runs in | accuracy | \\|Δp\\| vs Keras float8, max (mean) | "
                  "\\|Δp\\| vs Keras float8 in `float32` policy, max (mean) |",
                  "|---|---|---|---|---|"]
        for row in res["rows"]:
            def fmt(d):
                if d is None:
                    return "–"
                return "0" if d["max_abs"] == 0 else f"{d['max_abs']:.2g} ({d['mean_abs']:.1g})"
            runtime = row["runtime"].replace("1.x", onnxruntime.__version__)
            lines.append(f"| {row['model']} | {runtime} | {row['accuracy']:.1%} | "
                         f"{fmt(row.get('vs_keras_float8'))} | "
                         f"{fmt(row.get('vs_keras_float8_fp32'))} |")
    return "\n".join(lines + ["", END])


def main() -> None:
    torch.set_num_threads(1)  # tiny models: more threads only spin-wait
    with tempfile.TemporaryDirectory(prefix="fp8export-tutorial-") as tmp:
        results = [measure(s, Path(tmp)) for s in ("keras-hub-float8", "keras-float8")]
    (HERE / "tutorial_table.json").write_text(json.dumps(results, indent=1) + "\n")
    readme = REPO / "README.md"
    text = readme.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    readme.write_text(text[:start] + render(results) + text[end:])
    print(render(results))


if __name__ == "__main__":
    main()
