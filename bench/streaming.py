#!/usr/bin/env python
"""Layer streaming and data parallel, measured (README "Models larger than one GPU").

    python bench/streaming.py --out bench/results/streaming_h200.json   # a host with 2 GPUs
    python bench/streaming.py --smoke --device cpu --out /tmp/s.json      # the script, on CPU

One process drives everything; every number is of the public API or the command line a user
runs, each against its baseline measured in the same run:

(a) **Larger than the cap** — a random Llama-shaped checkpoint (safetensors, written here) at
    least 4x the GPU memory cap ``--max-memory 0=CAP`` (``--cap-gib``): ``calibrate``
    (``max``), ``convert --weight-rounding gptq`` and ``verify`` (reference, FP8 candidate and
    the fp32 noise floor) with layer streaming under the cap; baselines: the same calls with
    the whole model on the same GPU (it fits there without the cap). Peak GPU memory is
    ``torch.cuda.max_memory_allocated`` over each call; throughput is tokens per second of the
    whole call (reading the checkpoint included: both read it once), and of the pass alone.
    amax.json, the GPTQ shards and the verify metrics must be identical to the baselines'.
    ``--whole map`` loads the baselines through accelerate's device map with everything on the
    one GPU (``--offload none --max-memory 0=...``: weights read straight onto the GPU, where
    ``full``, what ``--offload none`` alone does, builds the model on the CPU first: minutes
    for 16 GiB); its pass carries accelerate's hooks on every module. ``--steps`` picks the
    calls (calibrate, gptq, verify).
(b) **Ranks** — ``torchrun --standalone --nproc-per-node N fp8export calibrate|verify`` with
    N = 1 and 2 (whole model on each GPU): wall time and the pass's own time, the speedups,
    and the bytes of amax.json / the report's metrics (identical for every N).
(c) **Two hosts, simulated** — the same calibrate as two torchrun node groups of one rank each
    (c10d rendezvous over TCP on localhost, each group one GPU): the same amax.json bytes.

Writes the JSON (``--out``) and a Markdown table beside it; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
# Llama-3.2-3B's layer shape, 84 layers: 17 GB in bf16. GPTQ's solve holds the largest input
# matrix (8192^2) in float64 with its factors (~2.4 GB): the GPTQ cap below must hold that.
BIG = dict(vocab_size=32000, hidden_size=3072, intermediate_size=8192, num_hidden_layers=84,
           num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=4096)
# A narrow Llama (hidden 512) for GPTQ: its time goes to the column-by-column solve, about the
# same per column whatever the width, and the cap a layer's solve needs grows with the width as
# the layer does, so a model 4x the cap has a few times fewer columns in this shape than in BIG.
NARROW = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=144,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
SMOKE = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def llama_config(**kw) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **kw}


def write_model(folder: Path, cfg: dict, device: str, shard_bytes: int = 4 * GiB) -> int:
    """A random bf16 Llama of ``cfg`` as safetensors shards (+ index) and config.json; returns
    its bytes. Weights ~N(0, 0.02), norms 1, made on ``device`` one tensor at a time."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for layer in range(n):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)})
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    total = size = 0
    files = []

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file({k: v.cpu().contiguous() for k, v in shard.items()}, str(folder / name),
                  metadata={"format": "pt"})
        files.append(name)
        index.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in shapes.items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=gen, device=device).mul_(0.02).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}))
    (folder / "config.json").write_text(json.dumps(llama_config(**cfg)))
    return total


def write_data(path: Path, samples: int, tokens: int, vocab: int) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, input_ids=rng.integers(3, vocab, size=(samples, tokens), dtype=np.int64))
    return path


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measured(fn):
    """``(result, seconds, peak GPU bytes or None)`` of one call: the peak over what was
    allocated before it. Earlier calls' models are collected first: a model spread with
    accelerate sits in reference cycles (its hooks) and stays on the GPU until the collector
    runs, and a peak read on top of it measures the earlier call (16.6 GiB read so in one run)."""
    import gc

    import torch

    cuda = torch.cuda.is_available()
    base = 0
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = fn()
    _sync()
    seconds = time.perf_counter() - t0
    return result, seconds, torch.cuda.max_memory_allocated() - base if cuda else None


