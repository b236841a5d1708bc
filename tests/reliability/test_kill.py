"""Crash safety of ``convert``: SIGKILL at random points, and a full disk.

A killed convert must never leave a folder at the output path that looks complete: either there
is no output, or (``--force`` over an old output) the old output is intact. Hidden temporary
siblings (``.<name>.tmp-*``) may remain after SIGKILL — nothing can clean up after a KILL, and
DESIGN.md allows exactly that — and they are counted, not forbidden. Re-running succeeds and
gives the same bytes as an uninterrupted run.

Kill points: the uninterrupted reference run is timed (process start → temporary folder appears
→ published) and its bytes counted. Most trials kill mid-write, once a uniformly random fraction
of those bytes is in the temporary folder (timing alone missed the window on a loaded machine);
some kill at a random moment after the temporary folder appears (up to the measured window plus
10 %: the read-back and the renames), the rest during startup and reading. Seeds are fixed, so
the kill points reproduce.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from reliability_helpers import (
    CLI,
    REPO,
    cli_env,
    mid_checkpoint,
    popen_cli,
    run_cli,
    siblings,
    tiny_checkpoint,
    tree,
    wait_for,
)

STATS: dict[str, int] = {}


def rerun_in_process(*args):
    """The re-run goes through the real CLI in this process (torch already imported: saves
    ~3 s a trial); the killed runs are real processes."""
    import torch
    from click.testing import CliRunner

    from fp8export.cli import cli

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the killed runs (OMP_NUM_THREADS=1): see test_determinism
    try:
        return CliRunner().invoke(cli, [str(a) for a in args])
    finally:
        torch.set_num_threads(threads)


def _count(key: str, n: int = 1) -> None:
    STATS[key] = STATS.get(key, 0) + n


def _timed_reference(ckpt: Path, out: Path) -> tuple[dict, float, float]:
    """Uninterrupted run; returns (tree, seconds from start until the temporary folder
    appeared, seconds from then until the output was published under its name)."""
    start = time.perf_counter()
    proc = popen_cli("convert", ckpt, "-o", out)
    t_tmp = wait_for(lambda: any(p.name.startswith(f".{out.name}.tmp-") for p in siblings(out))
                     or proc.poll() is not None, timeout=600, step=0.0005)
    t_pub = wait_for(lambda: out.exists() or proc.poll() is not None, timeout=600, step=0.0005)
    assert proc.wait(timeout=600) == 0, "the uninterrupted convert failed"
    assert t_tmp is not None and t_pub is not None
    print(f"\nreference: temp folder after {t_tmp:.3f}s, published {t_pub:.3f}s later, "
          f"exit after {time.perf_counter() - start:.2f}s")
    return tree(out), t_tmp, t_pub


def _tmp_bytes(out: Path) -> int:
    """Bytes written so far into the temporary sibling of ``out``."""
    total = 0
    for d in siblings(out):
        if ".tmp-" in d.name:
            for p in d.rglob("*"):
                try:
                    total += p.stat().st_size if p.is_file() else 0
                except FileNotFoundError:  # renamed or removed while we looked
                    pass
    return total


def _writing(proc: subprocess.Popen, out: Path) -> bool:
    """Alive with its temporary folder present (with --force, ``out`` is the old output)."""
    return proc.poll() is None and any(".tmp-" in p.name for p in siblings(out))


def kill_trials(tmp_path: Path, ckpt: Path, n: int, seed: int) -> dict[str, int]:
    ref_out = tmp_path / "reference"
    ref, t_tmp, window = _timed_reference(ckpt, ref_out)
    ref_bytes = sum(p.stat().st_size for p in ref_out.rglob("*") if p.is_file())
    old_out = tmp_path / "old"  # a different valid output: what --force replaces
    made = rerun_in_process("convert", ckpt, "-o", old_out, "--format", "vllm")
    assert made.exit_code == 0, made.output[-3000:]
    old = tree(old_out)
    assert old != ref
    rng = random.Random(seed)
    outcome = {"trials": 0, "no_output": 0, "old_intact": 0, "finished": 0,
               "old_moved_aside": 0, "tmp_left": 0, "killed_writing": 0}
    for trial in range(n):
        force = trial % 3 == 2
        out = tmp_path / f"out-{trial}"
        if force:
            shutil.copytree(old_out, out)
        extra = ("--force",) if force else ()
        proc = popen_cli("convert", ckpt, "-o", out, *extra)
        start = time.perf_counter()
        if trial % 5 == 4:  # during startup / reading
            delay = rng.uniform(0.0, max(t_tmp, 0.05))
            time.sleep(delay)
        elif trial % 5 == 3:  # after the temporary folder appears, at a random moment
            wait_for(lambda: any(p.name.startswith(f".{out.name}.tmp-") for p in siblings(out))
                     or proc.poll() is not None, timeout=600, step=0.001)
            time.sleep(rng.uniform(0.0, window * 1.1))
            outcome["killed_writing"] += _writing(proc, out)
        else:  # mid-write: once a random fraction of the output's bytes is on disk
            target = rng.uniform(0.0, 1.0) * ref_bytes
            wait_for(lambda: _tmp_bytes(out) >= target or proc.poll() is not None,
                     timeout=600, step=0.0005)
            outcome["killed_writing"] += _writing(proc, out)
        proc.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=60)
        elapsed = time.perf_counter() - start
        outcome["trials"] += 1

        # --- what is at the output path must be absent, the old output, or complete
        if out.exists():
            got = tree(out)
            if got == ref:
                outcome["finished"] += 1
                assert code in (0, -signal.SIGKILL)
            else:
                assert force and got == old, (
                    f"trial {trial} (killed after {elapsed:.2f}s): {out} holds neither the old "
                    f"output nor the complete new one: {sorted(got)}")
                outcome["old_intact"] += 1
        else:
            moved = [p for p in siblings(out) if ".old-" in p.name]
            if force:
                # killed between the two renames of the swap: the old output is intact, aside
                assert moved and tree(moved[0]) == old, f"trial {trial}: old output lost"
                outcome["old_moved_aside"] += 1
            else:
                outcome["no_output"] += 1
        outcome["tmp_left"] += sum(".tmp-" in p.name for p in siblings(out))

        # --- a re-run succeeds and gives the reference bytes
        if not force and out.exists() and tree(out) == ref:
            continue  # it had finished: the re-run would only repeat the reference run
        rerun = rerun_in_process("convert", ckpt, "-o", out,
                                 *(("--force",) if out.exists() else ()))
        assert rerun.exit_code == 0, rerun.output[-3000:]
        assert tree(out) == ref, f"trial {trial}: the re-run differs from an uninterrupted run"
    return outcome


def _record(name: str, outcome: dict) -> None:
    for k, v in outcome.items():
        _count(f"{name}.{k}", v)
    print(f"\n{name}: {json.dumps(outcome)}")


def test_sigkill_tiny(tmp_path):
    ckpt = tiny_checkpoint(tmp_path)
    outcome = kill_trials(tmp_path, ckpt, n=10, seed=8)
    _record("tiny", outcome)
    assert outcome["trials"] == 10
    assert outcome["no_output"] + outcome["old_intact"] + outcome["finished"] + \
        outcome["old_moved_aside"] == 10


@pytest.mark.slow
def test_sigkill_large(tmp_path):
    # ~300 MB of bf16 in 3 shards (hidden 2048, 3 layers: ~50 M parameters a layer)
    ckpt = mid_checkpoint(tmp_path, hidden=2048, layers=3, shards=3)
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    assert size > 250e6, size
    outcome = kill_trials(tmp_path, ckpt, n=10, seed=9)
    _record("large", outcome)
    assert outcome["killed_writing"] >= 5  # the write window is long enough to hit


# ---------------------------------------------------------------------------- full disk
# A size-limited tmpfs gives a real ENOSPC (RLIMIT_FSIZE would give EFBIG, a different error).
# Sizes: no room for the first shard; room for part of it; room for the shards but not the
# manifest (the output is ~1.33 MB: 1.32 MB of safetensors, 12 KB manifest, 1 KB config).
# The output goes two folders below the mount point, folders convert creates: they must go too.
DISK_SIZES = ["64k", "700k", "1320k"]
NEW_PARENTS = ("new", "deeper")


def _umount(mnt: Path) -> None:
    if os.path.ismount(mnt):
        subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    """Convert onto each small tmpfs once; returns size -> (exit, stderr, out existed, listing)."""
    root = tmp_path_factory.mktemp("full-disk")
    ckpt = mid_checkpoint(root)
    mnt = root / "small-disk"
    mnt.mkdir()
    results = {}
    try:
        for size in DISK_SIZES:
            try:
                r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                    str(mnt)], capture_output=True, text=True)
            except FileNotFoundError:
                pytest.skip("no mount command here")
            if r.returncode != 0:
                pytest.skip(f"cannot mount a size-limited tmpfs here ({r.stderr.strip()})")
            try:
                out = mnt.joinpath(*NEW_PARENTS, "model-fp8")
                run = run_cli("convert", ckpt, "-o", out)
                results[size] = (run.returncode, run.stderr, out.exists(),
                                 sorted(p.name for p in mnt.iterdir()))
            finally:
                _umount(mnt)
    finally:
        _umount(mnt)
    return results


@pytest.mark.parametrize("size", DISK_SIZES)
def test_full_disk_leaves_nothing(full_disk, size):
    code, stderr, existed, listing = full_disk[size]
    assert code != 0, stderr[-2000:]
    assert not existed
    assert listing == [], f"left on the full disk: {listing}"


@pytest.mark.parametrize("size", DISK_SIZES)
def test_full_disk_clear_error(full_disk, size):
    code, stderr, _, _ = full_disk[size]
    assert code == 1
    assert "Traceback" not in stderr, stderr[-1500:]
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1
    low = errors[0].lower()
    assert "no space" in low or "disk is full" in low or "disk full" in low
    assert "model-fp8" in errors[0]


def test_file_size_limit_leaves_no_parent_folders(tmp_path):
    """The same failure where no tmpfs can be mounted: a file-size limit (RLIMIT_FSIZE, EFBIG)
    cuts the first shard short; convert says so, and neither the output nor the two folders it
    created to hold it remain."""
    import resource

    ckpt = tiny_checkpoint(tmp_path)
    base = tmp_path / "disk"
    base.mkdir()
    out = base.joinpath(*NEW_PARENTS, "model-fp8")

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    r = subprocess.run([*CLI, "convert", str(ckpt), "-o", str(out)], cwd=REPO, env=cli_env(),
                       capture_output=True, text=True, timeout=600, preexec_fn=limit)
    assert r.returncode == 1, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "File too large" in errors[0] and "model-fp8" in errors[0]
    assert sorted(p.name for p in base.iterdir()) == [], "left behind"
