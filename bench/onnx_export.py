"""Benchmark export-onnx: time and file size of the FP8 Q/DQ graph vs the plain 16-bit export.

Both graphs come from the same FP8 folder in one run: "plain" is the transformers model holding
the dequantized weights, traced by the same exporter with no Q/DQ rewrite (what a 16-bit
deployment would ship); "fp8" is ``fp8export export-onnx``. The FP8 file should be close to
half the fp16 one (only the quantized linears shrink: embeddings and lm_head stay 16-bit).
onnxruntime (CPU, its default optimization level) runs both once as a sanity check; the CPU
latency is informational only — CPU onnxruntime emulates Q/DQ in float, FP8 speed needs TensorRT
on a GPU.

    .venv/bin/python bench/onnx_export.py                       # the sample LM (converted here)
    .venv/bin/python bench/onnx_export.py --fp8-dir path/to/fp8  # an existing FP8 folder

Writes bench/results/onnx_export.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_info  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama"
WORK = REPO / "bench" / "_work" / "onnx_export"
# the sample LM's shape (samples/tiny-llama/train.py), used when the trained sample is absent
SAMPLE_SHAPE = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=688, max_position_embeddings=256,
                    vocab_size=4096, tie_word_embeddings=False)


def _prepare_fp8(args) -> tuple[Path, str]:
    import numpy as np

    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    if args.fp8_dir:
        return Path(args.fp8_dir), f"given FP8 folder {args.fp8_dir}"
    out = WORK / "fp8"
    model_dir = SAMPLE / "model"
    if (model_dir / "config.json").is_file():
        calib, what = SAMPLE / "data" / "calib.txt", "samples/tiny-llama/model (trained sample LM)"
        src = model_dir
    else:  # random weights in the sample's shape: sizes and times are the same
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        src = WORK / "src"
        LlamaForCausalLM(LlamaConfig(**SAMPLE_SHAPE)).to(torch.bfloat16).save_pretrained(src)
        calib = WORK / "calib.npz"
        ids = np.random.RandomState(0).randint(0, SAMPLE_SHAPE["vocab_size"], (16, 64))
        np.savez(calib, input_ids=ids.astype(np.int64))
        what = "random Llama in the sample LM's shape (samples/tiny-llama/model not built yet)"
    api.convert(ConvertConfig(checkpoint=src, output=out, scales="calibrate", calib_data=calib,
                              force=True))
    return out, what


def _ort(path: Path, feed, repeats: int = 5):
    from fp8export.runners.ort_runner import OrtRunner

    with OrtRunner(path, providers=["CPUExecutionProvider"]) as r:
        out = r.infer(feed)
        times = []
        for _ in range(repeats):
            r.infer(feed)
            times.append(r.last_inference_time)
    return next(iter(out.values())), statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8-dir", help="existing FP8 folder (default: convert the sample LM)")
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "fp32"],
                    choices=["fp16", "fp32", "bf16"])
    ap.add_argument("--results", default=str(REPO / "bench" / "results"))
    ap.add_argument("--keep", action="store_true", help="keep bench/_work/onnx_export")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from fp8export.fp8dir.reader import read_fp8_folder
    from fp8export.numerics.metrics import cosine, rel_l2
    from fp8export.onnx.export import (
        ExportOnnxConfig,
        OnnxDtype,
        export_onnx,
        strip_metadata,
        torch_export,
        write_model,
    )

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    machine = machine_info(WORK)  # load average at start
    fp8_dir, what = _prepare_fp8(args)
    folder = read_fp8_folder(fp8_dir)
    vocab = int(folder.config.get("vocab_size", 256))
    ids = np.random.RandomState(1).randint(0, vocab, (1, 64)).astype(np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    # warm-up: the first trace in a process pays one-time costs (imports, dispatcher and
    # decomposition tables); do it untimed so plain and FP8 exports are measured alike
    torch_export(folder, OnnxDtype.FP32, 21)
    rows = []
    for dt in args.dtypes:
        dtype = OnnxDtype(dt)
        opset = 23 if dtype is OnnxDtype.BF16 else 21
        t0 = time.perf_counter()
        proto, _, _ = torch_export(folder, dtype, opset)
        strip_metadata(proto)
        plain_path, _ = write_model(proto, WORK / f"plain_{dt}.onnx", force=True)
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = export_onnx(ExportOnnxConfig(fp8_dir=fp8_dir, output=WORK / f"fp8_{dt}.onnx",
                                           dtype=dt, force=True))
        fp8_s = time.perf_counter() - t0
        row = {"dtype": dt, "opset": opset,
               "plain": {"seconds": round(plain_s, 2), "bytes": plain_path.stat().st_size},
               "fp8": {"seconds": round(fp8_s, 2), "bytes": res.file_bytes,
                       "fp8_gemms": len(res.fp8_gemms), "sixteen_bit_gemms": len(res.sixteen_bit)}}
        row["size_ratio"] = round(row["fp8"]["bytes"] / row["plain"]["bytes"], 4)
        if dt != "bf16":  # onnxruntime has no bf16 Q/DQ kernels
            a, ta = _ort(plain_path, feed)
            b, tb = _ort(res.output, feed)
            a, b = torch.from_numpy(a.astype(np.float32)), torch.from_numpy(b.astype(np.float32))
            row["ort_cpu"] = {"plain_ms": round(ta * 1e3, 2), "fp8_ms": round(tb * 1e3, 2),
                              "fp8_vs_plain_cosine": round(cosine(a, b), 6),
                              "fp8_vs_plain_rel_l2": round(rel_l2(a, b), 6)}
        rows.append(row)

    quant_params = sum(layer.weight.numel() for layer in folder.layers.values())
    total_params = sum(t.numel() for n, t in folder.tensors.items() if not n.endswith("_scale"))
    doc = {"benchmark": "onnx_export", "model": what,
           "params": {"total": total_params, "quantized_linear": quant_params,
                      "quantized_fraction": round(quant_params / total_params, 4)},
           "machine": machine, "rows": rows}
    load = os.getloadavg()[0]
    doc["machine"]["load_avg_1m_at_end"] = round(load, 2)
    lines = [f"# export-onnx: FP8 Q/DQ vs plain export — {what}", "",
             f"{total_params:,} parameters, {quant_params / total_params:.1%} of them in quantized "
             "linears (the rest — embeddings, lm_head, norms — stays in the graph dtype).",
             f"Machine: {doc['machine']['cores']} cores, load average "
             f"{doc['machine']['load_avg_1m_at_start']} at start / {load:.2f} at end (times are "
             "wall clock: noisy when the load exceeds the core count; sizes are exact).", "",
             "| dtype | plain export s | plain MiB | FP8 export s | FP8 MiB | FP8/plain size | "
             "FP8 GEMMs | ORT CPU plain/FP8 ms | FP8 vs plain cosine |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = r.get("ort_cpu", {})
        lines.append(
            f"| {r['dtype']} | {r['plain']['seconds']} | {r['plain']['bytes'] / 2**20:.2f} | "
            f"{r['fp8']['seconds']} | {r['fp8']['bytes'] / 2**20:.2f} | {r['size_ratio']:.3f} | "
            f"{r['fp8']['fp8_gemms']} | {o.get('plain_ms', '-')}/{o.get('fp8_ms', '-')} | "
            f"{o.get('fp8_vs_plain_cosine', '-')} |")
    table = "\n".join(lines)
    print(table)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    (results / "onnx_export.json").write_text(json.dumps(doc, indent=2) + "\n")
    (results / "onnx_export.md").write_text(table + "\n")
    print(f"\nwrote {results / 'onnx_export.json'}")
    if not args.keep:
        shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
