"""Transformer Engine reader: opening time against the number of tensors (linear, not quadratic).

    python bench/te_reader.py [--sizes 7500 15000 30000 60000] [--work DIR]

For each size, a TE 2.x state dict of ``size / 3`` Linear modules (weight, bias, pickled
``_extra_state``; tiny tensors, so the count is what is measured) is saved with ``torch.save``
and opened with fp8export's reader (``open_checkpoint`` + ``training_state``). The baseline,
measured in the same run on the same file, is ``torch.load(weights_only=True)`` plus the decode
of every extra state — the work any reader must do. A linear reader keeps the ratio flat as
the size grows; the quadratic one took 61 s at 60k tensors (3 s expected). Writes
``bench/results/te_reader.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from _common import machine_info, md_table, write_json  # noqa: E402


def _fixtures():
    name = "te_make_fixtures"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, REPO / "samples" / "te-fixtures" / "make_fixtures.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def make_file(path: Path, tensors: int) -> None:
    import numpy as np
    import torch

    mf = _fixtures()
    rng = np.random.default_rng(0)
    state, _ = mf._fwd_bwd(1, 4, 6, rng)
    extra = mf.serialize_2x(state, 1, mf.DelayedScaling(amax_history_len=4))
    sd = {}
    for i in range(tensors // 3):
        p = f"layers.{i}.proj"
        sd[f"{p}.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
        sd[f"{p}.bias"] = torch.zeros(4, dtype=torch.bfloat16)
        sd[f"{p}._extra_state"] = extra.clone()
    torch.save(sd, path)


def baseline(path: Path) -> float:
    """torch.load(weights_only=True) and the decode of every extra state."""
    import torch

    from fp8export.checkpoint.training.te_unpickle import decode_extra_state

    t0 = time.perf_counter()
    with torch.serialization.safe_globals([io.BytesIO]):
        sd = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    for name, value in sd.items():
        if name.endswith("._extra_state"):
            decode_extra_state(value, name)
    return time.perf_counter() - t0


def reader(path: Path) -> float:
    from fp8export.checkpoint.source import open_checkpoint

    t0 = time.perf_counter()
    with open_checkpoint(path) as ckpt:
        ckpt.tensors()
        state = ckpt.training_state()
    assert state is not None and state.histories
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[7500, 15000, 30000, 60000])
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows, results = [], []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for n in args.sizes:
            path = Path(tmp) / f"te-{n}.pt"
            make_file(path, n)
            base = min(baseline(path) for _ in range(2))
            ours = min(reader(path) for _ in range(2))
            results.append({"tensors": n, "baseline_s": round(base, 3),
                            "reader_s": round(ours, 3), "ratio": round(ours / base, 2)})
            rows.append((n, f"{base:.2f}", f"{ours:.2f}", f"{ours / base:.2f}"))
            path.unlink()
    print(md_table(rows, ("tensors", "torch.load + decode (s)", "fp8export reader (s)",
                          "ratio")))
    first, last = results[0], results[-1]
    growth = (last["reader_s"] / first["reader_s"]) / (last["tensors"] / first["tensors"])
    print(f"reader time grows {growth:.2f}x as fast as the tensor count "
          "(1.0 = linear; quadratic would be "
          f"{last['tensors'] / first['tensors']:.0f}x)")
    write_json(REPO / "bench" / "results" / "te_reader.json",
               {"machine": machine_info(Path(tempfile.gettempdir())), "results": results,
                "growth_vs_linear": round(growth, 2)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
