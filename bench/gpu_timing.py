"""Timing and profiling helpers of the GPU benchmarks (``bench/gpu_fp8.py``): CUDA-event
timings, CUDA-graph replays, torch.profiler kernel tables and Dynamo's compile counters."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def log_row(row: dict) -> None:
    print("  " + "  ".join(f"{k}={v}" for k, v in row.items() if not k.endswith("_profile")),
          flush=True)

def time_cuda(fn, min_time: float = 0.5, warmup: int = 3) -> list[float]:
    """Per-call milliseconds via CUDA events, repeated until ~min_time seconds are covered."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    start_wall = time.perf_counter()
    while time.perf_counter() - start_wall < min_time or len(times) < 5:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times

def median_ms(fn, min_time: float = 0.5) -> float:
    return round(statistics.median(time_cuda(fn, min_time)), 4)

def graph_ms(fn, reps: int = 20, min_time: float = 0.2) -> float:
    """Device time per call of ``fn``: ``reps`` calls captured in one CUDA graph, replayed.

    Single kernels of a few microseconds cannot be timed with events around a Python call:
    the host's launch cost (20-50 us on the benchmark host) lands inside the interval.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return round(statistics.median(time_cuda(graph.replay, min_time)) / reps, 5)

SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpyAsync")

def kernel_category(name: str) -> str:
    """Coarse class of a CUDA kernel name, for the profile tables."""
    low = name.lower()
    if low.startswith("triton"):  # Inductor's names list every op fused in, attention's too
        return "Inductor (Triton)"
    if any(k in low for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if "_fp8_gemm_small_m" in low:
        return "gemm (Triton FP8)"
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass", "splitk", "cublas")):
        return "gemm (cuBLAS)"
    if "_quant_e4m3" in low:
        return "quantize (Triton)"
    if "memcpy" in low or "memset" in low:
        return "memcpy/memset"
    return "aten other"

def profile_calls(fn, reps: int, top: int = 12) -> dict:
    """``reps`` calls of ``fn`` under torch.profiler: device time per call by kernel class, the
    top kernels, launches and host-blocking CUDA calls per call (device times in us)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels, syncs, graph_launches = {}, {}, 0
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            k = kernels.setdefault(e.key, [0, 0.0])
            k[0] += e.count
            k[1] += e.self_device_time_total
        elif e.key in SYNC_CALLS:
            syncs[e.key] = round(e.count / reps, 2)
        elif e.key == "cudaGraphLaunch":
            graph_launches = e.count / reps
    by_class: dict[str, float] = {}
    for name, (_, us) in kernels.items():
        cat = kernel_category(name)
        by_class[cat] = by_class.get(cat, 0.0) + us / reps
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {
        "device_us": round(sum(us for _, us in kernels.values()) / reps, 1),
        "kernels": round(sum(n for n, _ in kernels.values()) / reps, 1),
        "by_class_us": {k: round(v, 1) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top": [{"kernel": name[:110], "class": kernel_category(name), "per_call": n / reps,
                 "us": round(us / reps, 1)} for name, (n, us) in rows[:top]],
        "host_blocking_calls": syncs, "graph_launches": graph_launches,
    }

def host_and_wall_ms(fn, reps: int) -> tuple[float, float]:
    """(host ms per call to enqueue, wall ms per call until the device is done), ``reps`` calls
    back to back. Host ~ wall with the device mostly idle means the host is the bound."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return round((t1 - t0) / reps * 1e3, 3), round((t2 - t0) / reps * 1e3, 3)

def _host_bucket(file: str, func: str) -> str:
    """Where a cProfile entry's own time goes: a C function by its name (``torch`` ops, their
    launches and CUDA calls included), else the package (and subpackage) of its source file."""
    if file == "~":
        return "C: torch" if "torch" in func or "_C." in func else "C: other"
    parts = Path(file).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            rest = parts[parts.index(anchor) + 1:]
            return "/".join(rest[:2]) if len(rest) > 2 and rest[0] == "torch" else rest[0]
    if "fp8export" in parts:
        rest = parts[parts.index("fp8export") + 1:]
        return "fp8export/" + rest[0].removesuffix(".py") if len(rest) > 1 else "fp8export"
    return "python (stdlib, bench)"


def host_profile(fn, reps: int, top: int = 12) -> dict:
    """Where the host's time per call of ``fn`` goes: ``reps`` calls under cProfile (the
    device runs on asynchronously), own time per call by package (:func:`_host_bucket`) and
    the functions with the most own time (us). The profiler's own cost inflates Python time,
    so compare two models' tables with each other, not with the unprofiled host time."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    host = time.perf_counter() - t0
    sync()
    rows, buckets = [], {}
    for (file, line, func), (_cc, calls, own, cum, _callers) in pstats.Stats(prof).stats.items():
        bucket = _host_bucket(file, func)
        buckets[bucket] = buckets.get(bucket, 0.0) + own
        rows.append((own, cum, calls, f"{Path(file).name}:{line}({func})"[:120], bucket))
    rows.sort(reverse=True)
    us = 1e6 / reps
    return {"host_us_per_call_profiled": round(host * us, 1),
            "by_package_us": {k: round(v * us, 1) for k, v in
                              sorted(buckets.items(), key=lambda kv: -kv[1]) if v * us >= 1},
            "top_own": [{"function": name, "package": bucket, "calls": round(calls / reps, 2),
                         "own_us": round(own * us, 1), "cum_us": round(cum * us, 1)}
                        for own, cum, calls, name, bucket in rows[:top]]}


def reset_dynamo() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

def dynamo_stats() -> dict:
    """Since the last ``torch._dynamo.reset()``: graph breaks, graphs compiled, CUDA graphs
    skipped, and Inductor's / AOTAutograd's cache hits and misses (a warm cache from another
    process turns a compile into a trace and a lookup)."""
    c = torch._dynamo.utils.counters
    return {"graph_breaks": sum(c["graph_break"].values()),
            "unique_graphs": c["stats"].get("unique_graphs", 0),
            "cudagraph_skips": c["inductor"].get("cudagraph_skips", 0),
            "fxgraph_cache_hit": c["inductor"].get("fxgraph_cache_hit", 0),
            "fxgraph_cache_miss": c["inductor"].get("fxgraph_cache_miss", 0),
            "fxgraph_cache_bypass": c["inductor"].get("fxgraph_cache_bypass", 0),
            "autograd_cache_hit": c["aot_autograd"].get("autograd_cache_hit", 0)}

def bound_compile_work(recompile_limit: int) -> None:
    """Static shapes are compiled once each; a recompile beyond ``recompile_limit`` per frame
    is an error (not a silent fall-back to eager that would be timed as 'compiled'), and every
    recompile is logged with the guard that failed."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across releases
        if hasattr(cfg, name):
            setattr(cfg, name, recompile_limit)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
