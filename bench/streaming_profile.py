#!/usr/bin/env python
"""Where the streamed observation pass spends its time (README "Models larger than one GPU").

    python bench/streaming_profile.py --out /tmp/prof          # a GPU
    python bench/streaming_profile.py --smoke --device cpu --out /tmp/prof

One process, on the Llama layer shape of ``bench/streaming.py`` (fewer layers: ``--layers``):

1. **Rates** that bound a layer's streaming: reading 200 MB of a shard (into fresh and into
   page-locked memory), host-to-device copies from pageable and page-locked memory, and one
   layer's compute on every batch with everything on the GPU.
2. **The pass, whole and streamed** (``calibrate``, the same options as ``streaming.py``'s (a)),
   the streamed one with timed sections: reading a layer (the prefetch thread), building it
   (waiting for the read, putting it on the device), the batches through it (``Stream.run``),
   collections forced by ``Blocks.build``; the pass's seconds from ``CalibrationResult``.
3. **torch.profiler** over the streamed pass of a model of ``--trace-layers`` layers: GPU busy
   time (the union of kernel and copy intervals) against the wall, the largest gaps, and the
   operators by host and device time.

Writes ``profile.json`` and ``profile.md`` (and ``trace.json.gz``) under ``--out``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streaming import BIG, SMOKE, GiB, _cap, measured, warm_up, write_data, write_model  # noqa: E402


def rates(work: Path, device: str, out: dict) -> None:
    import torch

    n = 200 << 20
    path = work / "rates.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * (n >> 20))
    fd = os.open(path, os.O_RDONLY)
    r = out["rates"] = {}
    try:
        from fp8export.checkpoint.safetensors_reader import pread_exact

        for label, pin in (("read_fresh", False), ("read_pinned", device == "cuda")):
            best = 1e9
            buf = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
            for rep in range(3):
                if label == "read_fresh":
                    buf = torch.empty(n, dtype=torch.uint8)
                t0 = time.perf_counter()
                pread_exact(fd, buf.numpy(), 0)
                best = min(best, time.perf_counter() - t0)
            r[label + "_GBps"] = round(n / best / 1e9, 2)
    finally:
        os.close(fd)
        path.unlink()
    if device != "cuda":
        return
    for label, pin in (("h2d_pageable", False), ("h2d_pinned", True)):
        src = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        src.fill_(1)
        best = 1e9
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            src.to("cuda", non_blocking=pin)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        r[label + "_GBps"] = round(n / best / 1e9, 2)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    r["d2h_pinned_GBps"] = round(n / (time.perf_counter() - t0) / 1e9, 2)


class Sections:
    """Timed sections by name: count and seconds (thread-safe enough for one extra thread)."""

    def __init__(self):
        self.t: dict[str, list[float]] = {}
        self.peaks: dict[str, int] = {}

    def add(self, name: str, s: float) -> None:
        self.t.setdefault(name, []).append(s)

    def wrap(self, owner, attr: str, name: str, sync: bool = False, peak: bool = False):
        """``owner.attr`` timed (``sync``: the GPU's work included); ``peak``: the largest GPU
        memory allocated during each call (top-level sections only: it resets the peak)."""
        import torch

        fn = getattr(owner, attr)
        peak = peak and torch.cuda.is_available()

        def timed(*a, **kw):
            if peak:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if sync and torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.add(name, time.perf_counter() - t0)
                if peak:
                    self.peaks[name] = max(self.peaks.get(name, 0),
                                           torch.cuda.max_memory_allocated())

        setattr(owner, attr, timed)
        return lambda: setattr(owner, attr, fn)

    def summary(self) -> dict:
        return {k: {"n": len(v), "total_s": round(sum(v), 3),
                    "mean_ms": round(1000 * sum(v) / len(v), 2),
                    **({"peak_gpu_MiB": round(self.peaks[k] / 2**20)} if k in self.peaks
                       else {})} for k, v in self.t.items()}


def calibrate(args, src: Path, calib: Path, work: Path, name: str, kw: dict):
    from fp8export import api
    from fp8export.calibration.config import CalibrateConfig

    res, sec, peak = measured(lambda: api.calibrate(CalibrateConfig(
        checkpoint=src, calib_data=calib, batch_size=args.batch_size, seq_len=args.seq_len,
        device=args.device, calib_samples=args.calib_samples, output=work / f"amax-{name}.json",
        force=True, **kw)))
    return {"seconds": round(sec, 2), "pass_s": round(res.seconds, 3), "peak_gpu_bytes": peak,
            "tier": (res.streaming or {}).get("tier")}


def sectioned(args, src, calib, work) -> dict:
    """The streamed calibrate with its sections timed."""
    import gc

    from fp8export.streaming import parts as parts_mod
    from fp8export.streaming import stream as stream_mod

    s = Sections()
    undo = [s.wrap(stream_mod.Prefetcher, "_read", "read a layer (prefetch thread)"),
            s.wrap(stream_mod.Prefetcher, "get", "wait for the read (main thread)"),
            s.wrap(stream_mod.Blocks, "build", "build a block (main thread, all)", sync=True,
                   peak=True),
            s.wrap(parts_mod, "materialize", "materialize (tensors to the device)"),
            s.wrap(stream_mod.Stream, "run", "batches through a block (Stream.run)", sync=True,
                   peak=True),
            s.wrap(stream_mod.Stream, "capture", "capture (embedding)", sync=True, peak=True),
            s.wrap(gc, "collect", "gc.collect")]
    try:
        r = calibrate(args, src, calib, work, "streamed-sections",
                      {"offload": "layers", "max_memory": _cap(args, args.cap_calib_gib)})
    finally:
        for u in undo:
            u()
    r["sections"] = s.summary()
    return r


def busy(events) -> dict:
    """GPU busy time (union of device intervals) and the largest idle gaps."""
    iv = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events)
    if not iv:
        return {}
    merged = [list(iv[0])]
    for a, b in iv[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = merged[-1][1] - merged[0][0]
    on = sum(b - a for a, b in merged)
    gaps = sorted((merged[i + 1][0] - merged[i][1] for i in range(len(merged) - 1)),
                  reverse=True)
    hist = {f">{t}us": round(sum(g for g in gaps if g > t) / 1e3, 1) for t in (10, 100, 1000,
                                                                             10000)}
    return {"span_ms": round(total / 1e3, 1), "busy_ms": round(on / 1e3, 1),
            "busy_fraction": round(on / max(total, 1), 3),
            "largest_gaps_ms": [round(g / 1e3, 2) for g in gaps[:12]],
            "idle_ms_in_gaps": hist}


def profiled(args, work, cfg, out_dir: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    small = work / "trace-model"
    write_model(small, {**cfg, "num_hidden_layers": args.trace_layers}, "cpu"
                if args.device != "cuda" else "cuda")
    calib = work / "calib.npz"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts, record_shapes=False) as prof:
        r = calibrate(args, small, calib, work, "traced",
                      {"offload": "layers", "max_memory": _cap(args, args.cap_calib_gib)})
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    data = json.loads(trace.read_text())
    with gzip.open(out_dir / "trace.json.gz", "wt") as f:
        json.dump(data, f)
    trace.unlink()
    ev = data.get("traceEvents", [])
    dev = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                   "gpu_memset")]
    r["gpu"] = busy(dev)
    r["copies_ms"] = {}
    for e in dev:
        if e.get("cat") == "gpu_memcpy":
            k = e.get("name", "")
            r["copies_ms"][k] = round(r["copies_ms"].get(k, 0) + e.get("dur", 0) / 1e3, 1)
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    r["top_ops"] = prof.key_averages().table(sort_by=sort, row_limit=25)
    r["top_cpu"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    del data
    torch.cuda.empty_cache() if args.device == "cuda" else None
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--trace-layers", type=int, default=6)
    ap.add_argument("--cap-calib-gib", type=float, default=1.25)
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--parts", default="rates,whole,streamed,sections,trace")
    args = ap.parse_args()
    import tempfile

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="fp8export-bench-profile-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = dict(SMOKE if args.smoke else BIG)
    cfg["num_hidden_layers"] = args.layers if not args.smoke else cfg["num_hidden_layers"]
    out: dict = {"device": (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                            else "cpu"), "torch": torch.__version__,
                 "args": {k: str(v) for k, v in vars(args).items()}, "model": cfg}

    def save():
        (args.out / "profile.json").write_text(json.dumps(out, indent=1, default=str))

    parts = args.parts.split(",")
    try:
        if "rates" in parts:
            rates(work, args.device, out)
            save()
        src = work / "model"
        out["weights_bytes"] = write_model(src, cfg, "cuda" if args.device == "cuda" else "cpu")
        warm_up(work, args)
        calib = write_data(work / "calib.npz", args.calib_samples, args.seq_len,
                           cfg["vocab_size"])
        if "streamed" in parts:
            out["streamed"] = calibrate(args, src, calib, work, "streamed", {
                "offload": "layers", "max_memory": _cap(args, args.cap_calib_gib)})
            save()
        if "whole" in parts:
            free = torch.cuda.mem_get_info()[0] / GiB if args.device == "cuda" else 16
            out["whole"] = calibrate(args, src, calib, work, "whole", {
                "offload": "none", "max_memory": _cap(args, int(free * 0.9))})
            a, b = (json.loads((work / f"amax-{n}.json").read_text()) for n in
                    ("whole", "streamed")) if "streamed" in parts else (None, None)
            if a is not None:
                out["amax_identical"] = a.get("modules") == b.get("modules")
                out["pass_ratio"] = round(out["whole"]["pass_s"] / out["streamed"]["pass_s"],
                                          3)
            save()
        if "sections" in parts:
            out["sectioned"] = sectioned(args, src, calib, work)
            save()
        if "trace" in parts:
            out["trace"] = profiled(args, work, cfg, args.out)
            save()
    except Exception:
        import traceback

        out["error"] = traceback.format_exc()[-4000:]
        save()
        print(out["error"], file=sys.stderr)
    save()
    show = {k: v for k, v in out.items() if k != "trace"}
    print(json.dumps(show, indent=1, default=str)[:6000])
    if "trace" in out:
        t = out["trace"]
        print(json.dumps({k: v for k, v in t.items() if not k.startswith("top")}, indent=1))
        print(t.get("top_ops", "")[:5000])
        print(t.get("top_cpu", "")[:4000])


if __name__ == "__main__":
    main()