def _cap(args, gib: float) -> str:
    return f"0={gib}GiB" if args.device == "cuda" else f"cpu={gib}GiB"


def warm_up(work: Path, args) -> None:
    """CUDA, transformers and fp8export's lazy imports, once, outside every measurement."""
    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig

    small = work / "warm"
    write_model(small, SMOKE, "cpu")
    data = write_data(work / "warm.npz", 8, 64, SMOKE["vocab_size"])
    for off in ("none", "layers"):
        api.calibrate(CalibrateConfig(checkpoint=small, calib_data=data, output=None,
                                      device=args.device, offload=off, batch_size=4))


class PartA(NamedTuple):
    """What the steps of (a) share."""
    work: Path
    args: argparse.Namespace
    a: dict
    save: Callable[[], None]
    src: Path
    calib: Path
    evald: Path
    whole: list


def part_a(work: Path, args, out: dict, save) -> None:
    """The model larger than the caps, streamed, against the whole model."""
    cfg = SMOKE if args.smoke else NARROW if args.shape == "narrow" else BIG
    if args.layers:
        cfg = {**cfg, "num_hidden_layers": args.layers}
    if args.vocab:
        cfg = {**cfg, "vocab_size": args.vocab}
    src = work / f"model-{args.shape}"
    t0 = time.perf_counter()
    index = src / "model.safetensors.index.json"
    if index.exists() and (src / "config.json").read_text() == json.dumps(llama_config(**cfg)):
        size = json.loads(index.read_text())["metadata"]["total_size"]  # an earlier step's
    else:
        size = write_model(src, cfg, args.device if args.device == "cuda" else "cpu")
        for stale in work.glob("amax-*.json"):  # an earlier model's scales: convert refuses
            stale.unlink()
    caps = {"calibrate": args.cap_calib_gib, "gptq": args.cap_gptq_gib,
            "verify": args.cap_verify_gib}
    a = out["a"] = {"model": cfg, "weights_bytes": size, "whole_load": args.whole,
                    "caps_gib": caps, "model_over_cap": {k: round(size / (v * GiB), 2)
                                                         for k, v in caps.items()},
                    "write_s": round(time.perf_counter() - t0, 1)}
    save()
    warm_up(work, args)
    calib = write_data(work / "calib.npz", args.calib_samples, args.seq_len, cfg["vocab_size"])
    evald = write_data(work / "eval.npz", args.eval_samples, args.eval_len, cfg["vocab_size"])
    ctx = PartA(work, args, a, save, src, calib, evald, _whole(args))
    steps = args.steps.split(",")
    for name, step in (("calibrate", calibrate_step), ("gptq", gptq_step),
                       ("verify", verify_step)):
        if name in steps:
            step(ctx)


def _whole(args) -> list[tuple[str, dict]]:
    """The whole-model baseline's options (``--whole``): none, or one (name, options)."""
    if args.whole == "none":
        return []
    if args.whole == "map":  # everything on the one GPU through accelerate's device map
        import torch

        free = torch.cuda.mem_get_info()[0] / GiB if args.device == "cuda" else 64
        return [("whole", {"offload": "none", "max_memory": _cap(args, int(free * 0.9))})]
    return [("whole", {"offload": "none"})]


