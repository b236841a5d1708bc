"""Benchmark ``fp8export convert`` against ``cp -r`` + fsync and llm-compressor ``model_free_ptq``.

    .venv/bin/python bench/convert.py                       # 2.1 GB checkpoint, 2 rounds
    .venv/bin/python bench/convert.py --sizes 2.1 --large   # plus the largest the disk holds
    .venv/bin/python bench/convert.py --sizes 0.3 --rounds 1 --results /tmp/r   # quick check

1. Generates a Llama-shaped bf16 checkpoint per size (``--sizes``, GB = 10^9 bytes; default
   2.1, five safetensors shards, index, config.json; N(0, 0.02) weights, windows of a seeded
   64 MiB pool of random numbers) under
   ``--work`` (default ``/tmp/fp8export-bench``) and keeps it there for the next run.
   ``--large`` adds the largest size that leaves 5 GB free on that disk with a copy beside it
   (the copy is deleted before convert writes its FP8 output, about half the size).
2. fsyncs the checkpoint and reads it once: every contender starts with the source in the
   page cache (a container cannot drop caches), as far as RAM holds it.
3. Per round (``--rounds``, default 2), in this order: ``cp -r`` then an fsync of every
   copied file; convert with each ``--workers`` value (default 1 and 2); llm-compressor
   ``model_free_ptq(scheme="FP8_DYNAMIC", max_workers=2)`` (only at the first size unless
   ``--llmc-all-sizes``), run by the python of the peer venv that tests/peers use
   (``--llmc-venv``; default ``$FP8EXPORT_PEER_VENV``, else ``.venv-peers`` in this checkout or
   in the main checkout of a git worktree: ``scripts/peer_venv.sh`` builds it), else by this
   interpreter with ``--llmc-pythonpath`` added to its PYTHONPATH; skipped when neither imports
   it. Every output is fsynced and the fsync counted; outputs are deleted
   after each run.
4. Convert runs as a fresh child interpreter (``-c``, no torch: the default path does not
   import it) that imports fp8export and calls ``api.convert`` with the
   config the CLI builds (``--workers N --force``), so the same run also gives the time per
   step (``ConvertResult.timings``); start-up is the child's wall time outside ``convert``.
   Peak RSS of every contender: its high-water mark (``VmHWM``), sampled every 20 ms
   (``ru_maxrss`` would also count this script's memory, which Linux carries over exec).
5. Targets (2 cores): convert <= 2.0x ``cp -r`` + fsync (aim 1.5x); llm-compressor / convert
   >= 5; peak RSS <= 0.75 GiB + 2x the largest tensor per worker; 2 workers >= 1.6x the
   throughput of 1. The best round of each contender is compared; peak RSS is the worst.

Results: ``bench/results/convert.json`` and ``convert.md`` (``--results DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO,
    GiB,
    MiB,
    fmt_bytes,
    machine_info,
    md_table,
    run_measured,
    write_json,
)

GB = 10**9
QUIET_LOAD = 2.5  # 1-min load average on 2 cores above which a run is labelled as loaded
VOCAB = 32000
# (hidden, intermediate, heads, kv_heads): Llama-family widths; the generator takes the widest
# whose embedding + lm_head stay under 15 % of the target, then adds layers to reach the size.
WIDTHS = [(512, 1408, 8, 4), (1024, 2816, 16, 4), (2048, 5632, 32, 4), (4096, 11008, 32, 8)]
BF16 = 2


def plan_model(size_bytes: int) -> dict:
    """Config and (name, shape) list of a Llama checkpoint of about ``size_bytes``."""
    for hidden, inter, heads, kv in reversed(WIDTHS):
        head_dim = hidden // heads
        emb = 2 * VOCAB * hidden * BF16  # embed_tokens + untied lm_head
        layer = (2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter
                 + 2 * hidden) * BF16
        layers = round((size_bytes - emb) / layer)
        if emb <= 0.15 * size_bytes and layers >= 2:
            break
    else:  # small target: the narrowest width, as many layers as fit (at least 2)
        hidden, inter, heads, kv = WIDTHS[0]
        head_dim = hidden // heads
        emb = 2 * VOCAB * hidden * BF16
        layer = (2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter
                 + 2 * hidden) * BF16
        layers = max(2, round((size_bytes - emb) / layer))
    kvd = kv * head_dim
    tensors = [("model.embed_tokens.weight", (VOCAB, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kvd, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kvd, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
        ]
    tensors += [("model.norm.weight", (hidden,)), ("lm_head.weight", (VOCAB, hidden))]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    return {"config": config, "tensors": tensors}


def nbytes(shape) -> int:
    return math.prod(shape) * BF16


POOL_ELEMS = 1 << 25  # 64 MiB of bf16 random numbers, drawn once per seed
_pool: dict[int, bytes] = {}


def write_tensor_data(f, shape, seed: int, is_norm: bool, base_seed: int = 0) -> None:
    """N(0, 0.02) bf16 data (ones for norms): a window of a seeded 64 MiB pool of random
    numbers at a seeded offset, so generating tens of GB costs little more than writing them
    (a convert's cost does not depend on which random numbers it reads)."""
    import torch

    n = math.prod(shape)
    if is_norm:
        f.write(torch.ones(n, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
        return
    if base_seed not in _pool:
        gen = torch.Generator().manual_seed(base_seed)
        x = torch.randn(POOL_ELEMS, generator=gen).mul_(0.02).to(torch.bfloat16)
        _pool[base_seed] = x.view(torch.uint8).numpy().tobytes()
    pool = memoryview(_pool[base_seed])
    pos = (seed * 2654435761) % POOL_ELEMS * BF16  # a different window for every tensor
    left = n * BF16
    while left:
        k = min(left, len(pool) - pos)
        f.write(pool[pos:pos + k])
        left -= k
        pos = 0


def generate(ckpt: Path, size_bytes: int, shard_bytes: int, seed: int) -> dict:
    """Write the sharded checkpoint; returns the plan (also stored as bench_plan.json)."""
    plan = plan_model(size_bytes)
    tensors = plan["tensors"]
    # Greedy sharding in order, like save_pretrained's max_shard_size.
    shards: list[list[tuple[str, tuple]]] = [[]]
    cur = 0
    for name, shape in tensors:
        if shards[-1] and cur + nbytes(shape) > shard_bytes:
            shards.append([])
            cur = 0
        shards[-1].append((name, shape))
        cur += nbytes(shape)
    ckpt.mkdir(parents=True)
    weight_map = {}
    total = 0
    index = 0
    for s, group in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, shape in group:
            header[name] = {"dtype": "BF16", "shape": list(shape),
                            "data_offsets": [off, off + nbytes(shape)]}
            off += nbytes(shape)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors: data starts 8-byte aligned
        with open(ckpt / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, shape in group:
                write_tensor_data(f, shape, seed + index, name.endswith("norm.weight"), seed)
                weight_map[name] = fname
                index += 1
        total += off
        print(f"  wrote {fname} ({fmt_bytes(off)})", flush=True)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (ckpt / "config.json").write_text(json.dumps(plan["config"], indent=2) + "\n")
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
    info = {"size_bytes": total, "shards": len(shards), "tensors": len(tensors),
            "largest_tensor": max(tensors, key=lambda t: nbytes(t[1]))[0],
            "largest_tensor_bytes": max(nbytes(t[1]) for t in tensors),
            "config": plan["config"], "seed": seed, "requested_bytes": size_bytes,
            "shard_bytes": shard_bytes, "generator": "pool-v1"}
    (ckpt / "bench_plan.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path) -> float:
    """fsync every file and folder under ``path``; returns the seconds it took."""
    t0 = time.perf_counter()
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def read_all(path: Path, block: int = 16 * MiB) -> float:
    t0 = time.perf_counter()
    for p in files_under(path):
        with open(p, "rb", buffering=0) as f:
            while f.read(block):
                pass
    return time.perf_counter() - t0


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def safetensors_dtypes(path: Path) -> dict[str, int]:
    """dtype -> tensor count over every .safetensors file under ``path`` (headers only)."""
    counts: dict[str, int] = {}
    for p in files_under(path):
        if p.suffix != ".safetensors":
            continue
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                counts[meta["dtype"]] = counts.get(meta["dtype"], 0) + 1
    return counts


CHILD_SCRIPT = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from fp8export import api
from fp8export.convert.config import ConvertConfig
t1 = time.perf_counter()
src, out, workers, result = sys.argv[1:5]
r = api.convert(ConvertConfig(checkpoint=Path(src), output=Path(out), force=True,
                              workers=int(workers)))
t2 = time.perf_counter()
Path(result).write_text(json.dumps({"import_seconds": t1 - t0, "convert_seconds": t2 - t1,
                                    "timings": r.timings, "quantized": r.quantized}))
"""
"""One convert in a fresh interpreter that imports only what the CLI's convert imports (no
torch: the default path does not need it), its timings written to the result file."""


LLMC_SCRIPT = """
import sys
from llmcompressor import model_free_ptq
model_free_ptq(model_stub=sys.argv[1], save_directory=sys.argv[2], scheme="FP8_DYNAMIC",
               ignore=["lm_head"], max_workers=2, device="cpu")
"""


def peer_venvs(given: Path | None) -> list[Path]:
    """Where the llm-compressor peer venv may be, in order (module docstring, step 3)."""
    if given is not None:
        return [given]
    if os.environ.get("FP8EXPORT_PEER_VENV"):
        return [Path(os.environ["FP8EXPORT_PEER_VENV"])]
    found = [REPO / ".venv-peers"]
    common = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--path-format=absolute",
                             "--git-common-dir"], capture_output=True, text=True)
    if common.returncode == 0 and common.stdout.strip():  # a worktree: its main checkout's
        found.append(Path(common.stdout.strip()).parent / ".venv-peers")
    return found


def llmc_runner(venv: Path | None, pythonpath: str | None) -> tuple[str, dict] | None:
    """(interpreter, environment) under which llm-compressor imports, or None."""
    candidates = [(str(v / "bin" / "python"), dict(os.environ)) for v in peer_venvs(venv)
                  if (v / "bin" / "python").exists()]
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    candidates.append((sys.executable, env))
    for python, env in candidates:
        if subprocess.run([python, "-c", "import llmcompressor"], env=env,
                          capture_output=True).returncode == 0:
            return python, env
    return None


def llmc_version(llmc: tuple[str, dict]) -> str:
    python, env = llmc
    out = subprocess.run([python, "-c", "import llmcompressor as m; print(m.__version__)"],
                         env=env, capture_output=True, text=True).stdout.strip()
    return f"{(out.splitlines() or [''])[-1]} ({python})"  # its import logs a line first


def timed_run(argv: list[str], out: Path, log: Path, env: dict | None = None) -> dict:
    """Run ``argv``; then fsync everything under ``out``. Seconds, fsync, peak RSS."""
    r = run_measured(argv, log, env=env, sample_every=0.02)
    ok = r.returncode == 0 and out.exists()
    sync = fsync_tree(out) if ok else 0.0
    if not ok:
        print(log.read_text()[-3000:], file=sys.stderr)
    return {"exit": r.returncode, "seconds": r.seconds, "fsync_seconds": sync,
            "total_seconds": r.seconds + sync, "peak_rss_bytes": r.peak_hwm_bytes,
            "ru_maxrss_bytes": r.peak_rss_bytes, "cpu_seconds": r.cpu_seconds,
            "output_bytes": tree_bytes(out) if ok else 0}


def best(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["exit"] == 0] or runs
    b = dict(min(ok, key=lambda r: r["total_seconds"]))
    b["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)  # the worst counts
    b["rounds_total_seconds"] = [round(r["total_seconds"], 2) for r in runs]
    return b


BREAKDOWN = [  # (row, keys summed) -- worker-seconds except the "wall:" keys
    ("start-up (interpreter, imports)", ["startup"]),
    ("open + select", ["wall: open checkpoint", "wall: select"]),
    ("read source (amax scan)", ["scan: read source"]),
    ("amax", ["scan: amax"]),
    ("sha256 of source (manifest; from the write pass's reads)", ["hash: read source",
                                                                   "hash: sha256 of source"]),
    ("read source (write pass)", ["write: read source"]),
    ("quantize + SQNR", ["write: quantize + SQNR"]),
    ("write FP8 (pwrite)", ["write: pwrite output"]),
    ("sha256 of output (manifest)", ["write: sha256 output"]),
    ("fsync shards", ["write: fsync"]),
    ("read-back", ["wall: read-back"]),
    ("config, index, manifest, publish", ["wall: config, index, loader files",
                                          "wall: manifest + publish", "wall: scales + plan"]),
    ("convert() total (wall)", ["wall: total"]),
]


def breakdown_rows(runs: dict[int, dict]) -> list[tuple]:
    rows = []
    for label, keys in BREAKDOWN:
        cells = [label]
        for n in sorted(runs):
            t = runs[n]["timings"]
            cells.append(f"{sum(t.get(k, 0.0) for k in keys):.2f}")
        rows.append(tuple(cells))
    for stage in ("scan (amax)", "write shards", "read-back"):
        rows.append((f"stage wall: {stage}", *[
            f"{runs[n]['timings'].get('wall: ' + stage, 0.0):.2f}" for n in sorted(runs)]))
    rows.append(("total wall (process)", *[f"{runs[n]['seconds']:.2f}" for n in sorted(runs)]))
    return rows


RATES = [  # (row, Timings step): MB/s of the bytes the step went through
    ("scan: read + amax of the weights, source bytes (wall)", "wall: scan (amax)"),
    ("  amax (per worker-second)", "scan: amax"),
    ("sha256 of source (per worker-second)", "hash: sha256 of source"),
    ("quantize + SQNR, source bytes (per worker-second)", "write: quantize + SQNR"),
    ("pwrite output (per worker-second)", "write: pwrite output"),
    ("sha256 of output (per worker-second, waits included)", "write: sha256 output"),
    ("write shards, output bytes (wall)", "wall: write shards"),
    ("read-back, output bytes (wall)", "wall: read-back"),
]


def rate_rows(runs: dict[int, dict]) -> list[tuple]:
    return [(label, *[f"{runs[n]['timings'].get('MB/s: ' + key, 0.0):.0f}"
                      for n in sorted(runs)]) for label, key in RATES]


def bench_size(args, size_gb: float, llmc: tuple[str, dict] | None, rounds: int) -> dict:
    size = int(size_gb * GB)
    ckpt = args.work / f"ckpt-{size_gb:g}gb"
    plan_file = ckpt / "bench_plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    shard = int(size / 5 * 1.08)  # greedy filling then gives five shards
    if not (plan and (plan["requested_bytes"], plan["shard_bytes"], plan["seed"],
                      plan.get("generator")) == (size, shard, args.seed, "pool-v1")):
        shutil.rmtree(ckpt, ignore_errors=True)
        print(f"generating a {size_gb:g} GB Llama-shaped bf16 checkpoint in {ckpt}", flush=True)
        plan = generate(ckpt, size, shard, args.seed)
    else:
        print(f"re-using {ckpt}", flush=True)
    copy, out = args.work / "copy", args.work / "out"
    for p in (copy, out):
        shutil.rmtree(p, ignore_errors=True)
    fsync_tree(ckpt)
    warm = read_all(ckpt)
    print(f"warm-up read of {fmt_bytes(plan['size_bytes'])}: {warm:.1f} s", flush=True)

    runs: dict[str, list[dict]] = {"cp": []}
    details: dict[int, list[dict]] = {n: [] for n in args.workers}
    for rnd in range(1, rounds + 1):
        r = timed_run(["cp", "-r", str(ckpt), str(copy)], copy, args.work / "cp.log")
        if r["exit"] != 0:
            sys.exit("cp -r failed")
        runs["cp"].append(r)
        shutil.rmtree(copy)
        print(f"[{size_gb:g} GB, round {rnd}] cp -r + fsync: {r['total_seconds']:.2f} s",
              flush=True)
        for n in args.workers:
            res = args.work / f"timings-{n}.json"
            argv = [sys.executable, "-c", CHILD_SCRIPT, str(ckpt), str(out), str(n), str(res)]
            env = dict(os.environ, CI="1", PYTHONPATH=str(REPO))
            r = timed_run(argv, out, args.work / f"convert-{n}.log", env=env)
            if r["exit"] == 0:
                child = json.loads(res.read_text())
                r["timings"] = dict(child["timings"])
                r["timings"]["startup"] = r["seconds"] - child["convert_seconds"]
            runs.setdefault(f"convert_w{n}", []).append(r)
            details[n].append(r)
            shutil.rmtree(out, ignore_errors=True)
            print(f"[{size_gb:g} GB, round {rnd}] convert --workers {n}: exit {r['exit']}, "
                  f"{r['total_seconds']:.2f} s, peak RSS {fmt_bytes(r['peak_rss_bytes'])}",
                  flush=True)
        if llmc is not None:
            argv = [llmc[0], "-c", LLMC_SCRIPT, str(ckpt), str(out)]
            r = timed_run(argv, out, args.work / "llmc.log", env=llmc[1])
            runs.setdefault("llmcompressor", []).append(r)
            shutil.rmtree(out, ignore_errors=True)
            print(f"[{size_gb:g} GB, round {rnd}] llm-compressor model_free_ptq: exit "
                  f"{r['exit']}, {r['total_seconds']:.2f} s, peak RSS "
                  f"{fmt_bytes(r['peak_rss_bytes'])}", flush=True)

    summary = {name: best(rs) for name, rs in runs.items()}
    largest = plan["largest_tensor_bytes"]
    cp_t = summary["cp"]["total_seconds"]
    targets = {}
    w1 = summary.get(f"convert_w{min(args.workers)}")
    for n in args.workers:
        s = summary[f"convert_w{n}"]
        ok = s["exit"] == 0
        limit = int(0.75 * GiB + 2 * largest * n)
        t = {"convert_over_cp": round(s["total_seconds"] / cp_t, 3),
             "convert_over_cp_pass": ok and s["total_seconds"] / cp_t <= 2.0,
             "peak_rss_bytes": s["peak_rss_bytes"], "rss_limit_bytes": limit,
             "rss_pass": ok and s["peak_rss_bytes"] <= limit}
        if "llmcompressor" in summary and summary["llmcompressor"]["exit"] == 0:
            ratio = summary["llmcompressor"]["total_seconds"] / s["total_seconds"]
            t["llmc_over_convert"] = round(ratio, 2)
            t["llmc_over_convert_pass"] = ok and ratio >= 5.0
        if n != min(args.workers) and w1 is not None:
            speed = w1["total_seconds"] / s["total_seconds"]
            t[f"speedup_over_{min(args.workers)}_worker"] = round(speed, 2)
            t["speedup_pass"] = ok and speed >= 1.6 * (n / 2 if n > 2 else 1)
        targets[f"workers_{n}"] = t
    best_runs = {n: min((r for r in details[n] if r["exit"] == 0),
                        key=lambda r: r["total_seconds"]) for n in args.workers
                 if any(r["exit"] == 0 for r in details[n])}
    return {"size_gb": size_gb,
            "checkpoint": {"bytes": plan["size_bytes"], "shards": plan["shards"],
                           "tensors": plan["tensors"], "largest_tensor": plan["largest_tensor"],
                           "largest_tensor_bytes": largest,
                           "config": {k: plan["config"][k] for k in (
                               "hidden_size", "intermediate_size", "num_hidden_layers",
                               "vocab_size")}},
            "warmup_read_seconds": round(warm, 2), "rounds": runs, "best": summary,
            "targets": targets,
            "breakdown_seconds": {n: r["timings"] for n, r in best_runs.items()},
            "_breakdown_rows": breakdown_rows(best_runs) if best_runs else [],
            "_rate_rows": rate_rows(best_runs) if best_runs else []}


def render(result: dict) -> str:
    lines = []
    for s in result["sizes"]:
        ck = s["checkpoint"]
        lines += [f"## {ck['bytes'] / GB:.2f} GB ({fmt_bytes(ck['bytes'])}), {ck['shards']} "
                  f"shards, {ck['tensors']} tensors, largest {ck['largest_tensor']} "
                  f"({fmt_bytes(ck['largest_tensor_bytes'])})", ""]
        rows = []
        cp_t = s["best"]["cp"]["total_seconds"]
        for name, b in s["best"].items():
            rows.append((name, f"{b['seconds']:.2f} + {b['fsync_seconds']:.2f} = "
                               f"{b['total_seconds']:.2f}",
                         f"{b['total_seconds'] / cp_t:.2f}x", fmt_bytes(b["peak_rss_bytes"]),
                         f"{b.get('cpu_seconds', 0.0):.2f}",
                         ", ".join(f"{x:.2f}" for x in b["rounds_total_seconds"]),
                         b["exit"]))
        lines += [md_table(rows, ("contender", "seconds + fsync = total (best round)",
                                  "/ cp", "peak RSS (worst)", "CPU s (user+sys, best round)",
                                  "each round", "exit")), ""]
        trows = []
        for key, t in s["targets"].items():
            n = key.split("_")[1]
            trows.append((f"--workers {n}: convert / (cp -r + fsync) <= 2.0 (aim 1.5)",
                          f"{t['convert_over_cp']:.2f}", _pf(t["convert_over_cp_pass"])))
            if "llmc_over_convert" in t:
                trows.append((f"--workers {n}: llm-compressor / convert >= 5",
                              f"{t['llmc_over_convert']:.2f}", _pf(t["llmc_over_convert_pass"])))
            trows.append((f"--workers {n}: peak RSS <= 0.75 GiB + 2 x largest x {n}",
                          f"{fmt_bytes(t['peak_rss_bytes'])} (limit "
                          f"{fmt_bytes(t['rss_limit_bytes'])})", _pf(t["rss_pass"])))
            for k, v in t.items():
                if k.startswith("speedup_over"):
                    trows.append((f"--workers {n}: throughput / 1 worker >= 1.6", f"{v:.2f}",
                                  _pf(t["speedup_pass"])))
        lines += [md_table(trows, ("target", "measured", "")), ""]
        if s["_breakdown_rows"]:
            heads = ("step (seconds; worker-seconds summed over threads)",
                     *[f"--workers {n}" for n in sorted(s["breakdown_seconds"])])
            lines += ["Where convert's time goes (best round):", "",
                      md_table(s["_breakdown_rows"], heads), ""]
            heads = ("stage (MB/s, 10^6 bytes per second)",
                     *[f"--workers {n}" for n in sorted(s["breakdown_seconds"])])
            lines += ["Throughput per stage (best round):", "",
                      md_table(s["_rate_rows"], heads), ""]
    return "\n".join(lines)


def _pf(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2.1", help="checkpoint sizes in GB, comma-separated")
    ap.add_argument("--large", action="store_true",
                    help="also the largest size that leaves 5 GB free beside a copy")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--large-rounds", type=int, default=1, help="rounds at the --large size")
    ap.add_argument("--name", default="convert", help="result file stem (default convert)")
    ap.add_argument("--workers", default="1,2", help="convert --workers values, comma-separated")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8export-bench"))
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llmc-venv", type=Path, default=None,
                    help="venv whose python runs llm-compressor (default: $FP8EXPORT_PEER_VENV, "
                         "else .venv-peers here or in the main checkout)")
    ap.add_argument("--llmc-pythonpath", default=None,
                    help="else: extra PYTHONPATH under which llmcompressor imports here")
    ap.add_argument("--no-llmc", action="store_true", help="skip llm-compressor")
    ap.add_argument("--llmc-all-sizes", action="store_true",
                    help="run llm-compressor at every size (default: the first only)")
    args = ap.parse_args(argv)
    args.workers = sorted({int(w) for w in args.workers.split(",")})
    sizes = [float(s) for s in args.sizes.split(",") if s]
    args.work.mkdir(parents=True, exist_ok=True)
    if args.large:
        # source + copy (the copy is deleted before convert writes), 5 GB left over
        generated = sum(p.stat().st_size for p in args.work.rglob("*") if p.is_file())
        free = shutil.disk_usage(args.work).free + generated
        sizes.append(math.floor((free - 5 * GB) / 2.0 / GB))
    n_plain = len(sizes) - (1 if args.large else 0)
    machine = machine_info(args.work)
    llmc = None if args.no_llmc else llmc_runner(args.llmc_venv, args.llmc_pythonpath)
    if llmc is None and not args.no_llmc:
        print("llm-compressor is not importable: skipped (see --llmc-venv)", flush=True)
    results = []
    for i, size_gb in enumerate(sizes):
        # source + its copy (deleted before convert runs, whose output is about half) + 5 GB
        need = (2.0 * size_gb + 5) * GB
        free = shutil.disk_usage(args.work).free
        if free < need:
            sys.exit(f"need about {need / GB:.1f} GB free under {args.work}, have {free / GB:.1f}")
        results.append(bench_size(args, size_gb,
                                  llmc if (i == 0 or args.llmc_all_sizes) else None,
                                  args.rounds if i < n_plain else args.large_rounds))
    result = {"benchmark": "convert",
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine, "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
              "llmcompressor": llmc_version(llmc) if llmc else None,
              "method": ("page cache warm (source fsynced, then read once); per round cp -r + "
                         "fsync, convert per --workers, llm-compressor; best round compared, "
                         "worst peak RSS (VmHWM sampled every 20 ms)"),
              "sizes": results}
    table = render(result)
    print("\n" + table, flush=True)
    for s in result["sizes"]:
        s.pop("_breakdown_rows")
        s.pop("_rate_rows")
    write_json(args.results / f"{args.name}.json", result)
    load = machine["load_avg_1m_at_start"]
    loaded = max(load, result["load_avg_1m_at_end"]) > QUIET_LOAD * machine["cores"] / 2
    md = ["# convert benchmark" + (f" (LOADED machine: 1-min load {load} at start on "
                                   f"{machine['cores']} cores; not comparable with a quiet run)"
                                   if loaded else ""), "",
          f"`bench/convert.py --sizes {args.sizes!r}{' --large' if args.large else ''} --rounds "
          f"{args.rounds}{' --no-llmc' if args.no_llmc else ''}` on {result['date_utc']}, "
          f"commit {machine['git_commit']}"
          + (f" + uncommitted {', '.join(machine['git_uncommitted_code'])}"
             if machine["git_uncommitted_code"] else "") + ".", "",
          f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']} GiB RAM, "
          f"{machine['disk']['filesystem']}; load average (1 min) {machine['load_avg_1m_at_start']}"
          f" at start, {result['load_avg_1m_at_end']} at end. llm-compressor "
          f"{result['llmcompressor'] or 'not run'}.", "",
          f"Method: {result['method']}.", "", table]
    (args.results / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.results / args.name}.json and .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
