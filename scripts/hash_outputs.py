"""sha256 of every file ``convert`` writes for a fixed set of checkpoints and options.

Run it before and after a change to the convert path: the output bytes must not move.

    python scripts/hash_outputs.py                       # print the hashes
    python scripts/hash_outputs.py --write FILE.json     # record them (a baseline)
    python scripts/hash_outputs.py --check FILE.json     # exit 1 on any difference

The set: the sample bf16 LM (samples/tiny-llama) in every dialect and granularity, with an
amax file, an FP8 KV cache, 1 and 2 workers; tiny Llamas built here in bf16 (sharded), fp16
and fp32; the torchao and Keras FP8 training states with history scales. Each case runs in a
fresh interpreter (``--case NAME``) so the path a real CLI run takes, torch-free or not, is the
one measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "tiny-llama"
KERAS = ROOT / "samples" / "keras-float8" / "model" / "float8_model.keras"
TORCHAO = ROOT / "samples" / "te-fixtures" / "torchao09_delayed.pt"

# name -> (checkpoint key, convert options as ConvertConfig keywords)
CASES: dict[str, tuple[str, dict]] = {
    "sample-default": ("sample", {}),
    "sample-w1": ("sample", {"workers": 1}),
    "sample-w2": ("sample", {"workers": 2}),
    "sample-vllm": ("sample", {"format": "vllm"}),
    "sample-amax-file": ("sample", {"calib_amax": "AMAX"}),
    "sample-modelopt": ("sample", {"format": "modelopt", "calib_amax": "AMAX"}),
    "sample-no-fuse": ("sample", {"fuse_scales": False}),
    "sample-channel": ("sample", {"weight_granularity": "channel"}),
    "sample-block": ("sample", {"weight_granularity": "block", "block_size": (32, 32)}),
    "sample-kv-fp8": ("sample", {"kv_cache": "fp8", "calib_data": "CALIB", "calib_samples": 4,
                                 "seq_len": 16}),
    "llama-bf16-sharded": ("bf16-sharded", {}),
    "llama-fp16": ("fp16", {}),
    "llama-fp16-channel": ("fp16", {"weight_granularity": "channel"}),
    "llama-fp32": ("fp32", {}),
    "torchao-history": ("torchao", {"weight_scales_from_history": True}),
    "keras-history": ("keras", {"weight_scales_from_history": True}),
}


def _tiny_llama(path: Path, dtype: str, shard: str | None) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if path.exists():
        return path
    torch.manual_seed(7)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return path


def _checkpoint(key: str, work: Path) -> Path:
    if key == "sample":
        return SAMPLE / "model"
    if key == "torchao":
        return TORCHAO
    if key == "keras":
        return KERAS
    dtype = {"bf16-sharded": "bfloat16", "fp16": "float16", "fp32": "float32"}[key]
    return _tiny_llama(work / key, dtype, "200KB" if key == "bf16-sharded" else None)


def _amax_file(work: Path) -> Path:
    """A fixed amax.json for the sample LM (one range per linear module)."""
    path = work / "amax.json"
    if not path.exists():
        names = json.loads((SAMPLE / "model" / "config.json").read_text())
        layers = int(names["num_hidden_layers"])
        mods = [f"model.layers.{i}.{part}" for i in range(layers) for part in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        path.write_text(json.dumps({
            "format": "fp8export-amax", "version": 1, "method": "max", "samples": 4,
            "tokens": 40, "modules": {m: {"amax": 1.0 + 0.25 * i} for i, m in enumerate(mods)}}))
    return path


def run_case(name: str, work: Path) -> dict[str, str]:
    """Convert one case in this process; return {file: sha256} of its output."""
    from fp8export.api import convert
    from fp8export.convert.config import ConvertConfig

    key, opts = CASES[name]
    opts = dict(opts)
    if opts.get("calib_amax") == "AMAX":
        opts["calib_amax"] = _amax_file(work)
    if opts.get("calib_data") == "CALIB":
        opts["calib_data"] = SAMPLE / "data" / "calib.txt"
    out = work / "out" / name
    convert(ConvertConfig(checkpoint=_checkpoint(key, work), output=out, force=True, **opts))
    return {p.relative_to(out).as_posix(): _digest(p) for p in sorted(out.rglob("*"))
            if p.is_file()}


def _without_seconds(value):
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


def _digest(path: Path) -> str:
    """sha256 of the file; for the manifest, of the file with its wall-clock entries
    ("seconds", e.g. a KV-cache calibration's duration) removed, the only bytes that differ
    from run to run."""
    data = path.read_bytes()
    if path.name == "fp8export.json":
        raw = json.loads(data)
        if _without_seconds(raw) != raw:
            data = json.dumps(_without_seconds(raw), indent=2).encode()
    return hashlib.sha256(data).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", type=Path, help="record the hashes in this JSON file")
    ap.add_argument("--check", type=Path, help="compare with this JSON file; exit 1 if any differ")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--only", nargs="*", default=None, help="run only these cases")
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.work)))
        return 0
    hashes: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="fp8export-hashes-") as tmp:
        work = Path(tmp)
        for key in ("bf16-sharded", "fp16", "fp32"):  # built once, in this process
            _checkpoint(key, work)
        for name in args.only or CASES:
            r = subprocess.run([sys.executable, __file__, "--case", name, "--work", str(work)],
                               capture_output=True, text=True)
            if r.returncode:
                sys.stderr.write(r.stdout + r.stderr)
                raise SystemExit(f"case {name} failed")
            hashes[name] = json.loads(r.stdout.strip().splitlines()[-1])
            for f, h in hashes[name].items():
                print(f"{h}  {name}/{f}")
    if args.write:
        args.write.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    if args.check:
        want = json.loads(args.check.read_text())
        bad = [f"{c}/{f}: {want.get(c, {}).get(f)} -> {h}" for c, files in hashes.items()
               for f, h in files.items() if want.get(c, {}).get(f) != h]
        bad += [f"{c}/{f}: missing" for c, files in want.items() if c in hashes
                for f in files if f not in hashes[c]]
        print("\n".join(bad) if bad else f"all {sum(map(len, hashes.values()))} files identical")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