def calibrate_step(ctx: PartA) -> None:
    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig

    args, work = ctx.args, ctx.work
    tokens = args.calib_samples * args.seq_len
    common = dict(checkpoint=ctx.src, calib_data=ctx.calib, batch_size=args.batch_size,
                  seq_len=args.seq_len, device=args.device, calib_samples=args.calib_samples)
    runs = {}  # streamed first: nothing of the whole model's run can be on the GPU yet
    for name, kw in [("streamed", {"offload": "layers",
                                   "max_memory": _cap(args, args.cap_calib_gib)}), *ctx.whole]:
        res, sec, peak = measured(lambda kw=kw, name=name: api.calibrate(CalibrateConfig(
            output=work / f"amax-{name}.json", force=True, **common, **kw)))
        runs[name] = {"seconds": round(sec, 2), "pass_s": res.seconds,
                      "tokens_per_s": round(tokens / sec), "pass_tokens_per_s":
                      round(tokens / res.seconds), "peak_gpu_bytes": peak,
                      "plan": res.streaming}
    plan = runs["streamed"]["plan"] or {}
    bound = plan.get("layer_bytes", 0) + plan.get("activation_bytes", 0) + (
        plan.get("hidden_bytes", 0) if plan.get("tier") == "device" else 0)
    c = ctx.a["calibrate"] = {**runs, "tokens": tokens, "bound_bytes": bound, "peak_over_bound":
                              round((runs["streamed"]["peak_gpu_bytes"] or 0) / max(bound, 1),
                                    3)}
    if ctx.whole:  # a device-map run names its device "cuda:0" and adds a note saying it
        # spread the model: everything else (the amaxes, groups, options) is compared
        files = [work / f"amax-{n}.json" for n in ("whole", "streamed")]
        c["amax_bytes_identical"] = files[0].read_bytes() == files[1].read_bytes()
        x, y = ({k: v for k, v in json.loads(f.read_text()).items()
                 if k not in ("notes", "device")} for f in files)
        c["amax_identical"] = x == y
        if x != y:
            c["amax_largest_difference"] = _largest_difference(x, y)
        c["throughput_ratio"] = round(runs["whole"]["seconds"] / runs["streamed"]["seconds"], 3)
        c["pass_throughput_ratio"] = round(runs["whole"]["pass_s"] / runs["streamed"]["pass_s"],
                                           3)
    ctx.save()


