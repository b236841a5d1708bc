"""``fp8export convert`` of this checkout against the same CLI of another git ref, alternated.

    .venv/bin/python bench/convert_vs_ref.py                 # against main, 3 rounds
    .venv/bin/python bench/convert_vs_ref.py --ref HEAD~3 --rounds 2

For a busy machine, where only runs made side by side compare: the ref is exported
(``git archive``) into the work folder, and each round runs, one after the other, ``cp -r`` +
fsync, the ref's ``python -m fp8export.cli convert`` (default workers) + fsync, and this
checkout's, on the checkpoint ``bench/convert.py`` generates (run it first; ``--ckpt``
elsewhere). Both use this venv's interpreter and packages; ``PYTHONPATH`` picks the source
tree. The load average is recorded before every run. Results: ``bench/results/<name>.json``
and ``.md`` (default name ``convert_vs_<ref>``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine_info, md_table, write_json  # noqa: E402
from convert import fsync_tree  # noqa: E402


def export_ref(ref: str, dest: Path) -> str:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    # the E4M3 lookup loop is a C extension (numpy fallback otherwise): both sides get theirs
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest,
                   check=True, capture_output=True)
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], check=True,
                          capture_output=True, text=True).stdout.strip()


def timed(argv: list[str], out: Path, env: dict | None, cwd: Path) -> dict:
    """Run ``argv`` (from ``cwd``) and fsync what it wrote to ``out``: wall seconds in all."""
    load = os.getloadavg()[0]
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    sync = fsync_tree(out) if out.exists() else 0.0
    total = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"exit": proc.returncode, "total_seconds": round(total, 2),
            "fsync_seconds": round(sync, 2), "load_1m_before": round(load, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="main")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8export-bench"))
    ap.add_argument("--ckpt", type=Path, default=None,
                    help="default: <work>/ckpt-2.1gb from bench/convert.py")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    ckpt = args.ckpt or args.work / "ckpt-2.1gb"
    if not (ckpt / "config.json").is_file():
        sys.exit(f"{ckpt}: no checkpoint; run bench/convert.py --work {args.work} first")
    ref_dir = args.work / "ref-src"
    commit = export_ref(args.ref, ref_dir)
    out = args.work / "vs-out"
    machine = machine_info(args.work)
    base_env = dict(os.environ, CI="1", PYTHONDONTWRITEBYTECODE="1")
    cli = [sys.executable, "-m", "fp8export.cli", "convert", str(ckpt), "-o", str(out)]
    contenders = {
        "cp -r + fsync": (["cp", "-r", str(ckpt), str(out)], None),
        f"convert {args.ref} ({commit})": (cli, dict(base_env, PYTHONPATH=str(ref_dir))),
        "convert this checkout": (cli, dict(base_env, PYTHONPATH=str(REPO))),
    }
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    for rnd in range(1, args.rounds + 1):
        for name, (cmd, env) in contenders.items():
            # cwd outside both trees: `python -m` puts the cwd first on sys.path
            r = timed(cmd, out, env, cwd=args.work)
            runs[name].append(r)
            print(f"round {rnd}: {name}: {r['total_seconds']:.2f} s (exit {r['exit']}, "
                  f"load {r['load_1m_before']})", flush=True)
    cp = [r["total_seconds"] for r in runs["cp -r + fsync"]]
    rows = []
    for name, rs in runs.items():
        t = [r["total_seconds"] for r in rs]
        rows.append((name, ", ".join(f"{x:.2f}" for x in t), f"{sorted(t)[len(t) // 2]:.2f}",
                     ", ".join(f"{x / c:.2f}" for x, c in zip(t, cp)),
                     ", ".join(str(r["load_1m_before"]) for r in rs),
                     ",".join(str(r["exit"]) for r in rs)))
    table = md_table(rows, ("contender", "seconds per round (incl. fsync)", "median",
                            "/ cp of the same round", "1-min load before each", "exit"))
    print("\n" + table)
    name = args.name or f"convert_vs_{args.ref.replace('/', '_').replace('~', '-')}"
    result = {"benchmark": "convert_vs_ref", "ref": args.ref, "ref_commit": commit,
              "checkpoint": str(ckpt), "machine": machine,
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs}
    write_json(args.results / f"{name}.json", result)
    md = [f"# convert: this checkout against {args.ref}, alternated", "",
          f"`bench/convert_vs_ref.py --ref {args.ref} --rounds {args.rounds}` on "
          f"{result['date_utc']}, commit {machine['git_commit']}, against {args.ref} = {commit}; "
          f"checkpoint `{ckpt.name}` ({sum(p.stat().st_size for p in ckpt.iterdir()) / 1e9:.2f}"
          f" GB). Machine: {machine['cpu']}, {machine['cores']} cores; 1-min load "
          f"{machine['load_avg_1m_at_start']} at start.", "", table]
    (args.results / f"{name}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.results / name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
