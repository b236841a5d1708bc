"""Helpers shared by the benchmarks: machine description, peak-RSS measurement, result files."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3
MiB = 1024**2


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine_info(work_dir: Path) -> dict:
    """Cores, CPU model, RAM, the disk under ``work_dir``, and software versions."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor())
    mem_kib = next((int(ln.split()[1]) for ln in _read("/proc/meminfo").splitlines()
                    if ln.startswith("MemTotal:")), 0)
    du = shutil.disk_usage(work_dir)
    fs = ""
    try:
        out = subprocess.run(["df", "-T", str(work_dir)], capture_output=True, text=True).stdout
        parts = out.splitlines()[-1].split()
        fs = f"{parts[0]} ({parts[1]})"
    except (OSError, IndexError):
        pass
    versions = {"python": platform.python_version()}
    for mod in ("torch", "safetensors", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    # Benchmarks run the working tree: say when the measured code differs from the commit.
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "fp8export",
                            "calibration"], capture_output=True, text=True).stdout.split("\n")
    dirty = sorted(ln[3:] for ln in dirty if ln.strip())
    return {
        "git_uncommitted_code": dirty,
        "cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_kib / 1024**2, 1),
        "disk": {"filesystem": fs, "total_gib": round(du.total / GiB, 1),
                 "free_gib": round(du.free / GiB, 1)},
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        "platform": platform.platform(), "versions": versions, "git_commit": commit,
    }


@dataclass
class RunResult:
    argv: list[str]
    returncode: int
    seconds: float
    peak_rss_bytes: int  # ru_maxrss of the process (and its waited-for children), from wait4
    # (t, VmRSS, RssAnon, RssFile) in bytes: anonymous memory is what the process allocated;
    # file pages are mmap-ed files (e.g. safetensors) that the kernel can drop, but that still
    # count in RSS and in ru_maxrss.
    rss_samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    log: Path | None = None
    cpu_seconds: float = 0.0  # user + system CPU time of the process (and its waited children)
    # Largest VmHWM sampled from /proc/<pid>/status: the high-water mark of the program itself.
    # ru_maxrss also counts the memory of the process that spawned it (Linux carries the
    # pre-exec high-water mark over exec), so it overstates a small program started by a large
    # one; VmHWM can only miss growth in the last sampling interval.
    peak_hwm_bytes: int = 0

    def peak_sampled(self, index: int) -> int:
        return max((s[index] for s in self.rss_samples), default=0)


def run_measured(argv: list[str], log: Path, sample_every: float = 0.25,
                 env: dict | None = None) -> RunResult:
    """Run ``argv`` to completion; wall time, exact peak RSS (wait4) and a coarse RSS timeline.

    The peak comes from the kernel's own high-water mark (``ru_maxrss`` of this one child, via
    ``os.wait4``), so short spikes between samples are not missed; the samples only show when
    memory was used.
    """
    samples: list[tuple[float, int, int, int]] = []
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()
        hwm = [0]

        def sample():
            status = f"/proc/{proc.pid}/status"
            while not done.wait(sample_every):
                kib = {}
                for ln in _read(status).splitlines():
                    key = ln.split(":", 1)[0]
                    if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                        kib[key] = int(ln.split()[1]) * 1024
                hwm[0] = max(hwm[0], kib.get("VmHWM", 0))
                if "VmRSS" in kib:
                    samples.append((round(time.perf_counter() - t0, 2), kib["VmRSS"],
                                    kib.get("RssAnon", 0), kib.get("RssFile", 0)))

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        done.set()
        th.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    return RunResult(argv, proc.returncode, seconds, usage.ru_maxrss * 1024, samples, log,
                     usage.ru_utime + usage.ru_stime, hwm[0])


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - t0


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def md_table(rows: list[tuple], header: tuple) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def fp8export_argv() -> list[str]:
    """The console script beside this interpreter, else ``python -m fp8export.cli``."""
    script = Path(sys.executable).with_name("fp8export")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "fp8export.cli"]