def _largest_difference(x, y) -> dict:
    """Where two amax.json files differ most: the value and its two readings."""
    out = {"path": None, "relative": 0.0}

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in set(a) | set(b):
                walk(a.get(k), b.get(k), f"{path}/{k}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (u, v) in enumerate(zip(a, b)):
                walk(u, v, f"{path}/{i}")
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and a != b:
            rel = abs(a - b) / max(abs(a), abs(b), 1e-30)
            if rel > out["relative"]:
                out.update(path=path, relative=rel, whole=a, streamed=b)
        elif a != b and out["path"] is None:
            out.update(path=path, whole=str(a)[:80], streamed=str(b)[:80])

    walk(x, y, "")
    return out


def gptq_step(ctx: PartA) -> None:
    from fp8export import api
    from fp8export.convert.config import ConvertConfig

    args, work = ctx.args, ctx.work
    amax = next((p for p in (work / "amax-whole.json", work / "amax-streamed.json")
                 if p.exists()), None)
    if amax is None:  # no calibrate step on this model: its scales, streamed (not timed)
        from fp8export.calibration.config import CalibrateConfig

        amax = work / "amax-streamed.json"
        api.calibrate(CalibrateConfig(
            checkpoint=ctx.src, calib_data=ctx.calib, output=amax, batch_size=args.batch_size,
            seq_len=args.seq_len, device=args.device, calib_samples=args.calib_samples,
            offload="layers", max_memory=_cap(args, args.cap_gptq_gib), force=True))
    gptq = {}
    modes = [("streamed", {"offload": "layers", "max_memory": _cap(args, args.cap_gptq_gib)})]
    if args.gptq_baseline:  # the whole model as --whole loads it (default: built on the CPU),
        # after the streamed run: a measured peak then has nothing of the baseline's in it
        modes.append(ctx.whole[0] if ctx.whole else ("whole", {"offload": "none"}))
    for name, kw in modes:
        _, sec, peak = measured(lambda kw=kw, name=name: api.convert(ConvertConfig(
            checkpoint=ctx.src, output=work / f"fp8-{name}", calib_amax=amax,
            calib_data=ctx.calib, weight_rounding="gptq", calib_samples=args.gptq_samples,
            batch_size=args.batch_size, seq_len=args.seq_len, device=args.device, force=True,
            **kw)))
        manifest = json.loads((work / f"fp8-{name}" / "fp8export.json").read_text())
        gptq[name] = {"seconds": round(sec, 2), "peak_gpu_bytes": peak,
                      "rounding_s": manifest["weight_rounding"]["seconds"],
                      "layers": manifest["weight_rounding"]["layers"],
                      "plan": manifest["weight_rounding"].get("streaming")}
    if args.gptq_baseline:
        shards = [sorted((work / f"fp8-{n}").glob("*.safetensors"))
                  for n in ("whole", "streamed")]
        gptq["shards_identical"] = [p.read_bytes() for p in shards[0]] == \
            [p.read_bytes() for p in shards[1]]
    ctx.a["gptq"] = gptq
    ctx.save()


def _verdict(api, cfg):
    """verify's result, passed or not (a random model may miss the thresholds: the run is
    timed, not judged)."""
    from fp8export.errors import VerificationFailed

    try:
        return api.verify(cfg)
    except VerificationFailed as exc:
        return exc.result


def verify_step(ctx: PartA) -> None:
    """Verify of the streamed GPTQ folder; without the GPTQ step, of a weights-only convert."""
    from fp8export import api
    from fp8export.convert.config import ConvertConfig
    from fp8export.verify.config import VerifyConfig

    args, work = ctx.args, ctx.work
    candidate = work / "fp8-streamed"
    if not candidate.exists():
        api.convert(ConvertConfig(checkpoint=ctx.src, output=candidate, scales="weights",
                                  device=args.device, force=True))
        ctx.a["verify_candidate"] = "convert --scales weights (no GPTQ step in this run)"
    ver = {}
    vcommon = dict(reference=ctx.src, candidate=candidate, data=ctx.evald,
                   batch_size=args.batch_size, seq_len=args.eval_len, device=args.device,
                   thresholds="loose", write_reports=False)
    vtokens = args.eval_samples * args.eval_len
    streamed = {"offload": "layers", "max_memory": _cap(args, args.cap_verify_gib)}
    # a device-map run measures no noise floor (verify/load.py): against it, the streamed run
    # without the floor; the streamed run with the floor is the full verify under the cap
    runs = [*[(n, {**kw, "noise_floor": False}) for n, kw in ctx.whole],
            *([("streamed_no_floor", {**streamed, "noise_floor": False})] if ctx.whole else []),
            ("streamed", streamed)]
    for name, kw in runs:
        res, sec, peak = measured(lambda kw=kw: _verdict(api, VerifyConfig(**vcommon, **kw)))
        ver[name] = {"passed": not res.failures, "seconds": round(sec, 2),
                     "peak_gpu_bytes": peak, "timing": res.timing,
                     "tokens_per_s": round(vtokens / sec), "metrics": res.metrics,
                     "noise_floor": res.noise_floor is not None,
                     "plan": res.candidate.get("streaming")}
    if ctx.whole:
        ver["metrics_identical"] = ver["whole"]["metrics"] == ver["streamed"]["metrics"] == \
            ver["streamed_no_floor"]["metrics"]
        ver["throughput_ratio"] = round(ver["whole"]["seconds"] /
                                        ver["streamed_no_floor"]["seconds"], 3)
        plan = ver["streamed"]["plan"] or {}
        ver["bound_bytes"] = plan.get("device_peak")
    ctx.a["verify"] = ver
    ctx.save()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli() -> list[str]:
    """The console script as torchrun takes it (its path, or ``-m fp8export.cli``)."""
    import shutil

    found = shutil.which("fp8export") or str(Path(sys.executable).with_name("fp8export"))
    return [found] if Path(found).exists() else ["-m", "fp8export.cli"]


def _launch(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    ran = subprocess.run(cmd, env={**os.environ, "FP8EXPORT_NO_PROGRESS": "1", **(env or {})},
                         capture_output=True, text=True, timeout=1200)
    if ran.returncode:
        raise RuntimeError(f"{' '.join(cmd[:8])} ...: exit {ran.returncode}\n"
                           f"{ran.stdout[-2000:]}\n{ran.stderr[-4000:]}")
    return time.perf_counter() - t0, ran.stdout


def _pass_seconds(stdout: str) -> float | None:
    """The observation pass's seconds from calibrate's summary line."""
    import re

    m = re.search(r"tokens, [^,]+, ([0-9.]+)s\)", stdout)
    return float(m.group(1)) if m else None


def part_bc(work: Path, args, out: dict, save) -> None:
    """Data parallel: 1 and N ranks; two simulated hosts."""
    cfg = SMOKE if args.smoke else BIG
    src = work / f"model-{args.shape}"
    calib = write_data(work / "dp-calib.npz", args.dp_samples, args.seq_len, cfg["vocab_size"])
    evald = write_data(work / "dp-eval.npz", args.dp_eval_samples, args.eval_len,
                       cfg["vocab_size"])
    b = out["b"] = {"calibrate": {}, "verify": {}, "tokens": args.dp_samples * args.seq_len,
                    "verify_tokens": args.dp_eval_samples * args.eval_len}
    for n in [1, *args.ranks]:
        amax = work / f"dp-amax-{n}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", *_cli(), "calibrate", str(src), "--calib-data",
               str(calib), "-o", str(amax), "--batch-size", str(args.batch_size), "--seq-len",
               str(args.seq_len), "--calib-samples", str(args.dp_samples), "--device",
               args.device, "--offload", "none", "--force"]
        sec, stdout = _launch(cmd)
        b["calibrate"][n] = {"seconds": round(sec, 2), "pass_s": _pass_seconds(stdout)}
        report = work / f"dp-report-{n}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", *_cli(), "verify", str(src), str(work / "fp8-streamed"),
               "--data", str(evald), "--batch-size", str(args.batch_size), "--seq-len",
               str(args.eval_len), "--device", args.device, "--offload", "none",
               "--report-dir", str(report), "--thresholds", "loose", "--force",
               "--no-noise-floor"]
        sec, _ = _launch(cmd)
        rep = json.loads((report / "report.json").read_text())
        b["verify"][n] = {"seconds": round(sec, 2), "timing": rep["timing"],
                          "metrics": rep["metrics"]}
        save()
    one = (work / "dp-amax-1.json").read_bytes()
    b["amax_identical"] = all((work / f"dp-amax-{n}.json").read_bytes() == one
                              for n in args.ranks)
    b["metrics_identical"] = all(b["verify"][n]["metrics"] == b["verify"][1]["metrics"]
                                 for n in args.ranks)
    for what in ("calibrate", "verify"):
        for n in args.ranks:
            b[what][n]["speedup"] = round(b[what][1]["seconds"] / b[what][n]["seconds"], 3)
    for n in args.ranks:
        one, many = b["calibrate"][1]["pass_s"], b["calibrate"][n]["pass_s"]
        if one and many:
            b["calibrate"][n]["pass_speedup"] = round(one / many, 3)
    if "verify" in b:
        for n in [1, *args.ranks]:
            t = b["verify"][n]["timing"]
            b["verify"][n]["compare_s"] = round(t.get("total_s", 0) - t.get("load_s", 0), 2)
        for n in args.ranks:
            b["verify"][n]["compare_speedup"] = round(
                b["verify"][1]["compare_s"] / max(b["verify"][n]["compare_s"], 1e-9), 3)
    save()
    # (c) two node groups of one rank each, rendezvous over TCP
    port = _free_port()
    amax = work / "two-hosts-amax.json"
    procs = []
    t0 = time.perf_counter()
    for node in range(2):
        env = {**os.environ, "FP8EXPORT_NO_PROGRESS": "1"}
        if args.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(node)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
             "--nproc-per-node=1", f"--node-rank={node}", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", *_cli(), "calibrate",
             str(src), "--calib-data", str(calib), "-o", str(amax), "--batch-size",
             str(args.batch_size), "--seq-len", str(args.seq_len), "--calib-samples",
             str(args.dp_samples), "--device", args.device, "--offload", "none", "--force"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("two-host calibrate failed:\n" + "\n".join(x[-3000:] for x in logs))
    got = amax.read_bytes()
    out["c"] = {"seconds": round(time.perf_counter() - t0, 2),
                "amax_identical_to_one_rank": got == one}
    if got != one:  # where they differ, for the record
        a_lines, b_lines = one.decode().splitlines(), got.decode().splitlines()
        out["c"]["first_difference"] = next(
            ([x, y] for x, y in zip(a_lines, b_lines) if x != y), [len(one), len(got)])
        out["c"]["logs"] = [x[-1500:] for x in logs]
    save()


