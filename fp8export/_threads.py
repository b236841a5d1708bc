"""CPU threads for the work that runs models (calibrate, verify, convert, export-onnx).

Two settings, both left to the user when they set them (``OMP_WAIT_POLICY``,
``OMP_NUM_THREADS``):

* ``OMP_WAIT_POLICY=PASSIVE``, set before torch loads (libgomp, torch's OpenMP runtime, reads it
  once). By default idle OpenMP workers spin after every parallel region; a forward pass
  alternates short parallel GEMMs with single-threaded Python, and on a busy machine the
  spinning takes the cores that work (and the neighbours) needs. Measured on the sample
  (``bench/threads.py``, 2 cores with a load of 6-8 from other work): calibrate 5.0x and verify
  5.8x faster in wall time, with a fifth of the CPU time; convert measured the same on its own
  (``api.convert``). One thread instead of two was as fast within the noise there.
* torch's intra-op threads = the physical cores this process may run on: its CPU affinity mask
  (``taskset``, container cpusets), the cgroup CPU quota (``docker --cpus``), and one thread per
  core, not per hyperthread (siblings share one core's vector units). torch's default counts
  what OpenMP sees, which ignores the quota.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path


def prepare() -> None:
    """Set the OpenMP wait policy for the torch that is about to load (a no-op once loaded)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _physical_cores(cpus: set[int]) -> int:
    """Distinct cores among ``cpus`` (hyperthread siblings counted once), from sysfs."""
    cores = set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            return len(cpus)  # no topology: count every CPU
    return len(cores) or len(cpus)


def _cgroup_quota() -> int | None:
    """CPUs the cgroup v2 quota allows (``cpu.max``: "quota period"), None when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # "max", cgroup v1, not Linux
        return None


def cpu_threads() -> int:
    """The intra-op thread count fitted to this machine (see the module docstring)."""
    cpus = _allowed_cpus()
    n = _physical_cores(cpus)
    quota = _cgroup_quota()
    return max(1, min(n, quota) if quota else n)


def fit_torch() -> int:
    """Give torch :func:`cpu_threads` intra-op threads unless ``OMP_NUM_THREADS`` says
    otherwise; returns the count in use. Call where the torch work starts."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        n = cpu_threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    return torch.get_num_threads()
