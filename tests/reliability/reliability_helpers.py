"""Helpers for the reliability tests: checkpoints to convert, running the CLI, tree hashes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "corrupt"))
import make_corpus  # noqa: E402

SAMPLE = REPO / "samples" / "tiny-llama" / "model"
CLI = [sys.executable, "-m", "fp8export.cli"]


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1",
            "OMP_NUM_THREADS": "1"}


def run_cli(*args, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run([*CLI, *map(str, args)], cwd=REPO, env=cli_env(), capture_output=True,
                       text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"fp8export {' '.join(map(str, args))}: exit {r.returncode}\n"
                             f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


def popen_cli(*args) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *map(str, args)], cwd=REPO, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def tree(path: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``path`` (the bytes of a whole output)."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def siblings(out: Path) -> list[Path]:
    """Hidden temporary siblings AtomicDir makes: .<name>.tmp-* and .<name>.old-*."""
    if not out.parent.exists():
        return []
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def tiny_checkpoint(root: Path) -> Path:
    """The sample model when it has been trained, else a generated one-layer Llama folder."""
    if (SAMPLE / "config.json").exists():
        return SAMPLE
    path = root / "tiny-llama"
    if not path.exists():
        make_corpus.hf_folder(path, make_corpus.llama_tensors(seed=0))
    return path


def mid_checkpoint(root: Path, hidden: int = 256, layers: int = 4, shards: int = 2) -> Path:
    """A Llama-shaped bf16 checkpoint, sharded, about 12*layers*hidden^2 bytes."""
    import torch
    from safetensors.torch import save_file

    path = root / f"llama-h{hidden}-l{layers}"
    if path.exists():
        return path
    path.mkdir(parents=True)
    inter = hidden * 11 // 4
    cfg = dict(make_corpus.LLAMA_CONFIG, hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
               num_key_value_heads=max(1, hidden // 128), vocab_size=512)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(hidden + layers)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    names: dict[str, object] = {"model.embed_tokens.weight": (512, hidden),
                                "lm_head.weight": (512, hidden), "model.norm.weight": (hidden,)}
    kv = cfg["num_key_value_heads"] * (hidden // cfg["num_attention_heads"])
    for i in range(layers):
        p = f"model.layers.{i}."
        names.update({p + "input_layernorm.weight": (hidden,),
                      p + "post_attention_layernorm.weight": (hidden,),
                      p + "self_attn.q_proj.weight": (hidden, hidden),
                      p + "self_attn.k_proj.weight": (kv, hidden),
                      p + "self_attn.v_proj.weight": (kv, hidden),
                      p + "self_attn.o_proj.weight": (hidden, hidden),
                      p + "mlp.gate_proj.weight": (inter, hidden),
                      p + "mlp.up_proj.weight": (inter, hidden),
                      p + "mlp.down_proj.weight": (hidden, inter)})
    order = list(names)
    per = -(-len(order) // shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        group = order[s * per:(s + 1) * per]
        tensors = {n: (torch.ones(names[n], dtype=torch.bfloat16) if len(names[n]) == 1
                       else w(*names[n])) for n in group}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    make_corpus.write_index(path, weight_map)
    return path


def wait_for(predicate, timeout: float, step: float = 0.002) -> float | None:
    """Poll ``predicate`` until true; returns the seconds it took, or None on timeout."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if predicate():
            return time.perf_counter() - start
        time.sleep(step)
    return None