def table(out: dict) -> str:
    def gib(x):
        return "-" if x is None else f"{x / GiB:.2f}"

    lines = [f"device: {out.get('device')}, torch {out.get('torch')}", ""]
    a = out.get("a")
    if a:
        caps = a["caps_gib"]
        lines += [f"(a) Llama-shaped model, {a['weights_bytes'] / GiB:.1f} GiB bf16; GPU caps "
                  + ", ".join(f"{k} {v} GiB ({a['model_over_cap'][k]}x smaller)"
                              for k, v in caps.items()), "",
                  "| step | mode | seconds | tokens/s | peak GPU GiB | hidden states | "
                  "identical to whole |", "|---|---|---|---|---|---|---|"]
        for step, key, same in (("calibrate", "calibrate", "amax_identical"),
                                ("convert --weight-rounding gptq", "gptq", "shards_identical"),
                                ("verify", "verify", "metrics_identical")):
            block = a.get(key, {})
            for name in ("whole", "streamed_no_floor", "streamed"):
                if name not in block:
                    continue
                r = block[name]
                plan = r.get("plan") or {}
                label = "whole (device map)" if name == "whole" and a.get("whole_load") == \
                    "map" else name.removesuffix("_no_floor")
                if key == "verify":
                    label += " + fp32 floor" if r.get("noise_floor") else ", no fp32 floor"
                lines.append(f"| {step} | {label} | {r['seconds']} | {r.get('tokens_per_s', '-')} "
                             f"| {gib(r['peak_gpu_bytes'])} | {plan.get('tier', '-')} | "
                             f"{block.get(same, '-') if name == 'streamed' else ''} |")
        c = a.get("calibrate", {})
        if "bound_bytes" in c:
            on_device = (c["streamed"]["plan"] or {}).get("tier") == "device"
            ratio = (f"; throughput {c['throughput_ratio']}x the whole model's (pass alone "
                     f"{c['pass_throughput_ratio']}x)" if "throughput_ratio" in c else "")
            lines += ["", f"calibrate streamed: peak {gib(c['streamed']['peak_gpu_bytes'])} GiB "
                      f"= {c['peak_over_bound']}x (one layer + one batch's activations"
                      f"{' + hidden states' if on_device else ''} = {gib(c['bound_bytes'])} "
                      f"GiB){ratio}"]
        v = a.get("verify", {})
        if "throughput_ratio" in v:
            lines.append(f"verify streamed: throughput {v['throughput_ratio']}x the whole "
                         "model's (both without the fp32 floor, which a device-map run skips)")
        g = a.get("gptq", {})
        if g.get("streamed", {}).get("plan"):
            p = g["streamed"]["plan"]
            lines.append(f"gptq streamed: peak {gib(g['streamed']['peak_gpu_bytes'])} GiB "
                         f"against the plan's {gib(p.get('device_peak'))} GiB (a layer, its "
                         "input matrices and solve, one batch's activations)")
    b = out.get("b")
    if b:
        lines += ["", "(b) ranks (torchrun, whole model on each GPU; end to end, imports and "
                  "loading included)", "",
                  "| ranks | calibrate s | speedup | pass s | pass speedup | verify s | speedup "
                  "| verify compare s | compare speedup |", "|---|---|---|---|---|---|---|---|---|"]
        for n in sorted(b["calibrate"], key=int):
            c, v = b["calibrate"][n], b["verify"].get(n, {})
            lines.append(f"| {n} | {c['seconds']} | {c.get('speedup', 1.0)} | "
                         f"{c.get('pass_s')} | {c.get('pass_speedup', 1.0)} | "
                         f"{v.get('seconds')} | {v.get('speedup', 1.0)} | "
                         f"{v.get('compare_s')} | {v.get('compare_speedup', 1.0)} |")
        lines.append(f"amax identical: {b.get('amax_identical')}; verify metrics identical: "
                     f"{b.get('metrics_identical')}")
    if out.get("c"):
        lines.append(f"(c) two hosts (two torchrun node groups, TCP rendezvous): "
                     f"{out['c']['seconds']} s, amax identical to one rank: "
                     f"{out['c']['amax_identical_to_one_rank']}")
    if out.get("error"):
        lines += ["", f"stopped: {out['error'][:500]}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoint goes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--shape", choices=("big", "narrow"), default="big",
                    help="(a): the layer shape: Llama-3.2-3B's (84 layers) or hidden 512 (144)")
    ap.add_argument("--layers", type=int, default=None,
                    help="(a): decoder layers of the model (default: the shape's)")
    ap.add_argument("--vocab", type=int, default=None, help="(a): vocabulary size")
    ap.add_argument("--cap-calib-gib", type=float, default=1.25)
    ap.add_argument("--cap-gptq-gib", type=float, default=4.0)
    ap.add_argument("--cap-verify-gib", type=float, default=3.0)
    ap.add_argument("--gptq-baseline", action="store_true",
                    help="also GPTQ the whole model (identical shards expected)")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--gptq-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dp-samples", type=int, default=384)
    ap.add_argument("--dp-eval-samples", type=int, default=128)
    ap.add_argument("--ranks", type=int, nargs="*", default=[2])
    ap.add_argument("--parts", default="abc")
    ap.add_argument("--steps", default="calibrate,gptq,verify",
                    help="(a): which calls to measure, comma separated")
    ap.add_argument("--whole", choices=("full", "map", "none"), default="full",
                    help="(a): how the whole-model baselines load (see above), or none")
    args = ap.parse_args()
    import tempfile

    import torch

    work = args.work or Path(tempfile.mkdtemp(prefix="fp8export-bench-streaming-"))
    out = {"device": (torch.cuda.get_device_name(0) + f" x{torch.cuda.device_count()}")
           if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
           "args": {k: str(v) for k, v in vars(args).items()}}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str))
        args.out.with_suffix(".md").write_text(table(out) + "\n")

    try:
        if "a" in args.parts:
            part_a(work, args, out, save)
        if "b" in args.parts or "c" in args.parts:
            part_bc(work, args, out, save)
    except Exception as exc:  # keep what was measured; say what broke
        out["error"] = f"{type(exc).__name__}: {exc}"[-6000:]
        save()
        print(out["error"], file=sys.stderr)
    save()
    print(table(out))


if __name__ == "__main__":
    main()
